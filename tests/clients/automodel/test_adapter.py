"""`batch_from_automodel` on hand-written collator outputs: the contract's goldens and every input form.

Expected values are written out by hand; no AutoModel import is needed here (see
`test_collators_text.py` and `test_collators_vlm.py` for the real collators).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzletron.dataset import DataLayout, Modality, batch_from_automodel
from puzzletron.dataset.errors import BatchValidationError

PACKED = DataLayout.PACKED_VARLEN


def _convert(collated: dict, *, layout: DataLayout | str = PACKED, ids: list[str] | None = None):
    rows = collated["input_ids"].shape[0] if collated["input_ids"].dim() == 2 else 1
    sample_ids = ids if ids is not None else [f"s{i}" for i in range(rows)]
    return batch_from_automodel(collated, sample_ids=sample_ids, source_metadata={"rev": "x"}, layout=layout)


# --- the contract's goldens -------------------------------------------------------------------------------


def test_golden_neat_ids_one_row() -> None:
    batch = _convert(
        {"input_ids": torch.arange(8)[None], "_packed_seq_ids": torch.tensor([[1, 1, 1, 2, 2, 2, 0, 0]])}
    )
    assert batch.sequence.global_cu_seqlens.tolist() == [0, 3, 6]
    assert batch.sequence.seq_ids.tolist() == [[0, 0, 0, 1, 1, 1, -1, -1]]
    assert batch.sequence.max_seqlen == 3
    assert batch.sequence.sample_offsets == ((0, 3), (3, 6))
    assert batch.hidden_mask.tolist() == [[True] * 6 + [False] * 2]


def test_golden_neat_ids_two_rows_are_global() -> None:
    packed = torch.tensor([[1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]])
    batch = _convert({"input_ids": torch.zeros(2, 8, dtype=torch.long), "_packed_seq_ids": packed})
    assert batch.sequence.seq_ids.tolist() == [[0, 0, 0, 1, 1, 1, -1, -1], [2, 2, 2, 2, -1, -1, -1, -1]]
    assert batch.sequence.global_cu_seqlens.tolist() == [0, 3, 6, 10]
    assert batch.sequence.max_seqlen == 4


def test_golden_legacy_cu_seqlens_with_targets() -> None:
    targets = torch.arange(100, 112)[None]
    batch = _convert(
        {"input_ids": torch.arange(12)[None], "targets": targets, "cu_seqlens": torch.tensor([[0, 3, 7, 12]])}
    )
    assert batch.sequence.seq_ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2]]
    assert batch.sequence.global_cu_seqlens.tolist() == [0, 3, 7, 12]
    assert batch.labels.tolist() == [list(range(100, 112))]  # targets become labels, not shifted again
    assert "targets" not in batch.model_kwargs
    assert batch.model_kwargs["cu_seqlens"] is not None  # stays a model kwarg


# --- labels and masks ---------------------------------------------------------------------------------------


def test_labels_are_untouched_and_not_copied_when_padding_is_already_ignored() -> None:
    labels = torch.tensor([[5, -100, 7, -100]])
    batch = _convert(
        {
            "input_ids": torch.arange(4)[None],
            "labels": labels,
            "attention_mask": torch.tensor([[1, 1, 1, 0]]),
        },
        layout="padded_varlen",
    )
    assert batch.labels.data_ptr() == labels.data_ptr()
    assert batch.ce_mask.tolist() == [[True, False, True, False]]
    assert batch.kd_mask.tolist() == batch.ce_mask.tolist()
    assert batch.kd_mask.data_ptr() != batch.ce_mask.data_ptr()
    assert batch.hidden_mask.tolist() == [[True, True, True, False]]


def test_labels_on_padding_become_ignore_index_without_mutating_the_input() -> None:
    labels = torch.tensor([[5, 6, 7, 8]])
    batch = _convert(
        {
            "input_ids": torch.arange(4)[None],
            "labels": labels,
            "padding_mask": torch.tensor([[0, 0, 1, 1]]).bool(),
        },
        layout="padded_varlen",
    )
    assert batch.labels.tolist() == [[5, 6, -100, -100]]
    assert labels.tolist() == [[5, 6, 7, 8]]
    assert batch.ce_mask.tolist() == [[True, True, False, False]]


def test_loss_mask_wins_over_labels_and_is_anded_with_valid_tokens() -> None:
    batch = _convert(
        {
            "input_ids": torch.arange(4)[None],
            "labels": torch.tensor([[1, 2, 3, 4]]),
            "loss_mask": torch.tensor([[0, 1, 1, 1]]),
            "attention_mask": torch.tensor([[1, 1, 1, 0]]),
        },
        layout="padded_varlen",
    )
    assert batch.ce_mask.tolist() == [[False, True, True, False]]
    assert "loss_mask" not in batch.model_kwargs


def test_one_dimensional_inputs_are_one_row_views() -> None:
    input_ids = torch.arange(6)
    labels = torch.arange(6) + 10
    batch = _convert({"input_ids": input_ids, "labels": labels}, layout="fixed", ids=["only"])
    assert tuple(batch.model_kwargs["input_ids"].shape) == (1, 6)
    assert batch.model_kwargs["input_ids"].data_ptr() == input_ids.data_ptr()
    assert batch.labels.data_ptr() == labels.data_ptr()


def test_one_row_of_mrope_positions_gets_a_batch_axis() -> None:
    positions = torch.arange(12).reshape(3, 4)
    batch = _convert({"input_ids": torch.arange(4), "position_ids": positions}, layout="fixed", ids=["only"])
    assert tuple(batch.model_kwargs["position_ids"].shape) == (3, 1, 4)
    assert batch.model_kwargs["position_ids"].data_ptr() == positions.data_ptr()


def test_no_attention_mask_is_invented_and_other_keys_pass_through() -> None:
    collated = {
        "input_ids": torch.arange(6)[None],
        "labels": torch.arange(6)[None],
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]),
        "seq_lens": torch.tensor([[3, 3]]),
        "seq_lens_padded": torch.tensor([[3, 3]]),
        "qkv_format": "thd",
    }
    batch = _convert(collated)
    assert "attention_mask" not in batch.model_kwargs
    assert set(batch.model_kwargs) == {
        "input_ids",
        "position_ids",
        "seq_lens",
        "seq_lens_padded",
        "qkv_format",
    }
    assert batch.model_kwargs["qkv_format"] == "thd"
    assert batch.model_kwargs["position_ids"] is collated["position_ids"]


# --- every packed form --------------------------------------------------------------------------------------


def test_thd_seq_lens_with_sentinel_and_padded_spans() -> None:
    # row 0: doc of 3 + 1 pad (padded span 4), doc of 2; row 1: doc of 4 in a span of 6, unused slot -1000.
    batch = _convert(
        {
            "input_ids": torch.zeros(2, 6, dtype=torch.long),
            "labels": torch.ones(2, 6, dtype=torch.long),
            "seq_lens": torch.tensor([[3, 2], [4, -1000]]),
            "seq_lens_padded": torch.tensor([[4, 2], [6, -1000]]),
            "qkv_format": "thd",
        }
    )
    assert batch.sequence.seq_ids.tolist() == [[0, 0, 0, -1, 1, 1], [2, 2, 2, 2, -1, -1]]
    assert batch.sequence.global_cu_seqlens.tolist() == [0, 3, 5, 9]
    assert batch.labels.tolist() == [[1, 1, 1, -100, 1, 1], [1, 1, 1, 1, -100, -100]]


def test_block_causal_mask_with_one_document_per_pack_still_carries_cu() -> None:
    # What neat_packed_collater emits when no pack holds two documents: no _packed_seq_ids at all.
    lengths = [3, 4]
    mask = torch.zeros(2, 1, 5, 5, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, 0, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    batch = _convert({"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": mask})
    assert batch.sequence.seq_ids.tolist() == [[0, 0, 0, -1, -1], [1, 1, 1, 1, -1]]
    assert batch.sequence.global_cu_seqlens.tolist() == [0, 3, 7]
    assert batch.sequence.max_seqlen == 4


def test_block_causal_mask_splits_documents_inside_a_row() -> None:
    mask = torch.zeros(1, 1, 5, 5, dtype=torch.bool)
    mask[0, 0, :2, :2] = torch.ones(2, 2, dtype=torch.bool).tril()
    mask[0, 0, 2:5, 2:5] = torch.ones(3, 3, dtype=torch.bool).tril()
    batch = _convert({"input_ids": torch.zeros(1, 5, dtype=torch.long), "attention_mask": mask})
    assert batch.sequence.seq_ids.tolist() == [[0, 0, 1, 1, 1]]


def test_document_id_attention_mask() -> None:
    batch = _convert(
        {
            "input_ids": torch.zeros(2, 4, dtype=torch.long),
            "attention_mask": torch.tensor([[1, 1, 2, 0], [1, 2, 3, 3]]),
        }
    )
    assert batch.sequence.seq_ids.tolist() == [[0, 0, 1, -1], [2, 3, 4, 4]]
    assert batch.sequence.global_cu_seqlens.tolist() == [0, 2, 3, 4, 5, 7]


def test_flash_cu_seq_lens_with_one_document_per_row() -> None:
    # B=2, T=8: row 0 = doc of 5 + pad run of 3, row 1 = doc of 6 + pad run of 2 (AutoModel's physical cu).
    collated = {
        "input_ids": torch.zeros(2, 8, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 0, 0], [0, 1, 2, 3, 4, 5, 0, 0]]),
        "cu_seq_lens_q": torch.tensor([0, 5, 8, 14, 16], dtype=torch.int32),
        "cu_seq_lens_k": torch.tensor([0, 5, 8, 14, 16], dtype=torch.int32),
        "max_length_q": 6,
        "max_length_k": 6,
    }
    batch = _convert(collated)
    assert batch.sequence.seq_ids.tolist() == [[0] * 5 + [-1] * 3, [1] * 6 + [-1] * 2]
    assert batch.sequence.global_cu_seqlens.tolist() == [0, 5, 11]
    assert batch.model_kwargs["max_length_q"] == 6


def test_flash_cu_seq_lens_refuses_to_guess_a_second_document() -> None:
    collated = {
        "input_ids": torch.zeros(1, 6, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]),
        "cu_seq_lens_q": torch.tensor([0, 3, 6], dtype=torch.int32),
    }
    with pytest.raises(BatchValidationError, match="_packed_seq_ids"):
        _convert(collated)


def test_flash_cu_seq_lens_must_cover_the_flattened_batch() -> None:
    collated = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 3, 7])}
    with pytest.raises(BatchValidationError, match="cu_seq_lens_q"):
        _convert(collated)


def test_per_row_cu_seqlens_with_packed_token_indices() -> None:
    # AutoModel's packed-sequence metadata: row-local cu over valid tokens, -1 after the last boundary.
    collated = {
        "input_ids": torch.zeros(2, 6, dtype=torch.long),
        "packed_token_indices": torch.tensor([[0, 1, 2, 3, 4, -1], [0, 1, -1, -1, -1, -1]]),
        "cu_seqlens": torch.tensor([[0, 2, 5], [0, 2, -1]], dtype=torch.int32),
        "max_seqlen": 3,
    }
    batch = _convert(collated)
    assert batch.sequence.seq_ids.tolist() == [[0, 0, 1, 1, 1, -1], [2, 2, -1, -1, -1, -1]]
    assert batch.sequence.global_cu_seqlens.tolist() == [0, 2, 5, 7]


def test_flat_cu_seqlens_for_several_rows_needs_seq_idx() -> None:
    base = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "cu_seqlens": torch.tensor([0, 3, 6])}
    with pytest.raises(BatchValidationError, match="seq_idx"):
        _convert(base)
    batch = _convert({**base, "seq_idx": torch.tensor([[0, 0, 0], [1, 1, 1]])})
    assert batch.sequence.seq_ids.tolist() == [[0, 0, 0], [1, 1, 1]]
    assert "seq_idx" in batch.model_kwargs
    with pytest.raises(BatchValidationError, match="seq_idx"):
        _convert({**base, "seq_idx": torch.tensor([[0, 0, 1], [1, 1, 1]])})


def test_legacy_cu_seqlens_must_span_the_row() -> None:
    with pytest.raises(BatchValidationError, match="cu_seqlens"):
        _convert(
            {"input_ids": torch.zeros(1, 12, dtype=torch.long), "cu_seqlens": torch.tensor([[0, 3, 7, 11]])}
        )


def test_default_collater_rows_become_one_document_each_in_packed_layout() -> None:
    batch = _convert(
        {
            "input_ids": torch.zeros(2, 4, dtype=torch.long),
            "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
        }
    )
    assert batch.sequence.global_cu_seqlens.tolist() == [0, 3, 5]


def test_padded_layout_carries_no_cu() -> None:
    batch = _convert(
        {"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1, 0]])},
        layout="padded_varlen",
    )
    assert batch.layout is DataLayout.PADDED_VARLEN
    assert batch.sequence.global_cu_seqlens is None
    assert batch.sequence.seq_ids is None


# --- media --------------------------------------------------------------------------------------------------


def _vlm(counts, grid_rows: int, *, patches_per_image: int = 4) -> dict:
    collated = {
        "input_ids": torch.zeros(len(counts) if counts is not None else 2, 5, dtype=torch.long),
        "image_grid_thw": torch.tensor([[1, 2, 2]] * grid_rows),
        "pixel_values": torch.zeros(grid_rows * patches_per_image, 1176),
    }
    if counts is not None:
        collated["n_images_per_sample"] = torch.tensor(counts)
    return collated


def test_explicit_counts_two_and_zero_are_kept_not_guessed() -> None:
    batch = _convert(_vlm([2, 0], 2), layout="padded_varlen")
    assert batch.sequence.media_counts.tolist() == [2, 0]
    assert batch.sequence.media_offsets.tolist() == [0, 2, 2]
    assert batch.modality is Modality.MULTIMODAL
    assert "n_images_per_sample" not in batch.model_kwargs
    assert batch.model_kwargs["image_grid_thw"].shape[0] == 2


def test_counts_may_be_a_sequence_under_any_known_key() -> None:
    collated = _vlm(None, 3)
    collated["input_ids"] = torch.zeros(2, 5, dtype=torch.long)
    collated["num_images_per_sample"] = [1, 2]
    assert _convert(collated, layout="fixed").sequence.media_counts.tolist() == [1, 2]


def test_grid_rows_equal_to_batch_size_are_not_guessed() -> None:
    with pytest.raises(BatchValidationError, match="n_images_per_sample"):
        _convert(_vlm(None, 2), layout="padded_varlen")


def test_single_row_counts_come_from_the_grid() -> None:
    collated = _vlm(None, 3)
    collated["input_ids"] = torch.zeros(1, 5, dtype=torch.long)
    assert _convert(collated, layout="fixed").sequence.media_counts.tolist() == [3]


def test_counts_must_match_grid_and_pixels() -> None:
    with pytest.raises(BatchValidationError, match="image_grid_thw"):
        _convert(_vlm([1, 0], 2), layout="fixed")
    with pytest.raises(BatchValidationError, match="pixel_values"):
        _convert(_vlm([1, 1], 2, patches_per_image=3), layout="fixed")
    with pytest.raises(BatchValidationError, match="n_images_per_sample"):
        _convert(_vlm([1, 1, 1], 3) | {"input_ids": torch.zeros(2, 5, dtype=torch.long)}, layout="fixed")


def test_text_batch_is_text_modality_without_media() -> None:
    batch = _convert({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, layout="fixed")
    assert batch.modality is Modality.TEXT
    assert batch.sequence.media_counts is None


# --- errors name the key ------------------------------------------------------------------------------------


def test_input_ids_must_be_a_tensor() -> None:
    with pytest.raises(BatchValidationError, match="'input_ids'"):
        batch_from_automodel({"input_ids": [[1, 2]]}, sample_ids=["a"], source_metadata={}, layout="fixed")


def test_labels_must_match_input_ids() -> None:
    with pytest.raises(BatchValidationError, match="'labels'"):
        _convert(
            {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 3, dtype=torch.long)}
        )


def test_packed_seq_ids_must_match_input_ids() -> None:
    with pytest.raises(BatchValidationError, match="'_packed_seq_ids'"):
        _convert({"input_ids": torch.zeros(1, 4, dtype=torch.long), "_packed_seq_ids": torch.ones(1, 5)})


def test_an_unknown_layout_is_an_error_naming_layout() -> None:
    with pytest.raises(BatchValidationError, match=r"layout must be one of .*'packed_varlen'.*got 'packed'"):
        _convert({"input_ids": torch.zeros(1, 2, dtype=torch.long)}, layout="packed")


def test_sample_ids_as_one_string_is_an_error_not_one_id_per_character() -> None:
    # "ab" for B = 2 used to become the ids ("a", "b") silently.
    with pytest.raises(BatchValidationError, match="sample_ids must be a sequence of str"):
        _convert({"input_ids": torch.zeros(2, 2, dtype=torch.long)}, layout="fixed", ids="ab")


@pytest.mark.parametrize("layout", ["fixed", "padded_varlen"])
@pytest.mark.parametrize(
    ("extra", "source"),
    [
        ({"_packed_seq_ids": torch.tensor([[1, 1, 1, 1], [1, 1, 2, 0]])}, "'_packed_seq_ids'"),
        ({"attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 2, 0]])}, "'attention_mask'"),
        ({"seq_lens": torch.tensor([[4, -1000], [2, 1]])}, "'seq_lens'"),
    ],
)
def test_an_unpacked_layout_refuses_rows_holding_several_documents(
    layout: str, extra: dict, source: str
) -> None:
    # One sample per row: the boundaries would be lost (and documents attend to each other) otherwise.
    with pytest.raises(
        BatchValidationError, match=rf"row 1 holds 2 documents \(from {source}\).*packed_varlen"
    ):
        _convert({"input_ids": torch.zeros(2, 4, dtype=torch.long), **extra}, layout=layout)
    packed = _convert({"input_ids": torch.zeros(2, 4, dtype=torch.long), **extra})
    assert packed.sequence.global_cu_seqlens.tolist() == [0, 4, 6, 7]


def test_sample_ids_and_source_metadata_are_kept() -> None:
    batch = _convert({"input_ids": torch.zeros(1, 2, dtype=torch.long)}, layout="fixed", ids=["row-a"])
    assert batch.sample_ids == ("row-a",)
    assert batch.source_metadata == {"rev": "x"}


# --- every form of one packing agrees (property) ---------------------------------------------------------


@st.composite
def _packs(draw: st.DrawFn) -> tuple[list[list[int]], int]:
    rows = draw(st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=4), min_size=1, max_size=3))
    length = max(sum(r) for r in rows) + draw(st.integers(0, 3))
    return rows, length


def _forms(rows: list[list[int]], length: int) -> dict[str, dict]:
    """The same packing written in every form AutoModel emits (built here from the lengths)."""
    batch = len(rows)
    ids = torch.zeros(batch, length, dtype=torch.long)
    block = torch.zeros(batch, 1, length, length, dtype=torch.bool)
    seq_lens = torch.full((batch, max(len(r) for r in rows)), -1000)
    padded = seq_lens.clone()
    row_cu = torch.full((batch, max(len(r) for r in rows) + 1), -1, dtype=torch.int32)
    flash = [0]
    for b, lengths in enumerate(rows):
        start = 0
        row_cu[b, 0] = 0
        for d, n in enumerate(lengths):
            ids[b, start : start + n] = d + 1
            block[b, 0, start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
            seq_lens[b, d] = padded[b, d] = n
            row_cu[b, d + 1] = start + n
            flash.append(b * length + start + n)
            start += n
        padded[b, len(lengths) - 1] += length - start
        if start < length:
            flash.append((b + 1) * length)
    base = {"input_ids": torch.zeros(batch, length, dtype=torch.long)}
    forms = {
        "_packed_seq_ids": {**base, "_packed_seq_ids": ids},
        "block_causal": {**base, "attention_mask": block},
        "document_ids": {**base, "attention_mask": ids},
        "thd": {**base, "seq_lens": seq_lens, "seq_lens_padded": padded, "qkv_format": "thd"},
        "row_cu": {
            **base,
            "cu_seqlens": row_cu,
            "packed_token_indices": torch.arange(length).expand(batch, length).masked_fill(ids == 0, -1),
        },
    }
    if all(len(r) == 1 for r in rows):  # AutoModel omits _packed_seq_ids only then
        forms["flash"] = {**base, "cu_seq_lens_q": torch.tensor(flash, dtype=torch.int32)}
    return forms


@settings(max_examples=60, deadline=None)
@given(_packs())
def test_every_packed_form_gives_the_same_samples(pack: tuple[list[list[int]], int]) -> None:
    rows, length = pack
    lengths = [n for r in rows for n in r]
    expected_cu = [0]
    for n in lengths:
        expected_cu.append(expected_cu[-1] + n)
    reference = None
    for name, collated in _forms(rows, length).items():
        batch = _convert(collated)
        assert batch.sequence.global_cu_seqlens.tolist() == expected_cu, name
        assert batch.sequence.max_seqlen == max(lengths), name
        if reference is None:
            reference = batch.sequence.seq_ids
        assert torch.equal(batch.sequence.seq_ids, reference), name

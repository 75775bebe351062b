"""`PuzzletronBatch`: construction rules (contract 3.1), goldens of every method (3.3) and the **Better:**
items. Expected tensors are written by hand; derived batches are re-validated through the public constructor
(`dataclasses.replace`) to prove the no-validation path only ever builds valid batches."""

from __future__ import annotations

import dataclasses
import itertools
import types
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from puzzletron.dataset import (
    DataLayout,
    Modality,
    PackedSequenceMetadata,
    PuzzletronBatch,
    parallel,
)
from puzzletron.dataset.batch import _core as batch_module
from puzzletron.dataset.batch import _fingerprint, _validation
from puzzletron.dataset.batch import segments as _segments
from puzzletron.dataset.errors import BatchValidationError


def revalidated(b: PuzzletronBatch) -> PuzzletronBatch:
    """Run every construction rule on a derived batch."""
    return dataclasses.replace(b)


def packed_row(
    lengths: list[int], total: int, *, sample_ids: tuple[str, ...] = (), **kwargs: Any
) -> PuzzletronBatch:
    """One packed row ``[1, total]``: samples of ``lengths`` then trailing padding; token value = position."""
    n_valid = sum(lengths)
    ids = torch.tensor([[i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * (total - n_valid)])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    hidden = ids >= 0
    return PuzzletronBatch(
        model_kwargs={"input_ids": torch.arange(total).reshape(1, total), **kwargs},
        labels=torch.arange(total).reshape(1, total).masked_fill(~hidden, -100),
        ce_mask=hidden.clone(),
        kd_mask=hidden.clone(),
        hidden_mask=hidden,
        sequence=PackedSequenceMetadata(global_cu_seqlens=cu, seq_ids=ids, max_seqlen=max(lengths)),
        sample_ids=sample_ids,
        layout=DataLayout.PACKED_VARLEN,
    )


def media_batch(*, flat_patches: bool = False, with_grid: bool = True) -> PuzzletronBatch:
    """3 rows ``a, b, c`` of 4 tokens with 2, 1, 2 images of grid 1x1x1 (or 1x2x2 flat patches)."""
    grid = torch.tensor([[1, 2, 2]] * 5) if flat_patches else torch.ones(5, 3, dtype=torch.long)
    rows_per_image = 4 if flat_patches else 1
    # Row k of pixel_values holds the image number, so alignment is visible in the values.
    pixels = torch.arange(5).repeat_interleave(rows_per_image).float().reshape(-1, 1).repeat(1, 6)
    kwargs: dict[str, Any] = {
        "input_ids": torch.arange(12).reshape(3, 4),
        "attention_mask": torch.ones(3, 4, dtype=torch.long),
        "pixel_values": pixels,
    }
    if with_grid:
        kwargs["image_grid_thw"] = grid
    return PuzzletronBatch(
        model_kwargs=kwargs,
        labels=torch.arange(12).reshape(3, 4),
        ce_mask=torch.ones(3, 4, dtype=torch.bool),
        hidden_mask=torch.ones(3, 4, dtype=torch.bool),
        sequence=PackedSequenceMetadata(
            media_counts=torch.tensor([2, 1, 2]), media_offsets=torch.tensor([0, 2, 3, 5])
        ),
        sample_ids=("a", "b", "c"),
        modality="multimodal",
    )


def plain(**overrides: Any) -> PuzzletronBatch:
    fields: dict[str, Any] = {"model_kwargs": {"input_ids": torch.zeros(2, 3, dtype=torch.long)}}
    fields.update(overrides)
    return PuzzletronBatch(**fields)


# -- enums and construction --------------------------------------------------------------------------


def test_enum_values() -> None:
    assert [m.value for m in DataLayout] == ["fixed", "padded_varlen", "packed_varlen"]
    assert [m.value for m in Modality] == ["text", "multimodal"]
    assert DataLayout("packed_varlen") is DataLayout.PACKED_VARLEN


def test_strings_are_coerced_to_enums_and_sample_ids_to_str_tuple() -> None:
    b = plain(layout="padded_varlen", modality="multimodal", sample_ids=[1, "x"])
    assert b.layout is DataLayout.PADDED_VARLEN
    assert b.modality is Modality.MULTIMODAL
    assert b.sample_ids == ("1", "x")
    assert (b.batch_size, b.sequence_length) == (2, 3)
    assert b.input_ids is b.model_kwargs["input_ids"]


def test_layout_string_is_coerced_before_the_cu_rule_compares_it() -> None:
    b = packed_row([2, 2], 4)
    again = PuzzletronBatch(
        model_kwargs=b.model_kwargs, sequence=b.sequence, hidden_mask=b.hidden_mask, layout="packed_varlen"
    )
    assert again.layout is DataLayout.PACKED_VARLEN


def test_unknown_enum_string_names_the_field() -> None:
    with pytest.raises(BatchValidationError, match="layout must be one of"):
        plain(layout="varlen")
    with pytest.raises(BatchValidationError, match="modality"):
        plain(modality="audio")


def test_model_kwargs_is_a_read_only_private_copy() -> None:
    raw = {"input_ids": torch.zeros(1, 2, dtype=torch.long)}
    b = PuzzletronBatch(model_kwargs=raw)
    assert isinstance(b.model_kwargs, types.MappingProxyType)
    with pytest.raises(TypeError):
        b.model_kwargs["attention_mask"] = torch.ones(1, 2)  # type: ignore[index]
    raw["attention_mask"] = torch.ones(1, 5)  # mutating the caller's dict does not reach the batch
    assert "attention_mask" not in b.model_kwargs
    with pytest.raises(TypeError):
        b.source_metadata["x"] = 1  # type: ignore[index]


def test_fingerprint_is_not_an_init_argument() -> None:
    with pytest.raises(TypeError):
        PuzzletronBatch(model_kwargs={"input_ids": torch.zeros(1, 1, dtype=torch.long)}, fingerprint="x")  # type: ignore[call-arg]


# -- 3.1 validation, one test per rule ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"model_kwargs": {}}, "input_ids"),
        ({"model_kwargs": {"input_ids": torch.zeros(3, dtype=torch.long)}}, "input_ids"),
        ({"model_kwargs": {"input_ids": [[1, 2]]}}, "input_ids"),
        ({"sample_ids": ("a",)}, "sample_ids"),
        ({"sample_ids": "ab"}, "sample_ids"),
        ({"labels": torch.zeros(2, 4, dtype=torch.long)}, "labels"),
        ({"ce_mask": torch.ones(3, 3, dtype=torch.bool)}, "ce_mask"),
        ({"kd_mask": torch.ones(2, 3, 1, dtype=torch.bool)}, "kd_mask"),
        ({"hidden_mask": torch.ones(2, dtype=torch.bool)}, "hidden_mask"),
        (
            {"model_kwargs": {"input_ids": torch.zeros(2, 3), "source": 1}, "source_metadata": [1]},
            "source_metadata",
        ),
        ({"sequence": {"seq_ids": None}}, "sequence"),
    ],
)
def test_shape_rules_name_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(BatchValidationError, match=field):
        plain(**overrides)


@pytest.mark.parametrize(
    "key", ["attention_mask", "cache_position", "seq_idx", "mm_token_type_ids", "padding_mask", "input_ids"]
)
def test_sequence_kwargs_must_end_in_T(key: str) -> None:
    kwargs = {"input_ids": torch.zeros(2, 3, dtype=torch.long), key: torch.zeros(2, 4, dtype=torch.long)}
    if key == "input_ids":
        kwargs = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
        plain(model_kwargs=kwargs)  # the control: T from input_ids itself is fine
        return
    with pytest.raises(BatchValidationError, match=key):
        plain(model_kwargs=kwargs)


def test_position_ids_may_be_mrope_but_not_anything_else() -> None:
    ids = torch.zeros(2, 3, dtype=torch.long)
    plain(model_kwargs={"input_ids": ids, "position_ids": torch.zeros(2, 3, dtype=torch.long)})
    plain(model_kwargs={"input_ids": ids, "position_ids": torch.zeros(3, 2, 3, dtype=torch.long)})
    for bad in (torch.zeros(1, 3), torch.zeros(3, 1, 3), torch.zeros(2, 4), torch.zeros(3)):
        with pytest.raises(BatchValidationError, match="position_ids"):
            plain(model_kwargs={"input_ids": ids, "position_ids": bad})


def test_inputs_embeds_must_be_B_T_H() -> None:
    ids = torch.zeros(2, 3, dtype=torch.long)
    plain(model_kwargs={"input_ids": ids, "inputs_embeds": torch.zeros(2, 3, 8)})
    with pytest.raises(BatchValidationError, match="inputs_embeds"):
        plain(model_kwargs={"input_ids": ids, "inputs_embeds": torch.zeros(2, 4, 8)})


def test_masks_must_be_subsets_of_hidden_and_labels_ignored_outside_it() -> None:
    hidden = torch.tensor([[True, True, False], [True, False, False]])
    plain(hidden_mask=hidden, ce_mask=hidden.clone(), labels=torch.tensor([[1, 2, -100], [3, -100, -100]]))
    with pytest.raises(BatchValidationError, match="ce_mask must be a subset of hidden_mask"):
        plain(hidden_mask=hidden, ce_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(BatchValidationError, match="kd_mask must be a subset of hidden_mask"):
        plain(hidden_mask=hidden, kd_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(BatchValidationError, match="labels must be -100"):
        plain(hidden_mask=hidden, labels=torch.tensor([[1, 2, 3], [3, -100, -100]]))


def _packed(**seq: Any) -> dict[str, Any]:
    """Fields of a valid packed row ``[[0,0,0,1,1,-1]]`` with metadata overrides."""
    meta: dict[str, Any] = {
        "global_cu_seqlens": torch.tensor([0, 3, 5], dtype=torch.int32),
        "seq_ids": torch.tensor([[0, 0, 0, 1, 1, -1]]),
    }
    meta.update(seq)
    return {
        "model_kwargs": {"input_ids": torch.arange(6).reshape(1, 6)},
        "sequence": PackedSequenceMetadata(**meta),
        "layout": "packed_varlen",
    }


def test_valid_packed_row_is_accepted() -> None:
    PuzzletronBatch(**_packed(max_seqlen=3, sample_offsets=((0, 3), (3, 5))))


@pytest.mark.parametrize(
    ("seq", "message"),
    [
        ({"global_cu_seqlens": torch.tensor([[0, 3, 5]])}, "global_cu_seqlens must be a 1-D"),
        ({"global_cu_seqlens": torch.tensor([], dtype=torch.int32)}, "global_cu_seqlens must be a 1-D"),
        # [0] means zero samples: only valid when no token is valid.
        ({"global_cu_seqlens": torch.tensor([0])}, "global_cu_seqlens must end at the valid-token count"),
        ({"global_cu_seqlens": torch.tensor([0.0, 3.0, 5.0])}, "global_cu_seqlens must be a 1-D integer"),
        ({"global_cu_seqlens": torch.tensor([1, 3, 5])}, "global_cu_seqlens must start at 0"),
        ({"global_cu_seqlens": torch.tensor([0, 3, 3, 5])}, "global_cu_seqlens must be strictly increasing"),
        (
            {"global_cu_seqlens": torch.tensor([0, 3, 6])},
            "global_cu_seqlens must end at the valid-token count",
        ),
        ({"sample_offsets": ((0, 3), (3, 6))}, "sample_offsets must equal"),
        ({"sample_offsets": ((0, 5),)}, "sample_offsets must have one pair per sample"),
        ({"max_seqlen": 2}, "max_seqlen must equal the largest segment"),
        ({"seq_ids": torch.tensor([[0, 0, 1, 1, 1, -1]])}, "seq_ids token counts"),
        ({"seq_ids": torch.tensor([[0, 0, 0, 2, 2, -1]])}, "seq_ids must be -1 or ids 0..1"),
        (
            {"seq_ids": torch.tensor([[1, 1, 1, 0, 0, -1]]), "global_cu_seqlens": torch.tensor([0, 2, 5])},
            "row-major",
        ),
        ({"seq_ids": torch.tensor([[0, 0, 0, 1, 1, -2]])}, "seq_ids must be >= 0"),
        # Counts and order are right, but sample 0 is cut by a padding gap: two runs for one id.
        ({"seq_ids": torch.tensor([[0, 0, -1, 0, 1, 1]])}, "one contiguous run inside one row"),
        ({"seq_ids": torch.tensor([0, 0, 0, 1, 1, -1])}, "seq_ids must be an integer tensor"),
        ({"cp_size": 2, "cp_rank": 0}, "local_cu_seqlens is required"),
        (
            {"cp_size": 2, "cp_rank": 1, "local_cu_seqlens": torch.tensor([0, 3, 4])},
            "local_cu_seqlens must end at the local valid-token count",
        ),
        (
            {"cp_size": 2, "cp_rank": 1, "local_cu_seqlens": torch.tensor([0, 4, 3, 5])},
            "local_cu_seqlens must be strictly increasing",
        ),
        (
            {"cp_size": 2, "cp_rank": 1, "local_cu_seqlens": torch.tensor([0, 3, 5]), "max_seqlen": 3},
            None,  # valid: max is the local one
        ),
        (
            {"cp_size": 2, "cp_rank": 1, "local_cu_seqlens": torch.tensor([0, 3, 5]), "max_seqlen": 5},
            "max_seqlen must equal the largest local segment",
        ),
    ],
)
def test_cu_and_seq_id_rules(seq: dict[str, Any], message: str | None) -> None:
    if message is None:
        PuzzletronBatch(**_packed(**seq))
        return
    with pytest.raises(BatchValidationError, match=message):
        PuzzletronBatch(**_packed(**seq))


def test_a_sample_may_not_continue_on_the_next_row() -> None:
    # Valid counts and row-major order, but sample 1 spans rows 0 and 1: a row split would cut it in two.
    seq_ids = torch.tensor([[0, 0, 1, 1], [1, 2, 2, -1]])
    with pytest.raises(BatchValidationError, match="one contiguous run inside one row"):
        PuzzletronBatch(
            {"input_ids": torch.zeros(2, 4, dtype=torch.long)},
            hidden_mask=seq_ids >= 0,
            sequence=PackedSequenceMetadata(global_cu_seqlens=torch.tensor([0, 2, 5, 7]), seq_ids=seq_ids),
            layout="packed_varlen",
        )


def test_sample_offsets_accept_a_tensor_and_refuse_non_integers() -> None:
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    seq = PackedSequenceMetadata(global_cu_seqlens=cu, sample_offsets=torch.tensor([[0, 3], [3, 5]]))
    assert seq.sample_offsets == ((0, 3), (3, 5))
    with pytest.raises(BatchValidationError, match="sample_offsets must be pairs of ints"):
        PackedSequenceMetadata(sample_offsets=((0, 3.5),))


def test_cu_requires_packed_layout() -> None:
    fields = _packed()
    fields["layout"] = "padded_varlen"
    with pytest.raises(BatchValidationError, match="global_cu_seqlens requires layout 'packed_varlen'"):
        PuzzletronBatch(**fields)


def test_valid_count_comes_from_hidden_mask_then_B_times_T() -> None:
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    ids = {"input_ids": torch.arange(6).reshape(1, 6)}
    hidden = torch.tensor([[True] * 5 + [False]])
    PuzzletronBatch(
        ids, hidden_mask=hidden, sequence=PackedSequenceMetadata(global_cu_seqlens=cu), layout="packed_varlen"
    )
    with pytest.raises(BatchValidationError, match=r"valid-token count \(B\*T\)"):
        PuzzletronBatch(ids, sequence=PackedSequenceMetadata(global_cu_seqlens=cu), layout="packed_varlen")


def test_seq_ids_must_agree_with_hidden_mask() -> None:
    fields = _packed()
    fields["hidden_mask"] = torch.tensor([[True] * 6])
    with pytest.raises(BatchValidationError, match="seq_ids >= 0 must equal hidden_mask"):
        PuzzletronBatch(**fields)


def test_cp_rank_must_be_below_cp_size() -> None:
    with pytest.raises(BatchValidationError, match="cp_rank must be < cp_size"):
        PackedSequenceMetadata(cp_rank=2, cp_size=2)
    with pytest.raises(BatchValidationError, match="cp_size"):
        PackedSequenceMetadata(cp_size=0)


@pytest.mark.parametrize(
    ("seq", "message"),
    [
        ({"media_counts": torch.tensor([1, 0, 0])}, "media_counts must be an integer tensor \\[B\\]"),
        ({"media_counts": torch.tensor([1.0, 0.0])}, "media_counts must be an integer"),
        ({"media_counts": torch.tensor([1, -1])}, "media_counts must be >= 0"),
        (
            {"media_counts": torch.tensor([1, 0]), "media_offsets": torch.tensor([0, 1, 2])},
            "media_offsets must be 0, cumsum",
        ),
        (
            {"media_counts": torch.tensor([1, 0]), "media_offsets": torch.tensor([0, 1])},
            "media_offsets must have B\\+1",
        ),
        ({"media_offsets": torch.tensor([0, 1, 1])}, "media_offsets needs sequence.media_counts"),
    ],
)
def test_media_rules(seq: dict[str, Any], message: str) -> None:
    with pytest.raises(BatchValidationError, match=message):
        plain(sequence=PackedSequenceMetadata(**seq))


def test_media_counts_must_match_image_grid_rows() -> None:
    kwargs = {
        "input_ids": torch.zeros(2, 3, dtype=torch.long),
        "image_grid_thw": torch.ones(2, 3, dtype=torch.long),
    }
    plain(model_kwargs=kwargs, sequence=PackedSequenceMetadata(media_counts=torch.tensor([1, 1])))
    with pytest.raises(BatchValidationError, match="media_counts must sum to the 2 rows of image_grid_thw"):
        plain(model_kwargs=kwargs, sequence=PackedSequenceMetadata(media_counts=torch.tensor([2, 1])))


# -- derived batches are not re-validated or hashed ---------------------------------------------------


def test_derived_batches_skip_validation_and_never_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    b = packed_row([3, 3, 2, 4], 12, sample_ids=("row",), cu_seqlens=torch.tensor([0, 3, 6, 8, 12]))
    m = media_batch()

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("must not run")

    monkeypatch.setattr(_validation, "validate", boom)
    monkeypatch.setattr(batch_module, "fingerprint_of", boom)
    monkeypatch.setattr(_fingerprint, "_tensor", boom)  # no tensor is hashed, by any path
    b.to(torch.float16)
    b.dp_slice(dp_rank=1, dp_size=2)
    b.cp_partition(torch.tensor([0, 1, 10, 11]), cp_rank=0, cp_size=2)
    b.pad_batch_to_multiple(4)
    m.pp_microbatches(3)
    m.dp_slice(dp_rank=0, dp_size=3)


def test_construction_does_not_compute_the_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("hashed at construction")

    monkeypatch.setattr(batch_module, "fingerprint_of", boom)
    monkeypatch.setattr(_fingerprint, "_tensor", boom)
    media_batch()
    packed_row([2, 2], 5)
    video_batch()


def test_fingerprint_is_cached_after_first_access(monkeypatch: pytest.MonkeyPatch) -> None:
    b = media_batch()
    first = b.fingerprint
    monkeypatch.setattr(batch_module, "fingerprint_of", lambda *a, **k: "recomputed")
    assert b.fingerprint == first


# -- replace_model_kwargs and to -------------------------------------------------------------------


def test_replace_model_kwargs_merges_and_validates() -> None:
    b = plain()
    mask = torch.ones(2, 3, dtype=torch.long)
    out = b.replace_model_kwargs(attention_mask=mask)
    assert out.model_kwargs["attention_mask"] is mask
    assert out.input_ids is b.input_ids
    assert "attention_mask" not in b.model_kwargs
    with pytest.raises(BatchValidationError, match="attention_mask"):
        b.replace_model_kwargs(attention_mask=torch.ones(2, 4))


def test_to_dtype_converts_floating_tensors_only() -> None:
    b = media_batch()
    b = b.replace_model_kwargs(extra={"nested": [torch.zeros(2), torch.zeros(2, dtype=torch.long)]})
    out = b.to(torch.bfloat16)
    assert out.model_kwargs["pixel_values"].dtype == torch.bfloat16
    assert out.model_kwargs["extra"]["nested"][0].dtype == torch.bfloat16
    assert out.model_kwargs["extra"]["nested"][1].dtype == torch.long
    assert out.input_ids.dtype == torch.long
    assert out.model_kwargs["attention_mask"].dtype == torch.long
    assert out.model_kwargs["image_grid_thw"].dtype == torch.long
    assert out.labels.dtype == torch.long
    assert out.ce_mask.dtype == torch.bool
    assert out.sequence.media_counts.dtype == torch.long
    assert revalidated(out).sample_ids == ("a", "b", "c")


def test_to_accepts_device_and_keyword_forms() -> None:
    b = media_batch()
    out = b.to("cpu", dtype=torch.float64)
    assert out.model_kwargs["pixel_values"].dtype == torch.float64
    assert b.to(device="cpu").input_ids.device.type == "cpu"
    assert b.to(torch.zeros(1, dtype=torch.float16)).model_kwargs["pixel_values"].dtype == torch.float16


def test_to_copy_gives_fresh_storage_and_without_copy_shares_it() -> None:
    b = media_batch()
    copied = b.to("cpu", copy=True)
    same = b.to("cpu")
    assert copied.input_ids.data_ptr() != b.input_ids.data_ptr()
    assert copied.model_kwargs["pixel_values"].data_ptr() != b.model_kwargs["pixel_values"].data_ptr()
    assert torch.equal(copied.input_ids, b.input_ids)
    assert same.input_ids.data_ptr() == b.input_ids.data_ptr()
    assert copied.fingerprint == b.fingerprint


# -- cp_partition --------------------------------------------------------------------------------


def test_cp_partition_golden_mrope() -> None:
    position_ids = torch.arange(16).repeat(3, 1, 1)  # [3, 1, 16]
    position_ids[1] += 100
    b = packed_row(
        [4, 6, 6], 16, position_ids=position_ids, cu_seqlens=torch.tensor([0, 4, 10, 16], dtype=torch.int32)
    )
    idx = torch.tensor([0, 1, 4, 5, 10, 11, 12, 13])
    out = b.cp_partition(idx, cp_rank=0, cp_size=2)
    assert out.sequence.local_cu_seqlens.tolist() == [0, 2, 4, 8]
    assert out.sequence.max_seqlen == 4
    assert out.model_kwargs["position_ids"].shape == (3, 1, 8)
    assert out.model_kwargs["position_ids"][1].tolist() == [[100, 101, 104, 105, 110, 111, 112, 113]]
    assert out.input_ids.tolist() == [[0, 1, 4, 5, 10, 11, 12, 13]]
    assert out.labels.tolist() == [[0, 1, 4, 5, 10, 11, 12, 13]]
    assert out.sequence.seq_ids.tolist() == [[0, 0, 1, 1, 2, 2, 2, 2]]
    assert out.sequence.global_cu_seqlens.tolist() == [0, 4, 10, 16]  # global stays
    assert out.sequence.sample_offsets == b.sequence.sample_offsets
    assert out.model_kwargs["cu_seqlens"].tolist() == [0, 2, 4, 8]  # the kwarg follows the local cu
    assert out.model_kwargs["cu_seqlens"].dtype == torch.int32
    assert (out.sequence.cp_rank, out.sequence.cp_size) == (0, 2)
    revalidated(out)


def test_cp_partition_drops_samples_absent_from_the_rank_and_slices_inputs_embeds() -> None:
    embeds = torch.arange(8 * 2, dtype=torch.float32).reshape(1, 8, 2)
    b = packed_row([2, 2, 4], 8, inputs_embeds=embeds)
    out = b.cp_partition(torch.tensor([4, 5, 6]), cp_rank=1, cp_size=2)
    assert out.sequence.local_cu_seqlens.tolist() == [0, 3]
    assert out.sequence.max_seqlen == 3
    assert out.model_kwargs["inputs_embeds"].tolist() == [[[8.0, 9.0], [10.0, 11.0], [12.0, 13.0]]]
    revalidated(out)


@pytest.mark.parametrize(
    ("indices", "kwargs", "message"),
    [
        (torch.tensor([0, 8]), {"cp_rank": 0, "cp_size": 2}, r"token_indices must lie in \[0, T=8\)"),
        (torch.tensor([-1, 2]), {"cp_rank": 0, "cp_size": 2}, "token_indices must lie in"),
        (torch.tensor([1, 1]), {"cp_rank": 0, "cp_size": 2}, "token_indices must be unique"),
        (torch.tensor([[1, 2]]), {"cp_rank": 0, "cp_size": 2}, "token_indices must be a 1-D integer"),
        (torch.tensor([1.0, 2.0]), {"cp_rank": 0, "cp_size": 2}, "token_indices must be a 1-D integer"),
        (torch.tensor([1, 2]), {"cp_rank": 2, "cp_size": 2}, "cp_rank must be < cp_size"),
        (torch.tensor([1, 2]), {"cp_rank": 0, "cp_size": 1}, "cp_size=1"),
    ],
)
def test_cp_partition_validates_indices(indices: torch.Tensor, kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(BatchValidationError, match=message):
        packed_row([4, 4], 8).cp_partition(indices, **kwargs)


def test_cp_partition_with_cp_size_one_and_all_tokens_is_the_identity() -> None:
    b = packed_row([4, 4], 8)
    assert b.cp_partition(torch.arange(8), cp_rank=0, cp_size=1) is b


def test_cp_partition_refuses_a_second_partition_and_4d_masks() -> None:
    b = packed_row([4, 4], 8)
    part = b.cp_partition(torch.tensor([0, 1, 6, 7]), cp_rank=0, cp_size=2)
    with pytest.raises(BatchValidationError, match="already CP rank 0 of 2"):
        part.cp_partition(torch.tensor([0]), cp_rank=0, cp_size=2)
    masked = b.replace_model_kwargs(attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(BatchValidationError, match="4-D model_kwargs\\['attention_mask'\\]"):
        masked.cp_partition(torch.tensor([0, 1]), cp_rank=0, cp_size=2)


# -- dp_slice ------------------------------------------------------------------------------------


def test_dp_slice_one_packed_row_golden() -> None:
    b = packed_row(
        [3, 3, 2, 4],
        12,
        sample_ids=("pack-7",),
        cu_seqlens=torch.tensor([0, 3, 6, 8, 12], dtype=torch.int32),
        seq_idx=torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3]], dtype=torch.int32),
    )
    r0 = b.dp_slice(dp_rank=0, dp_size=2)
    r1 = b.dp_slice(dp_rank=1, dp_size=2)
    assert r0.input_ids.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert r0.sequence.seq_ids.tolist() == [[0, 0, 0, 1, 1, 1]]
    assert r0.sequence.global_cu_seqlens.tolist() == [0, 3, 6]
    assert r1.input_ids.tolist() == [[6, 7, 8, 9, 10, 11]]
    assert r1.sequence.seq_ids.tolist() == [[0, 0, 1, 1, 1, 1]]
    assert r1.sequence.global_cu_seqlens.tolist() == [0, 2, 6]
    assert r1.model_kwargs["cu_seqlens"].tolist() == [0, 2, 6]
    assert r1.model_kwargs["seq_idx"].tolist() == [[0, 0, 1, 1, 1, 1]]
    assert r1.model_kwargs["seq_idx"].dtype == torch.int32
    assert r1.sequence.max_seqlen == 4
    assert r1.sequence.sample_offsets == ((0, 2), (2, 6))
    assert r1.sequence.local_cu_seqlens is None
    assert r0.sample_ids == ("pack-7:dp-0",)
    assert r1.sample_ids == ("pack-7:dp-1",)
    assert r1.source_metadata["dp_packed_sample_range"] == [2, 4]
    assert (r1.source_metadata["dp_rank"], r1.source_metadata["dp_size"]) == (1, 2)
    assert r1.labels.tolist() == [[6, 7, 8, 9, 10, 11]]
    revalidated(r0)
    revalidated(r1)


def test_a_packed_row_without_seq_ids_takes_its_padding_from_hidden_mask() -> None:
    # cu counts valid tokens; with hidden_mask and no seq_ids the padding may sit mid-row. Deriving the ids
    # as "the first cu[-1] tokens" used to give rank 1 the padding token and drop token 14.
    b = PuzzletronBatch(
        {"input_ids": torch.tensor([[10, 11, 0, 12, 13, 14]])},
        labels=torch.tensor([[10, 11, -100, 12, 13, 14]]),
        hidden_mask=torch.tensor([[True, True, False, True, True, True]]),
        sequence=PackedSequenceMetadata(global_cu_seqlens=torch.tensor([0, 2, 5])),
        layout="packed_varlen",
    )
    r0, r1 = (b.dp_slice(dp_rank=r, dp_size=2) for r in range(2))
    assert r0.input_ids.tolist() == [[10, 11]]
    assert r1.input_ids.tolist() == [[12, 13, 14]]
    assert r1.hidden_mask.tolist() == [[True, True, True]]
    assert r1.sequence.seq_ids.tolist() == [[0, 0, 0]]
    assert r1.sequence.global_cu_seqlens.tolist() == [0, 3]
    revalidated(r1)
    # cp_partition counts the local tokens of each sample on the same ids: tokens 0..2 hold sample 0 only.
    part = b.cp_partition(torch.tensor([0, 1, 2]), cp_rank=0, cp_size=2)
    assert part.sequence.seq_ids.tolist() == [[0, 0, -1]]
    assert part.sequence.local_cu_seqlens.tolist() == [0, 2]
    revalidated(part)


def test_dp_slice_packed_row_drops_trailing_padding_and_deals_extra_samples_first() -> None:
    b = packed_row([1, 2, 3, 4, 5], 18)  # 15 valid tokens + 3 padding; 5 samples over 2 ranks -> 3 + 2
    r0, r1 = (b.dp_slice(dp_rank=r, dp_size=2) for r in range(2))
    assert r0.input_ids.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert r1.input_ids.tolist() == [[6, 7, 8, 9, 10, 11, 12, 13, 14]]
    assert r1.sequence.global_cu_seqlens.tolist() == [0, 4, 9]
    assert r0.sample_ids == ("packed-row:dp-0",)


def test_dp_slice_packed_row_errors() -> None:
    with pytest.raises(BatchValidationError, match="holds 2 samples, fewer than dp_size 3"):
        packed_row([2, 2], 4).dp_slice(dp_rank=0, dp_size=3)
    with_media = packed_row(
        [2, 2], 4, pixel_values=torch.zeros(1, 3), image_grid_thw=torch.ones(1, 3, dtype=torch.long)
    )
    with pytest.raises(BatchValidationError, match="holds media"):
        with_media.dp_slice(dp_rank=0, dp_size=2)


def test_dp_slice_media_rows_golden() -> None:
    b = media_batch()
    shards = [b.dp_slice(dp_rank=r, dp_size=3) for r in range(3)]
    assert [s.sample_ids for s in shards] == [("a",), ("b",), ("c",)]
    assert [s.sequence.media_counts.tolist() for s in shards] == [[2], [1], [2]]
    assert [s.model_kwargs["image_grid_thw"].shape[0] for s in shards] == [2, 1, 2]
    assert [s.model_kwargs["pixel_values"][:, 0].tolist() for s in shards] == [[0.0, 1.0], [2.0], [3.0, 4.0]]
    assert [s.sequence.media_offsets.tolist() for s in shards] == [[0, 2], [0, 1], [0, 2]]
    for s in shards:
        revalidated(s)


def test_dp_slice_size_one_is_identity_and_indivisible_batch_is_an_error() -> None:
    b = media_batch()
    assert b.dp_slice(dp_rank=0, dp_size=1) is b
    with pytest.raises(BatchValidationError, match=r"not divisible by dp_size 2.*sampler"):
        b.dp_slice(dp_rank=0, dp_size=2)
    with pytest.raises(BatchValidationError, match="dp_rank must be < dp_size"):
        b.dp_slice(dp_rank=3, dp_size=3)


# -- pp_microbatches ------------------------------------------------------------------------------


def test_pp_microbatches_media_golden() -> None:
    groups = media_batch().pp_microbatches(2)
    assert [g.sample_ids for g in groups] == [("a", "b"), ("c",)]
    assert [g.model_kwargs["pixel_values"].shape[0] for g in groups] == [3, 2]
    assert [g.sequence.media_counts.tolist() for g in groups] == [[2, 1], [2]]
    assert [g.sequence.media_offsets.tolist() for g in groups] == [[0, 2, 3], [0, 2]]
    assert [g.model_kwargs["image_grid_thw"].shape[0] for g in groups] == [3, 2]
    assert groups[1].input_ids.tolist() == [[8, 9, 10, 11]]
    for g in groups:
        revalidated(g)


def test_pp_microbatches_align_flat_patches_through_the_grid() -> None:
    groups = media_batch(flat_patches=True).pp_microbatches(2)
    # 4 patch rows per image; images 0,1,2 in group 0 and 3,4 in group 1.
    assert groups[0].model_kwargs["pixel_values"][:, 0].tolist() == [0.0] * 4 + [1.0] * 4 + [2.0] * 4
    assert groups[1].model_kwargs["pixel_values"][:, 0].tolist() == [3.0] * 4 + [4.0] * 4


def test_pp_microbatches_refuse_flat_pixels_without_grid() -> None:
    b = media_batch(flat_patches=True, with_grid=False)
    with pytest.raises(BatchValidationError, match="cannot align flat pixel_values without image_grid_thw"):
        b.pp_microbatches(2)


def test_pp_microbatches_return_exactly_n_groups_or_raise() -> None:
    b = PuzzletronBatch({"input_ids": torch.arange(10).reshape(5, 2)}, sample_ids=tuple("abcde"))
    groups = b.pp_microbatches(4)
    assert [g.sample_ids for g in groups] == [("a", "b"), ("c",), ("d",), ("e",)]
    assert b.pp_microbatches(1) == (b,)
    with pytest.raises(BatchValidationError, match="n_microbatches 6 exceeds batch_size 5"):
        b.pp_microbatches(6)
    with pytest.raises(BatchValidationError, match="n_microbatches"):
        b.pp_microbatches(0)


def test_pp_microbatches_recanonicalise_packed_rows_and_rebuild_cu_kwargs() -> None:
    seq_ids = torch.tensor([[0, 0, 1, -1], [2, 2, 2, 3], [4, -1, -1, -1]])
    cu = torch.tensor([0, 2, 3, 6, 7, 8], dtype=torch.int32)
    b = PuzzletronBatch(
        model_kwargs={
            "input_ids": torch.arange(12).reshape(3, 4),
            "cu_seqlens": cu.clone(),
            "seq_idx": seq_ids.clone(),
            "unknown": torch.zeros(3),  # dim 0 happens to equal B: must be passed through, not sliced
        },
        hidden_mask=seq_ids >= 0,
        sequence=PackedSequenceMetadata(
            global_cu_seqlens=cu,
            seq_ids=seq_ids,
            max_seqlen=3,
            sample_offsets=((0, 2), (2, 3), (3, 6), (6, 7), (7, 8)),
        ),
        layout="packed_varlen",
    )
    first, second = b.pp_microbatches(2)
    assert second.sequence.seq_ids.tolist() == [[0, -1, -1, -1]]
    assert second.sequence.global_cu_seqlens.tolist() == [0, 1]
    assert second.sequence.max_seqlen == 1
    assert second.sequence.sample_offsets == ((0, 1),)
    assert second.model_kwargs["cu_seqlens"].tolist() == [0, 1]
    assert second.model_kwargs["seq_idx"].tolist() == [[0, -1, -1, -1]]
    assert first.sequence.global_cu_seqlens.tolist() == [0, 2, 3, 6, 7]
    assert first.model_kwargs["unknown"] is b.model_kwargs["unknown"]
    revalidated(first)
    revalidated(second)


# -- pad_batch_to_multiple -----------------------------------------------------------------------


def test_pad_batch_to_multiple_golden_shares_media() -> None:
    b = media_batch()
    out = b.pad_batch_to_multiple(2)
    assert out.batch_size == 4
    assert out.model_kwargs["pixel_values"].data_ptr() == b.model_kwargs["pixel_values"].data_ptr()
    assert out.model_kwargs["pixel_values"].shape[0] == 5
    assert out.model_kwargs["image_grid_thw"] is b.model_kwargs["image_grid_thw"]
    assert out.sequence.media_counts.tolist() == [2, 1, 2, 0]
    assert out.sequence.media_offsets.tolist() == [0, 2, 3, 5, 5]
    assert out.model_kwargs["attention_mask"][3].tolist() == [0, 0, 0, 0]
    assert out.labels[3].tolist() == [-100] * 4
    assert out.hidden_mask[3].tolist() == [False] * 4
    assert out.ce_mask[3].tolist() == [False] * 4
    assert out.sample_ids == ("a", "b", "c", "__pp_padding_0")
    revalidated(out)


def test_pad_batch_without_sample_ids_pads_every_known_kwarg() -> None:
    seq_ids = torch.tensor([[0, 0, 1]])
    b = PuzzletronBatch(
        model_kwargs={
            "input_ids": torch.tensor([[5, 6, 7]]),
            "seq_idx": seq_ids.clone(),
            "padding_mask": torch.tensor([[False, False, False]]),
            "position_ids": torch.arange(3).repeat(3, 1, 1),
        },
        hidden_mask=torch.ones(1, 3, dtype=torch.bool),
        sequence=PackedSequenceMetadata(global_cu_seqlens=torch.tensor([0, 2, 3]), seq_ids=seq_ids),
        layout="packed_varlen",
    )
    out = b.pad_batch_to_multiple(3)
    assert out.sample_ids == ()
    assert out.input_ids.tolist() == [[5, 6, 7], [0, 0, 0], [0, 0, 0]]
    assert out.model_kwargs["seq_idx"].tolist() == [[0, 0, 1], [-1, -1, -1], [-1, -1, -1]]
    assert out.model_kwargs["padding_mask"][1:].all()
    assert out.model_kwargs["position_ids"].shape == (3, 3, 3)
    assert out.model_kwargs["position_ids"][:, 1:].eq(0).all()
    assert out.sequence.seq_ids.tolist() == [[0, 0, 1], [-1, -1, -1], [-1, -1, -1]]
    assert out.sequence.global_cu_seqlens is b.sequence.global_cu_seqlens
    revalidated(out)
    assert b.pad_batch_to_multiple(1) is b


@pytest.mark.parametrize("cu", [torch.tensor([0, 4, 8]), torch.tensor([[0, 4, 8]])])
def test_a_flat_cu_seqlens_kwarg_without_packing_metadata_is_refused_not_left_stale(cu: torch.Tensor) -> None:
    # A padded batch whose flat cu spans both rows: no split can rebuild it (there is no global cu), and
    # keeping it would describe tokens or rows the result no longer holds.
    b = PuzzletronBatch(
        {"input_ids": torch.arange(8).reshape(2, 4), "cu_seqlens": cu}, layout="padded_varlen"
    )
    with pytest.raises(BatchValidationError, match=r"cp_partition: model_kwargs\['cu_seqlens'\]"):
        b.cp_partition(torch.tensor([0, 3]), cp_rank=0, cp_size=2)
    with pytest.raises(BatchValidationError, match=r"row split: model_kwargs\['cu_seqlens'\]"):
        b.pp_microbatches(2)
    with pytest.raises(BatchValidationError, match=r"row split: model_kwargs\['cu_seqlens'\]"):
        b.dp_slice(dp_rank=0, dp_size=2)
    one_row = PuzzletronBatch({"input_ids": torch.arange(4)[None], "cu_seqlens": torch.tensor([[0, 4]])})
    with pytest.raises(BatchValidationError, match=r"cu_seqlens"):
        one_row.cp_partition(torch.tensor([0, 3]), cp_rank=0, cp_size=2)
    # A per-row [B, D+1] cu is row-local: row splits still slice it.
    per_row = PuzzletronBatch(
        {"input_ids": torch.arange(8).reshape(2, 4), "cu_seqlens": torch.tensor([[0, 4], [0, 3]])},
        layout="padded_varlen",
    )
    assert per_row.pp_microbatches(2)[1].model_kwargs["cu_seqlens"].tolist() == [[0, 3]]


# -- equality and hashing ------------------------------------------------------------------------


def test_equality_and_hash_are_by_content_and_never_crash() -> None:
    a, b = media_batch(), media_batch()
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    changed = a.replace_model_kwargs(attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]))
    assert a != changed
    assert a != "not a batch"
    assert a.sequence == b.sequence
    assert hash(a.sequence) == hash(b.sequence)


def test_equality_and_hash_never_crash_on_values_without_a_canonical_encoding() -> None:
    # The fingerprint of such a batch is a TypeError (no repr() with a memory address), but == and hash
    # must not raise: the batch is then equal only to itself and hashes by identity.
    class Opaque:
        pass

    marker = Opaque()
    a = media_batch().replace_model_kwargs(thing=marker)
    same_content = media_batch().replace_model_kwargs(thing=marker)
    with pytest.raises(TypeError, match="Opaque"):
        a.fingerprint  # noqa: B018
    assert a == a
    assert (a == same_content) is False
    assert (a != media_batch()) is True
    assert hash(a) == hash(a)
    assert a in {a}
    assert len({a, same_content, media_batch()}) == 3
    assert (media_batch() == a) is False
    seq = PackedSequenceMetadata(seq_ids=torch.eye(2, dtype=torch.long).to_sparse())
    assert seq == seq
    assert seq != PackedSequenceMetadata()
    assert hash(seq) == hash(seq)


class HostReads(TorchFunctionMode):
    """Records every torch call that reads tensor values into Python, which on an accelerator is a
    device-to-host sync: ``bool``/``int``/``item``/``tolist``/``cpu``/..., and ops whose output size depends
    on the data (``nonzero``, boolean-mask indexing, ...). A measurement, not a mock: every call runs."""

    READS = frozenset(
        {
            "__bool__", "__int__", "__float__", "__index__", "__complex__", "__array__", "__repr__",
            "__format__", "__contains__", "item", "tolist", "numpy", "cpu", "equal", "allclose",
            "is_nonzero", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
        }
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        data_sized = (name in ("__getitem__", "__setitem__") and _has_bool_index(args[1])) or (
            name == "repeat_interleave" and "output_size" not in kwargs
        )
        if name in self.READS or data_sized:
            self.reads.append(name)
        return func(*args, **kwargs)


def _has_bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def host_reads(fn: Any) -> list[str]:
    with HostReads() as mode:
        fn()
    return mode.reads


def big_packed_fields(B: int, T: int, docs: int, images: int) -> dict[str, Any]:
    """Fields of a packed VLM batch: ``docs`` samples per row (+ trailing padding), ``images`` per row (flat
    patches), mRoPE positions, per-row cu, token indices, THD lengths, ``seq_idx``."""
    gen = torch.Generator().manual_seed(B * T + docs)
    used = T - T // 8
    rows = []
    for _ in range(B):
        cuts = (torch.randperm(used - 1, generator=gen)[: docs - 1].sort().values + 1).tolist()
        bounds = [0, *cuts, used]
        rows.append([i for i, (a, b) in enumerate(itertools.pairwise(bounds)) for _ in range(a, b)])
    canon = _segments.canonical_packed_ids(torch.tensor([r + [-1] * (T - used) for r in rows]))
    ids, hidden = canon.seq_ids, canon.seq_ids >= 0
    lengths, spans = _segments.row_document_lengths(ids, docs)
    counts = torch.full((B,), images)
    return {
        "model_kwargs": {
            "input_ids": torch.randint(0, 100, (B, T), generator=gen),
            "attention_mask": hidden.long(),
            "position_ids": torch.zeros(3, B, T, dtype=torch.long),
            "cu_seqlens": _segments.row_cu_from_seq_ids(ids, docs + 1).int(),
            "packed_token_indices": torch.where(hidden, torch.arange(T).expand(B, T), -1),
            "seq_lens": torch.where(lengths >= 0, lengths, -1000),
            "seq_lens_padded": torch.where(spans >= 0, spans, -1000),
            "seq_idx": ids.int(),
            "pixel_values": torch.zeros(4 * B * images, 8),
            "image_grid_thw": torch.tensor([[1, 2, 2]] * (B * images)).reshape(-1, 3),
        },
        "labels": torch.zeros(B, T, dtype=torch.long).masked_fill(~hidden, -100),
        "ce_mask": hidden.clone(),
        "kd_mask": hidden.clone(),
        "hidden_mask": hidden,
        "sequence": PackedSequenceMetadata(
            global_cu_seqlens=canon.cu_seqlens,
            seq_ids=ids,
            max_seqlen=canon.max_seqlen,
            sample_offsets=canon.sample_offsets,
            media_counts=counts,
            media_offsets=_segments.media_offsets_from_counts(counts),
        ),
        "sample_ids": [f"r{i}" for i in range(B)],
        "layout": "packed_varlen",
        "modality": "multimodal",
    }


def test_host_reads_are_a_small_constant_independent_of_B_T_and_samples() -> None:
    """Contract 3.1 **Better:** on CPU (no accelerator needed): constructing a batch reads tensor values
    into Python a fixed number of times, whatever its size; ``to()`` and padding never do; each split does a
    constant number of reads per output batch (data-dependent sizes: cu, offsets), never one per row,
    token, sample or image."""
    sizes = [(2, 16, 2, 1), (16, 4096, 40, 3)]  # (B, T, samples per row, images per row)
    per_size = []
    for B, T, docs, images in sizes:
        fields = big_packed_fields(B, T, docs, images)
        b = PuzzletronBatch(**fields)
        row = PuzzletronBatch(**{**big_packed_fields(1, T, docs, 0), "modality": "text"})
        idx = parallel.batch_cp_indices(b, cp_rank=1, cp_size=2)
        reads = {
            "construct": host_reads(lambda f=fields: PuzzletronBatch(**f)),
            "to": host_reads(lambda b=b: b.to(torch.bfloat16)),
            "pad": host_reads(lambda b=b: b.pad_batch_to_multiple(3)),
            "cp_partition": host_reads(lambda b=b, i=idx: b.cp_partition(i, cp_rank=1, cp_size=2)),
            "dp_slice rows": host_reads(lambda b=b: b.dp_slice(dp_rank=1, dp_size=2)),
            "dp_slice packed row": host_reads(lambda r=row: r.dp_slice(dp_rank=1, dp_size=2)),
            "pp_microbatches(2)": host_reads(lambda b=b: b.pp_microbatches(2)),
        }
        per_size.append(reads)
    small, large = per_size
    assert small == large  # the same calls, in the same order, for 64 tokens and for 65,536
    assert large["construct"] == ["cpu", "__bool__"]  # one copy of the stacked checks, one read of the copy
    assert large["to"] == [] and large["pad"] == []
    assert all(len(reads) <= 6 for name, reads in large.items() if name != "pp_microbatches(2)")
    assert len(large["pp_microbatches(2)"]) <= 2 * 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an accelerator")
def test_on_cuda_construction_syncs_once_and_derived_batches_do_not_validate() -> None:
    import warnings

    b = media_batch().to("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            revalidated(b)
        construction_syncs = len(caught)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            b.to(torch.bfloat16)
            b.pad_batch_to_multiple(4)
        derived_syncs = len(caught)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert construction_syncs == 1
    assert derived_syncs == 0


# -- pickling ------------------------------------------------------------------------------------


def test_batch_pickles_round_trip_exactly_with_read_only_mappings() -> None:
    import pickle

    b = packed_row([3, 2], 6, sample_ids=("pack-0",), nested={"k": torch.tensor([1, 2])})
    b = dataclasses.replace(b, source_metadata={"epoch": 3})
    out = pickle.loads(pickle.dumps(b))
    assert isinstance(out, PuzzletronBatch)
    assert out.fingerprint == b.fingerprint
    assert isinstance(out.model_kwargs, types.MappingProxyType)
    assert isinstance(out.source_metadata, types.MappingProxyType)
    assert out.source_metadata["epoch"] == 3
    assert out.sequence.global_cu_seqlens.tolist() == [0, 3, 5]
    assert out.sequence.seq_ids.tolist() == [[0, 0, 0, 1, 1, -1]]
    assert out.layout is DataLayout.PACKED_VARLEN
    with pytest.raises(TypeError):
        out.model_kwargs["input_ids"] = torch.zeros(1, 6)  # type: ignore[index]
    revalidated(out)


def test_pickled_batch_carries_no_cached_fingerprint_and_pickles_after_hashing() -> None:
    import pickle

    b = media_batch()
    expected = b.fingerprint  # cached in the instance: must not break pickling
    out = pickle.loads(pickle.dumps(b))
    assert "fingerprint" not in vars(out)
    assert out.fingerprint == expected
    assert out.sample_ids == ("a", "b", "c") and out.modality is Modality.MULTIMODAL


def test_sequence_metadata_pickles_round_trip_exactly() -> None:
    import pickle

    seq = PackedSequenceMetadata(
        global_cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32),
        local_cu_seqlens=torch.tensor([0, 2], dtype=torch.int32),
        max_seqlen=2,
        seq_ids=torch.tensor([[0, 0, -1]]),
        sample_offsets=((0, 3), (3, 5)),
        cp_rank=1,
        cp_size=2,
    )
    out = pickle.loads(pickle.dumps(seq))
    assert out == seq
    assert out.local_cu_seqlens.dtype == torch.int32
    assert (out.cp_rank, out.cp_size, out.sample_offsets) == (1, 2, ((0, 3), (3, 5)))


# -- packed batches of padding rows only ---------------------------------------------------------


def test_all_padding_packed_batch_carries_cu_of_zero_samples() -> None:
    seq_ids = torch.full((2, 3), -1)
    b = PuzzletronBatch(
        model_kwargs={"input_ids": torch.zeros(2, 3, dtype=torch.long)},
        labels=torch.full((2, 3), -100),
        hidden_mask=torch.zeros(2, 3, dtype=torch.bool),
        sequence=PackedSequenceMetadata(
            global_cu_seqlens=torch.tensor([0], dtype=torch.int32), seq_ids=seq_ids, max_seqlen=0
        ),
        layout="packed_varlen",
    )
    assert b.sequence.sample_offsets == ()
    with pytest.raises(BatchValidationError, match="max_seqlen must equal the largest segment"):
        dataclasses.replace(b, sequence=dataclasses.replace(b.sequence, max_seqlen=1))
    # CP of zero samples: local cu [0] too.
    part = b.cp_partition(torch.tensor([0, 1]), cp_rank=0, cp_size=2)
    assert part.sequence.local_cu_seqlens.tolist() == [0]
    assert part.sequence.max_seqlen == 0
    revalidated(part)


def test_row_split_of_padding_rows_keeps_cu_zero_and_seq_ids() -> None:
    seq_ids = torch.tensor([[0, 0, -1], [-1, -1, -1]])
    b = PuzzletronBatch(
        model_kwargs={
            "input_ids": torch.arange(6).reshape(2, 3),
            "cu_seqlens": torch.tensor([0, 2], dtype=torch.int32),
            "max_seqlen": 2,
        },
        hidden_mask=seq_ids >= 0,
        sequence=PackedSequenceMetadata(
            global_cu_seqlens=torch.tensor([0, 2], dtype=torch.int32),
            seq_ids=seq_ids,
            max_seqlen=2,
            sample_offsets=((0, 2),),
        ),
        layout="packed_varlen",
    )
    first, second = b.pp_microbatches(2)
    assert second.sequence.global_cu_seqlens.tolist() == [0]
    assert second.sequence.seq_ids.tolist() == [[-1, -1, -1]]
    assert second.sequence.max_seqlen == 0
    assert second.sequence.sample_offsets == ()
    assert second.model_kwargs["cu_seqlens"].tolist() == [0]
    assert second.model_kwargs["max_seqlen"] == 0
    assert first.sequence.global_cu_seqlens.tolist() == [0, 2]
    revalidated(first)
    revalidated(second)


# -- AutoModel per-row packing metadata, THD and flash kwargs across splits ------------------------


def neat_rows() -> PuzzletronBatch:
    """AutoModel neat-packing output of 3 rows of 6 tokens (per-row cu, token indices) as a batch."""
    from puzzletron.dataset.clients.automodel.adapter import batch_from_automodel

    doc = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0], [1, 2, 3, 0, 0, 0]])
    collated = {
        "input_ids": torch.arange(18).reshape(3, 6),
        "labels": torch.arange(18).reshape(3, 6),
        "_packed_seq_ids": doc,
        "packed_token_indices": torch.tensor(
            [[0, 1, 2, 3, 4, -1], [0, 1, 2, 3, -1, -1], [0, 1, 2, -1, -1, -1]]
        ),
        "cu_seqlens": torch.tensor([[0, 3, 5, -1], [0, 4, -1, -1], [0, 1, 2, 3]], dtype=torch.int32),
        "max_seqlen": 4,
        "cu_seq_lens_q": torch.tensor([0, 3, 5, 6, 10, 12, 13, 14, 15, 18], dtype=torch.int32),
        "max_length_q": 4,
    }
    return batch_from_automodel(
        collated, sample_ids=["r0", "r1", "r2"], source_metadata={}, layout="packed_varlen"
    )


def test_pp_microbatches_slice_per_row_cu_and_token_indices_and_drop_flat_flash_kwargs() -> None:
    first, second = neat_rows().pp_microbatches(2)
    assert first.model_kwargs["cu_seqlens"].tolist() == [[0, 3, 5, -1], [0, 4, -1, -1]]
    assert first.model_kwargs["cu_seqlens"].dtype == torch.int32
    assert first.model_kwargs["packed_token_indices"].tolist() == [[0, 1, 2, 3, 4, -1], [0, 1, 2, 3, -1, -1]]
    assert first.model_kwargs["max_seqlen"] == 4
    assert first.sequence.global_cu_seqlens.tolist() == [0, 3, 5, 9]
    assert second.model_kwargs["cu_seqlens"].tolist() == [[0, 1, 2, 3]]
    assert second.model_kwargs["packed_token_indices"].tolist() == [[0, 1, 2, -1, -1, -1]]
    assert second.model_kwargs["max_seqlen"] == 1
    for group in (first, second):
        assert not {"cu_seq_lens_q", "max_length_q"} & set(group.model_kwargs)
        revalidated(group)


def test_dp_slice_row_blocks_slice_per_row_cu() -> None:
    rank1 = neat_rows().dp_slice(dp_rank=1, dp_size=3)
    assert rank1.model_kwargs["cu_seqlens"].tolist() == [[0, 4, -1, -1]]
    assert rank1.model_kwargs["packed_token_indices"].tolist() == [[0, 1, 2, 3, -1, -1]]
    assert rank1.model_kwargs["max_seqlen"] == 4
    assert "cu_seq_lens_q" not in rank1.model_kwargs
    revalidated(rank1)


def test_pad_batch_pads_per_row_cu_like_automodel_and_it_still_flattens() -> None:
    from nemo_automodel.components.models.common.packing import flatten_packed_sequence_metadata

    out = neat_rows().pad_batch_to_multiple(2)
    cu, indices = out.model_kwargs["cu_seqlens"], out.model_kwargs["packed_token_indices"]
    assert cu[3].tolist() == [0, -1, -1, -1]  # AutoModel's own form of a row without documents
    assert indices[3].tolist() == [-1] * 6
    assert "cu_seq_lens_q" not in out.model_kwargs
    flat_indices, flat_cu = flatten_packed_sequence_metadata(indices, cu, batch_size=4, sequence_length=6)
    assert flat_indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 12, 13, 14]
    assert flat_cu.tolist() == [0, 3, 5, 9, 10, 11, 12]
    revalidated(out)


def thd_rows() -> PuzzletronBatch:
    """2 packed rows of 6 tokens with THD lengths, per-row cu, token indices and flash kwargs."""
    seq_ids = torch.tensor([[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]])
    hidden = seq_ids >= 0
    return PuzzletronBatch(
        model_kwargs={
            "input_ids": torch.arange(12).reshape(2, 6),
            "seq_lens": torch.tensor([[3, 2], [4, -1000]]),
            "seq_lens_padded": torch.tensor([[3, 3], [6, -1000]]),
            "cu_seqlens": torch.tensor([[0, 3, 5], [0, 4, -1]], dtype=torch.int32),
            "packed_token_indices": torch.tensor([[0, 1, 2, 3, 4, -1], [0, 1, 2, 3, -1, -1]]),
            "max_seqlen": 4,
            "cu_seq_lens_q": torch.tensor([0, 3, 5, 6, 10, 12], dtype=torch.int32),
            "cu_seq_lens_k": torch.tensor([0, 3, 5, 6, 10, 12], dtype=torch.int32),
            "max_length_q": 4,
            "max_length_k": 4,
        },
        hidden_mask=hidden,
        sequence=PackedSequenceMetadata(
            global_cu_seqlens=torch.tensor([0, 3, 5, 9], dtype=torch.int32), seq_ids=seq_ids, max_seqlen=4
        ),
        layout="packed_varlen",
    )


def test_cp_partition_rebuilds_per_row_kwargs_for_the_local_layout() -> None:
    b = thd_rows()
    r0 = b.cp_partition(torch.tensor([0, 1, 4, 5]), cp_rank=0, cp_size=2)
    assert r0.sequence.seq_ids.tolist() == [[0, 0, 1, -1], [2, 2, -1, -1]]
    assert r0.sequence.local_cu_seqlens.tolist() == [0, 2, 3, 5]
    assert r0.model_kwargs["cu_seqlens"].tolist() == [[0, 2, 3], [0, 2, -1]]
    assert r0.model_kwargs["cu_seqlens"].dtype == torch.int32
    assert r0.model_kwargs["packed_token_indices"].tolist() == [[0, 1, 2, -1], [0, 1, -1, -1]]
    assert r0.model_kwargs["seq_lens"].tolist() == [[2, 1], [2, -1000]]
    assert r0.model_kwargs["seq_lens_padded"].tolist() == [[2, 2], [4, -1000]]
    assert r0.model_kwargs["max_seqlen"] == 2
    r1 = b.cp_partition(torch.tensor([2, 3]), cp_rank=1, cp_size=2)
    assert r1.sequence.local_cu_seqlens.tolist() == [0, 1, 2, 4]
    assert r1.model_kwargs["cu_seqlens"].tolist() == [[0, 1, 2], [0, 2, -1]]
    assert r1.model_kwargs["packed_token_indices"].tolist() == [[0, 1], [0, 1]]
    assert r1.model_kwargs["seq_lens"].tolist() == [[1, 1], [2, -1000]]
    assert r1.model_kwargs["seq_lens_padded"].tolist() == [[1, 1], [2, -1000]]
    for part in (r0, r1):
        assert not {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"} & set(part.model_kwargs)
        revalidated(part)


def test_cp_partition_gives_a_row_starting_with_padding_a_zero_length_thd_document() -> None:
    from puzzletron.dataset.clients.automodel.adapter import document_map

    # THD row: document 0 (2 tokens + 2 padding), document 1 (2 tokens).
    b = packed_row(
        [2, 2],
        6,
        seq_lens=torch.tensor([[2, 2]]),
        seq_lens_padded=torch.tensor([[4, 2]]),
    )
    b = dataclasses.replace(
        b,
        model_kwargs={**b.model_kwargs, "input_ids": torch.tensor([[0, 1, 9, 9, 4, 5]])},
        sequence=dataclasses.replace(b.sequence, seq_ids=torch.tensor([[0, 0, -1, -1, 1, 1]])),
        hidden_mask=torch.tensor([[True, True, False, False, True, True]]),
        labels=None,
        ce_mask=None,
        kd_mask=None,
    )
    part = b.cp_partition(torch.tensor([2, 3, 4, 5]), cp_rank=1, cp_size=2)
    assert part.model_kwargs["seq_lens"].tolist() == [[0, 2]]
    assert part.model_kwargs["seq_lens_padded"].tolist() == [[2, 2]]
    # AutoModel's reading of the rebuilt THD kwargs finds exactly the local tokens of document 1.
    assert document_map(part.model_kwargs).ids.tolist() == [[-1, -1, 1, 1]]


def test_dp_slice_of_a_packed_row_rebuilds_thd_lengths_and_token_indices() -> None:
    b = packed_row(
        [3, 3, 2, 4],
        14,
        seq_lens=torch.tensor([[3, 3, 2, 4]]),
        seq_lens_padded=torch.tensor([[3, 3, 2, 6]]),
        packed_token_indices=torch.tensor([[*range(12), -1, -1]]),
        cu_seq_lens_q=torch.tensor([0, 3, 6, 8, 12, 14], dtype=torch.int32),
        max_length_q=4,
    )
    r0, r1 = (b.dp_slice(dp_rank=r, dp_size=2) for r in range(2))
    assert r0.model_kwargs["seq_lens"].tolist() == [[3, 3, -1000, -1000]]
    assert r0.model_kwargs["seq_lens_padded"].tolist() == [[3, 3, -1000, -1000]]
    assert r1.model_kwargs["seq_lens"].tolist() == [[2, 4, -1000, -1000]]
    assert r1.model_kwargs["seq_lens_padded"].tolist() == [[2, 4, -1000, -1000]]
    assert r1.model_kwargs["packed_token_indices"].tolist() == [[0, 1, 2, 3, 4, 5]]
    for part in (r0, r1):
        assert not {"cu_seq_lens_q", "max_length_q"} & set(part.model_kwargs)
        revalidated(part)


def test_flash_kwargs_dropped_by_a_split_are_rebuilt_by_forward_kwargs() -> None:
    from puzzletron.dataset.clients.automodel.adapter import forward_kwargs

    part = thd_rows().cp_partition(torch.tensor([0, 1, 4, 5]), cp_rank=0, cp_size=2)
    flash = forward_kwargs(part, backend="flash")
    # Flattened local tokens: row 0 runs [0 0][1][pad], row 1 runs [2 2][pad pad].
    assert flash["cu_seq_lens_q"].tolist() == [0, 2, 3, 4, 6, 8]
    assert flash["max_length_q"] == 2


# -- per-row counts (videos per sample, patches) ---------------------------------------------------


def test_row_splits_slice_per_row_counts_with_b_entries_and_pass_others_through() -> None:
    b = media_batch().replace_model_kwargs(
        n_videos_per_sample=torch.tensor([0, 0, 0]),
        num_patches=torch.tensor([2, 1, 2]),
        num_videos_per_sample=[0, 0, 0],
        n_images_per_sample=(2, 1, 2),
        unrelated_counts=torch.tensor([7, 8, 9]),  # not a known key: passed through
    )
    first, second = b.pp_microbatches(2)
    assert first.model_kwargs["num_patches"].tolist() == [2, 1]
    assert second.model_kwargs["num_patches"].tolist() == [2]
    assert second.model_kwargs["n_videos_per_sample"].tolist() == [0]
    assert second.model_kwargs["num_videos_per_sample"] == [0]
    assert first.model_kwargs["n_images_per_sample"] == (2, 1)
    assert second.model_kwargs["unrelated_counts"] is b.model_kwargs["unrelated_counts"]
    rank2 = b.dp_slice(dp_rank=2, dp_size=3)
    assert rank2.model_kwargs["num_patches"].tolist() == [2]
    padded = b.pad_batch_to_multiple(2)
    assert padded.model_kwargs["num_patches"].tolist() == [2, 1, 2, 0]
    assert padded.model_kwargs["n_images_per_sample"] == (2, 1, 2, 0)
    assert padded.model_kwargs["num_videos_per_sample"] == [0, 0, 0, 0]
    # A value without B entries (e.g. one total) is passed through unchanged.
    total = b.replace_model_kwargs(num_patches=torch.tensor([5]))
    assert total.pp_microbatches(3)[1].model_kwargs["num_patches"] is total.model_kwargs["num_patches"]


# -- videos ------------------------------------------------------------------------------------------


def video_batch(**overrides: Any) -> PuzzletronBatch:
    """3 rows ``a, b, c`` owning 1, 0, 2 videos of 8, 4 and 2 flat patches (value = video number)."""
    grid = torch.tensor([[2, 2, 2], [1, 2, 2], [2, 1, 1]])
    kwargs: dict[str, Any] = {
        "input_ids": torch.arange(12).reshape(3, 4),
        "pixel_values_videos": torch.tensor([0.0] * 8 + [1.0] * 4 + [2.0] * 2).reshape(-1, 1),
        "video_grid_thw": grid,
        "second_per_grid_ts": [0.5, 1.0, 2.0],
        "n_videos_per_sample": torch.tensor([1, 0, 2]),
    }
    kwargs.update(overrides)
    return PuzzletronBatch(kwargs, sample_ids=("a", "b", "c"), modality="multimodal")


def test_row_splits_give_each_row_its_videos_golden() -> None:
    first, second = video_batch().pp_microbatches(2)
    assert first.sample_ids == ("a", "b")
    assert first.model_kwargs["pixel_values_videos"].reshape(-1).tolist() == [0.0] * 8
    assert first.model_kwargs["video_grid_thw"].tolist() == [[2, 2, 2]]
    assert first.model_kwargs["second_per_grid_ts"] == [0.5]
    assert first.model_kwargs["n_videos_per_sample"].tolist() == [1, 0]
    assert second.model_kwargs["pixel_values_videos"].reshape(-1).tolist() == [1.0] * 4 + [2.0] * 2
    assert second.model_kwargs["video_grid_thw"].tolist() == [[1, 2, 2], [2, 1, 1]]
    assert second.model_kwargs["second_per_grid_ts"] == [1.0, 2.0]
    rank1 = video_batch(n_videos_per_sample=[1, 0, 2]).dp_slice(dp_rank=1, dp_size=3)
    assert rank1.model_kwargs["pixel_values_videos"].numel() == 0
    assert rank1.model_kwargs["n_videos_per_sample"] == [0]
    for part in (first, second, rank1):
        revalidated(part)


def test_one_entry_per_video_is_sliced_by_video_range() -> None:
    b = video_batch(pixel_values_videos=torch.tensor([[0.0], [1.0], [2.0]]))
    assert b.dp_slice(dp_rank=2, dp_size=3).model_kwargs["pixel_values_videos"].tolist() == [[1.0], [2.0]]


def test_video_row_splits_need_per_row_counts_and_consistent_ones() -> None:
    no_counts = video_batch()
    no_counts = PuzzletronBatch(
        {k: v for k, v in no_counts.model_kwargs.items() if k != "n_videos_per_sample"}, modality="multimodal"
    )
    with pytest.raises(BatchValidationError, match="n_videos_per_sample"):
        no_counts.pp_microbatches(3)
    assert no_counts.pp_microbatches(1) == (no_counts,)  # a whole batch needs no counts
    with pytest.raises(BatchValidationError, match="must sum to the 3 rows of video_grid_thw"):
        video_batch(n_videos_per_sample=torch.tensor([1, 1, 2]))
    with pytest.raises(BatchValidationError, match=r"'num_videos_per_sample'.*must sum to the 3 rows"):
        video_batch(n_videos_per_sample=None, num_videos_per_sample=[0, 0, 2])


def test_padding_and_cp_keep_videos_whole() -> None:
    b = video_batch()
    padded = b.pad_batch_to_multiple(2)
    assert padded.model_kwargs["pixel_values_videos"] is b.model_kwargs["pixel_values_videos"]
    assert padded.model_kwargs["n_videos_per_sample"].tolist() == [1, 0, 2, 0]
    part = b.cp_partition(torch.tensor([0, 3]), cp_rank=0, cp_size=2)
    assert part.model_kwargs["video_grid_thw"] is b.model_kwargs["video_grid_thw"]
    revalidated(padded)
    revalidated(part)


# -- regressions found by the property tests --------------------------------------------------------


def test_a_cp_rank_without_tokens_rebuilds_thd_lengths() -> None:
    # T=2 over 3 ranks: the balanced split leaves rank 1 with no token at all (it used to raise IndexError).
    b = packed_row([1], 2, seq_lens=torch.tensor([[1]]), seq_lens_padded=torch.tensor([[2]]))
    empty = b.cp_partition(torch.tensor([], dtype=torch.long), cp_rank=1, cp_size=3)
    assert empty.sequence_length == 0
    assert empty.model_kwargs["seq_lens"].tolist() == [[-1000]]
    assert empty.sequence.local_cu_seqlens.tolist() == [0]
    revalidated(empty)


def test_one_row_of_per_row_cu_keeps_its_minus_one_padding_across_cp() -> None:
    from puzzletron.dataset.batch.cp import batch_cp_indices, gather_cp_partitions

    # A row of a larger AutoModel batch: cu_seqlens [1, D+1] padded with -1 after its one document.
    b = packed_row([4], 8, cu_seqlens=torch.tensor([[0, 4, -1]], dtype=torch.int32))
    indices = [batch_cp_indices(b, cp_rank=r, cp_size=2) for r in range(2)]
    parts = [b.cp_partition(i, cp_rank=r, cp_size=2) for r, i in enumerate(indices)]
    assert [p.model_kwargs["cu_seqlens"].tolist() for p in parts] == [[[0, 2, -1]], [[0, 2, -1]]]
    assert gather_cp_partitions(parts, indices).model_kwargs["cu_seqlens"].tolist() == [[0, 4, -1]]


# -- hostile tensors are errors naming the field (issue 12) -----------------------------------------------


def _two_by_three(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model_kwargs": {"input_ids": torch.ones(2, 3, dtype=torch.long)}}
    return {**base, **fields}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"model_kwargs": {"input_ids": torch.ones(2, 3)}},
            r"input_ids'\] must hold integer token ids.*float32",
        ),
        (
            {"model_kwargs": {"input_ids": torch.ones(2, 3, dtype=torch.bool)}},
            r"input_ids'\] must hold integer",
        ),
        (
            {"model_kwargs": {"input_ids": torch.ones(2, 3, dtype=torch.complex64)}},
            r"input_ids'\] must hold int",
        ),
        (
            {"model_kwargs": {"input_ids": -torch.ones(2, 3, dtype=torch.long)}},
            r"input_ids'\] must be token ids >= 0",
        ),
        ({"model_kwargs": {"input_ids": torch.ones(2, 3, dtype=torch.long, device="meta")}}, "meta device"),
        (
            {"model_kwargs": {"input_ids": torch.ones(2, 3, dtype=torch.long).to_sparse()}},
            "dense .*sparse_coo",
        ),
        ({"labels": torch.ones(2, 3)}, "labels must hold integer token ids; got dtype torch.float32"),
        ({"labels": torch.full((2, 3), float("nan"))}, "labels must hold integer token ids"),
        ({"labels": torch.full((2, 3), -5)}, "labels must be token ids >= 0 or -100"),
        ({"hidden_mask": torch.full((2, 3), float("nan"))}, "hidden_mask must hold only 0 and 1"),
        ({"ce_mask": torch.full((2, 3), float("inf"))}, "ce_mask must hold only 0 and 1"),
        ({"kd_mask": torch.full((2, 3), 2)}, "kd_mask must hold only 0 and 1"),
        ({"ce_mask": torch.full((2, 3), -1)}, "ce_mask must hold only 0 and 1"),
        ({"ce_mask": torch.ones(2, 3, dtype=torch.complex64)}, "ce_mask must be a bool"),
    ],
)
def test_hostile_tensors_are_errors_naming_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(BatchValidationError, match=message):
        PuzzletronBatch(**_two_by_three(**fields))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_seqlen": 2**70}, r"sequence.max_seqlen must be an int >= 0 and <= 4611686018427387904; got 1"),
        (
            {"sample_offsets": ((0, 2**70),)},
            r"sample_offsets must be token offsets in 0\.\.4611686018427387904",
        ),
        ({"sample_offsets": ((-1, 3),)}, "sample_offsets must be token offsets"),
    ],
)
def test_out_of_range_metadata_numbers_are_errors_naming_the_field(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(BatchValidationError, match=message):
        PackedSequenceMetadata(**fields)


def test_a_nested_tensor_kwarg_is_an_error_naming_it() -> None:
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(
        BatchValidationError, match=r"model_kwargs\['pixel_values'\] must be a dense .*nested"
    ):
        PuzzletronBatch(
            **_two_by_three(
                model_kwargs={"input_ids": torch.ones(2, 3, dtype=torch.long), "pixel_values": nested}
            )
        )


def test_negative_video_counts_that_sum_right_are_refused() -> None:
    kwargs = {
        "input_ids": torch.ones(2, 3, dtype=torch.long),
        "video_grid_thw": torch.ones(2, 3, dtype=torch.long),
        "pixel_values_videos": torch.ones(2, 4),
    }
    with pytest.raises(BatchValidationError, match=r"videos per row\) must be >= 0"):
        PuzzletronBatch(model_kwargs={**kwargs, "n_videos_per_sample": torch.tensor([3, -1])})
    with pytest.raises(BatchValidationError, match="per-row video counts must be >= 0"):
        PuzzletronBatch(model_kwargs={**kwargs, "n_videos_per_sample": [3, -1]})
    assert PuzzletronBatch(model_kwargs={**kwargs, "n_videos_per_sample": [2, 0]}).batch_size == 2


def test_a_huge_padding_multiple_is_an_error_not_an_allocation() -> None:
    with pytest.raises(
        BatchValidationError, match=r"multiple must be an int >= 1 and <= 65536; got 1099511627776"
    ):
        plain().pad_batch_to_multiple(2**40)
    assert plain().pad_batch_to_multiple(2**16).batch_size == 2**16


def test_float_masks_of_zeros_and_ones_are_accepted_and_counted_once() -> None:
    hidden = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    b = PuzzletronBatch(**_two_by_three(hidden_mask=hidden, ce_mask=hidden.clone()))
    assert b.hidden_mask is not None and b.hidden_mask.dtype == torch.float32
    # the extra value rules ride on the one host sync of construction
    assert host_reads(
        lambda: PuzzletronBatch(
            **_two_by_three(hidden_mask=hidden, labels=torch.where(hidden.bool(), 0, -100))
        )
    ) == host_reads(lambda: PuzzletronBatch(**_two_by_three(hidden_mask=hidden.bool())))

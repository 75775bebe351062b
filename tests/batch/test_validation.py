"""The construction rules of `PuzzletronBatch` (contract 3.1), one test per rule: shapes and sequence
kwargs, masks inside ``hidden_mask``, the cu / ``seq_ids`` / offsets of packed rows, CP ranks, media counts,
and hostile tensors (wrong dtypes, NaN, meta, sparse or nested tensors, out-of-range numbers, a huge padding
multiple). Every violation is a `BatchValidationError` naming the field, never a crash or an allocation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _batch_builders import plain, two_by_three
from puzzletron.dataset import PackedSequenceMetadata, PuzzletronBatch
from puzzletron.dataset.errors import BatchValidationError

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


# -- hostile tensors are errors naming the field (issue 12) -----------------------------------------------


def _poisoned(value: str) -> torch.Tensor:
    """``inputs_embeds`` [2, 3, 4] in bfloat16 with one NaN or Inf."""
    out = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    out[1, 2, 3] = float(value)
    return out


def _positions(value: str) -> torch.Tensor:
    out = torch.arange(3.0).expand(2, 3).clone()
    out[0, 1] = float(value)
    return out


def _additive(value: str) -> torch.Tensor:
    """A float attention mask: 0 where attended, -inf elsewhere (meaningful), and one ``value``."""
    out = torch.zeros(2, 3).masked_fill(torch.tensor([[False, False, True]] * 2), float("-inf"))
    out[0, 0] = float(value)
    return out


def test_infinities_where_they_mean_something_are_accepted() -> None:
    ids = torch.ones(2, 3, dtype=torch.long)
    assert (
        PuzzletronBatch(model_kwargs={"input_ids": ids, "attention_mask": _additive("-inf")}).batch_size == 2
    )
    embeds = torch.randn(2, 3, 4)
    assert PuzzletronBatch(model_kwargs={"input_ids": ids, "inputs_embeds": embeds}).batch_size == 2


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
        (
            {"labels": torch.ones(2, 3)},
            "labels must hold integer token ids of dtype int32 or int64; got torch.fl",
        ),
        ({"labels": torch.full((2, 3), float("nan"))}, "labels must hold integer token ids"),
        ({"labels": torch.full((2, 3), -5)}, "labels must be token ids >= 0 or -100"),
        ({"hidden_mask": torch.full((2, 3), float("nan"))}, "hidden_mask must hold only 0 and 1"),
        ({"ce_mask": torch.full((2, 3), float("inf"))}, "ce_mask must hold only 0 and 1"),
        ({"kd_mask": torch.full((2, 3), 2)}, "kd_mask must hold only 0 and 1"),
        ({"ce_mask": torch.full((2, 3), -1)}, "ce_mask must hold only 0 and 1"),
        ({"ce_mask": torch.ones(2, 3, dtype=torch.complex64)}, "ce_mask must be a bool"),
        (
            {
                "model_kwargs": {
                    "input_ids": torch.ones(2, 3, dtype=torch.long),
                    "inputs_embeds": _poisoned("nan"),
                }
            },
            r"model_kwargs\['inputs_embeds'\] must be finite \(no NaN or Inf\)",
        ),
        (
            {
                "model_kwargs": {
                    "input_ids": torch.ones(2, 3, dtype=torch.long),
                    "inputs_embeds": _poisoned("inf"),
                }
            },
            r"model_kwargs\['inputs_embeds'\] must be finite",
        ),
        (
            {
                "model_kwargs": {
                    "input_ids": torch.ones(2, 3, dtype=torch.long),
                    "position_ids": _positions("nan"),
                }
            },
            r"model_kwargs\['position_ids'\] must be finite",
        ),
        (
            {
                "model_kwargs": {
                    "input_ids": torch.ones(2, 3, dtype=torch.long),
                    "position_ids": _positions("-inf"),
                }
            },
            r"model_kwargs\['position_ids'\] must be finite",
        ),
        (
            {
                "model_kwargs": {
                    "input_ids": torch.ones(2, 3, dtype=torch.long),
                    "attention_mask": _additive("nan"),
                }
            },
            r"model_kwargs\['attention_mask'\] must hold no NaN",
        ),
    ],
)
def test_hostile_tensors_are_errors_naming_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(BatchValidationError, match=message):
        PuzzletronBatch(**two_by_three(**fields))


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
            **two_by_three(
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

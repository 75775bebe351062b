"""Goldens of the splits (contract 3.3) on text and packed rows: `cp_partition`, `dp_slice`,
`pp_microbatches` and `pad_batch_to_multiple`, their errors, a flat ``cu_seqlens`` no split can rebuild, and
batches of padding rows only. Expected tensors are written by hand; every derived batch is re-validated
through the public constructor (`dataclasses.replace`) to prove the no-validation path only ever builds valid
batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _batch_builders import media_batch, packed_row
from _batch_strategies import revalidated
from puzzletron.dataset import PackedSequenceMetadata, PuzzletronBatch
from puzzletron.dataset.errors import BatchValidationError

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


def test_dp_slice_size_one_is_identity_and_indivisible_batch_is_an_error() -> None:
    b = media_batch()
    assert b.dp_slice(dp_rank=0, dp_size=1) is b
    with pytest.raises(BatchValidationError, match=r"not divisible by dp_size 2.*sampler"):
        b.dp_slice(dp_rank=0, dp_size=2)
    with pytest.raises(BatchValidationError, match="dp_rank must be < dp_size"):
        b.dp_slice(dp_rank=3, dp_size=3)


# -- pp_microbatches ------------------------------------------------------------------------------


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

"""Load-balanced CP indices (contract 3.5): Transformer Engine golden, virtual padding, and the exact
inverse of `cp_partition` over random batches."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _batch_strategies import assert_token_kwargs_match_layout, batches, revalidated
from puzzletron.dataset import DataLayout, PackedSequenceMetadata, PuzzletronBatch
from puzzletron.dataset.batch import FLAT_BACKEND_KWARGS
from puzzletron.dataset.batch.cp import (
    batch_cp_indices,
    gather_cp_partitions,
    inverse_cp_permutation,
    load_balanced_cp_indices,
)
from puzzletron.dataset.errors import BatchValidationError


def test_transformer_engine_golden() -> None:
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert load_balanced_cp_indices(cu, cp_rank=0, cp_size=2).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert load_balanced_cp_indices(cu, cp_rank=1, cp_size=2).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]


def test_four_ranks_take_head_and_tail_chunks() -> None:
    cu = torch.tensor([0, 16])
    got = [load_balanced_cp_indices(cu, cp_rank=r, cp_size=4).tolist() for r in range(4)]
    assert got == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]


def test_plain_row_is_one_document() -> None:
    assert load_balanced_cp_indices(None, cp_rank=0, cp_size=2, sequence_length=8).tolist() == [0, 1, 6, 7]
    with pytest.raises(BatchValidationError, match="sequence_length is required"):
        load_balanced_cp_indices(None, cp_rank=0, cp_size=2)


def test_uneven_documents_are_virtually_padded_and_only_real_indices_returned() -> None:
    cu = torch.tensor([0, 3])  # chunks of ceil(3/4)=1: owners 0, 1, 1, (virtual 0)
    assert load_balanced_cp_indices(cu, cp_rank=0, cp_size=2).tolist() == [0]
    assert load_balanced_cp_indices(cu, cp_rank=1, cp_size=2).tolist() == [1, 2]
    with pytest.raises(BatchValidationError, match="multiple of 2\\*cp_size=4"):
        load_balanced_cp_indices(cu, cp_rank=0, cp_size=2, require_divisible=True)


def test_trailing_padding_is_one_more_segment() -> None:
    cu = torch.tensor([0, 4])
    assert load_balanced_cp_indices(cu, cp_rank=0, cp_size=2, sequence_length=8).tolist() == [0, 3, 4, 7]
    assert load_balanced_cp_indices(cu, cp_rank=1, cp_size=2, sequence_length=8).tolist() == [1, 2, 5, 6]
    with pytest.raises(BatchValidationError, match="shorter than cu_seqlens"):
        load_balanced_cp_indices(cu, cp_rank=0, cp_size=2, sequence_length=3)


@pytest.mark.parametrize(
    ("cu", "kwargs", "message"),
    [
        (torch.tensor([1, 4]), {"cp_rank": 0, "cp_size": 2}, "start at 0"),
        (torch.tensor([0, 4, 4]), {"cp_rank": 0, "cp_size": 2}, "strictly increasing"),
        (torch.tensor([0, 4]), {"cp_rank": 2, "cp_size": 2}, "cp_rank must be < cp_size"),
        (torch.tensor([0, 4]), {"cp_rank": 0, "cp_size": 0}, "cp_size must be an int >= 1"),
    ],
)
def test_index_helper_validates_its_inputs(cu: torch.Tensor, kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(BatchValidationError, match=message):
        load_balanced_cp_indices(cu, **kwargs)


def test_batch_indices_treat_padding_runs_as_segments() -> None:
    seq_ids = torch.tensor([[0, 0, -1, -1, 1, 1, 1, 1]])
    b = PuzzletronBatch(
        {"input_ids": torch.arange(8).reshape(1, 8)},
        hidden_mask=seq_ids >= 0,
        sequence=PackedSequenceMetadata(global_cu_seqlens=torch.tensor([0, 2, 6]), seq_ids=seq_ids),
        layout="packed_varlen",
    )
    assert batch_cp_indices(b, cp_rank=0, cp_size=2).tolist() == [0, 2, 4, 7]
    assert batch_cp_indices(b, cp_rank=1, cp_size=2).tolist() == [1, 3, 5, 6]
    # Without seq_ids the same segments come from cu and hidden_mask (the padding is mid-row, not trailing).
    no_ids = dataclasses.replace(
        b, sequence=PackedSequenceMetadata(global_cu_seqlens=torch.tensor([0, 2, 6]))
    )
    assert batch_cp_indices(no_ids, cp_rank=0, cp_size=2).tolist() == [0, 2, 4, 7]
    assert batch_cp_indices(no_ids, cp_rank=1, cp_size=2).tolist() == [1, 3, 5, 6]


def test_inverse_permutation_golden_and_errors() -> None:
    inv = inverse_cp_permutation([torch.tensor([0, 3]), torch.tensor([1, 2])])
    assert inv.tolist() == [0, 2, 3, 1]
    local = torch.tensor([10, 13, 11, 12])  # rank 0 then rank 1
    assert local[inv].tolist() == [10, 11, 12, 13]
    with pytest.raises(BatchValidationError, match="disjoint"):
        inverse_cp_permutation([torch.tensor([0, 1]), torch.tensor([1, 1])])
    with pytest.raises(BatchValidationError, match="cover exactly"):
        inverse_cp_permutation([torch.tensor([0, 5])])


def test_gather_checks_rank_order() -> None:
    b = PuzzletronBatch({"input_ids": torch.arange(8).reshape(1, 8)})
    idx = [batch_cp_indices(b, cp_rank=r, cp_size=2) for r in range(2)]
    parts = [b.cp_partition(i, cp_rank=r, cp_size=2) for r, i in enumerate(idx)]
    assert gather_cp_partitions(parts, idx) == b
    with pytest.raises(BatchValidationError, match="partitions\\[0\\] is CP rank 1 of 2"):
        gather_cp_partitions(parts[::-1], idx[::-1])
    with pytest.raises(BatchValidationError, match="one partition per index vector"):
        gather_cp_partitions(parts, idx[:1])


def _without_derived_kwargs(b: PuzzletronBatch) -> PuzzletronBatch:
    """``b`` as every CP round trip gives it back: flash kwargs over the flattened batch dropped (every split
    drops them; ``automodel.forward_kwargs`` rebuilds them) and ``max_seqlen`` filled in for packed batches
    (``cp_partition`` always sets the local one, so the inverse always sets the global one)."""
    kwargs = {k: v for k, v in b.model_kwargs.items() if k not in FLAT_BACKEND_KWARGS}
    seq = b.sequence
    if seq.global_cu_seqlens is not None:
        seq = dataclasses.replace(seq, max_seqlen=max(seq.global_cu_seqlens.diff().tolist(), default=0))
    return dataclasses.replace(b, model_kwargs=kwargs, sequence=seq)


def _local_counts(b: PuzzletronBatch, idx: torch.Tensor) -> list[int]:
    """Plain-Python local cu lengths: tokens of each global sample at ``idx``, in id order, zeros dropped."""
    ids = b.sequence.seq_ids[:, idx].reshape(-1).tolist()
    n = b.sequence.global_cu_seqlens.numel() - 1
    return [c for c in (ids.count(s) for s in range(n)) if c]


@settings(max_examples=80, deadline=None)
@given(st.one_of(batches(), batches(layouts=(DataLayout.PACKED_VARLEN,), max_rows=1)), st.integers(1, 4))
def test_cp_partition_of_every_rank_gathers_back_to_the_batch(b: PuzzletronBatch, cp_size: int) -> None:
    indices = [batch_cp_indices(b, cp_rank=r, cp_size=cp_size) for r in range(cp_size)]
    # The balanced indices of all ranks partition the tokens exactly once.
    assert sorted(torch.cat(indices).tolist()) == list(range(b.sequence_length))
    parts = [b.cp_partition(idx, cp_rank=r, cp_size=cp_size) for r, idx in enumerate(indices)]
    for rank, (idx, part) in enumerate(zip(indices, parts, strict=True)):
        for name in ("input_ids", "labels", "ce_mask", "kd_mask", "hidden_mask"):
            assert torch.equal(getattr(part, name), getattr(b, name)[:, idx]), name
        for key in ("attention_mask", "seq_idx"):
            if key in b.model_kwargs:
                assert torch.equal(part.model_kwargs[key], b.model_kwargs[key][:, idx]), key
        if "position_ids" in b.model_kwargs:
            assert torch.equal(part.model_kwargs["position_ids"], b.model_kwargs["position_ids"][..., idx])
        if "inputs_embeds" in b.model_kwargs:
            assert torch.equal(part.model_kwargs["inputs_embeds"], b.model_kwargs["inputs_embeds"][:, idx])
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            if key in b.model_kwargs:
                assert part.model_kwargs[key] is b.model_kwargs[key]  # media stay whole, never copied
        if cp_size == 1:
            assert part is b
            continue
        assert (part.sequence.cp_rank, part.sequence.cp_size) == (rank, cp_size)
        if b.layout is DataLayout.PACKED_VARLEN:
            # Local cu: per-sample counts of the rank's tokens, in sample order, zero counts dropped; the
            # global cu and offsets stay; max_seqlen and every cu-like kwarg follow the local layout.
            local = part.sequence.local_cu_seqlens
            want = _local_counts(b, idx)
            assert local.diff().tolist() == want
            assert int(local[-1]) == int(part.hidden_mask.sum())
            assert part.sequence.max_seqlen == max(want, default=0)
            assert part.sequence.global_cu_seqlens is b.sequence.global_cu_seqlens
            assert part.sequence.sample_offsets == b.sequence.sample_offsets
            assert_token_kwargs_match_layout(b, part)
        revalidated(part)
    gathered = gather_cp_partitions(parts, indices)
    # Fingerprint equality: every tensor, mask, label, kwarg and metadata field.
    assert gathered == _without_derived_kwargs(b)


def test_gather_restores_per_row_cu_thd_lengths_and_token_indices_exactly() -> None:
    seq_ids = torch.tensor([[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]])
    b = PuzzletronBatch(
        model_kwargs={
            "input_ids": torch.arange(12).reshape(2, 6),
            "seq_lens": torch.tensor([[3, 2], [4, -1000]]),
            "seq_lens_padded": torch.tensor([[3, 3], [6, -1000]]),
            "cu_seqlens": torch.tensor([[0, 3, 5], [0, 4, -1]], dtype=torch.int32),
            "packed_token_indices": torch.tensor([[0, 1, 2, 3, 4, -1], [0, 1, 2, 3, -1, -1]]),
            "max_seqlen": 4,
        },
        hidden_mask=seq_ids >= 0,
        sequence=PackedSequenceMetadata(
            global_cu_seqlens=torch.tensor([0, 3, 5, 9], dtype=torch.int32), seq_ids=seq_ids, max_seqlen=4
        ),
        layout="packed_varlen",
    )
    indices = [batch_cp_indices(b, cp_rank=r, cp_size=2) for r in range(2)]
    assert [i.tolist() for i in indices] == [[0, 1], [2, 3, 4, 5]]
    parts = [b.cp_partition(idx, cp_rank=r, cp_size=2) for r, idx in enumerate(indices)]
    assert parts[1].model_kwargs["cu_seqlens"].tolist() == [[0, 1, 3], [0, 2, -1]]
    assert parts[1].model_kwargs["seq_lens_padded"].tolist() == [[1, 3], [4, -1000]]
    assert parts[1].model_kwargs["packed_token_indices"].tolist() == [[0, 1, 2, -1], [0, 1, -1, -1]]
    gathered = gather_cp_partitions(parts, indices)
    assert gathered.model_kwargs["cu_seqlens"].tolist() == [[0, 3, 5], [0, 4, -1]]
    assert gathered.model_kwargs["seq_lens"].tolist() == [[3, 2], [4, -1000]]
    assert gathered.model_kwargs["packed_token_indices"].tolist() == [
        [0, 1, 2, 3, 4, -1],
        [0, 1, 2, 3, -1, -1],
    ]
    assert gathered == b


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 24), min_size=1, max_size=5), st.integers(1, 4), st.integers(0, 5), st.booleans()
)
def test_balanced_indices_partition_every_document_head_and_tail(
    lengths: list[int], cp_size: int, trailing: int, divisible: bool
) -> None:
    if divisible:  # the packer padded every document to a multiple of 2 * cp_size
        lengths = [n * 2 * cp_size for n in lengths]
        trailing *= 2 * cp_size
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    T = int(cu[-1]) + trailing
    ranks = [
        load_balanced_cp_indices(cu, cp_rank=r, cp_size=cp_size, sequence_length=T).tolist()
        for r in range(cp_size)
    ]
    assert sorted(i for rank in ranks for i in rank) == list(range(T))  # every token exactly once
    assert all(rank == sorted(rank) for rank in ranks)
    segments = [*lengths, *([trailing] if trailing else [])]
    if all(n % (2 * cp_size) == 0 for n in segments):
        # Divisible documents: rank r holds chunks r and 2cp-1-r of every document, so equal token counts.
        starts = [0, *itertools.accumulate(segments)]
        for r, rank in enumerate(ranks):
            want = []
            for start, n in zip(starts, segments, strict=False):
                chunk = n // (2 * cp_size)
                for c in sorted((r, 2 * cp_size - 1 - r)):
                    want += range(start + c * chunk, start + (c + 1) * chunk)
            assert rank == want

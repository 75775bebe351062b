"""Property tests over random valid batches (fixed / padded / packed; no media, one pixel row per image, flat
patches with `image_grid_thw`; `[B, T]` or mRoPE `[3, B, T]` positions): the splits are exact partitions."""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from _batch_strategies import batches, revalidated
from puzzletron.dataset import DataLayout, PuzzletronBatch
from puzzletron.dataset.errors import BatchValidationError

PROFILE = settings(max_examples=40, deadline=None)


def _rows_of(groups: list[PuzzletronBatch] | tuple[PuzzletronBatch, ...], get) -> torch.Tensor:
    return torch.cat([get(g) for g in groups], dim=0)


def _assert_rows_reassemble(original: PuzzletronBatch, groups: tuple[PuzzletronBatch, ...]) -> None:
    assert torch.equal(_rows_of(groups, lambda g: g.input_ids), original.input_ids)
    assert torch.equal(_rows_of(groups, lambda g: g.labels), original.labels)
    assert torch.equal(_rows_of(groups, lambda g: g.ce_mask), original.ce_mask)
    assert torch.equal(_rows_of(groups, lambda g: g.hidden_mask), original.hidden_mask)
    assert sum((g.sample_ids for g in groups), ()) == original.sample_ids
    pos = original.model_kwargs.get("position_ids")
    if pos is not None:
        axis = pos.dim() - 2
        assert torch.equal(torch.cat([g.model_kwargs["position_ids"] for g in groups], dim=axis), pos)
    if "inputs_embeds" in original.model_kwargs:
        assert torch.equal(
            _rows_of(groups, lambda g: g.model_kwargs["inputs_embeds"]),
            original.model_kwargs["inputs_embeds"],
        )
    if "pixel_values" in original.model_kwargs:
        for key in ("pixel_values", "image_grid_thw"):
            assert torch.equal(
                _rows_of(groups, lambda g, k=key: g.model_kwargs[k]), original.model_kwargs[key]
            )
        assert torch.equal(
            _rows_of(groups, lambda g: g.sequence.media_counts), original.sequence.media_counts
        )
        for g in groups:
            # Each group's pixel rows are exactly the images its rows own (pixel value = image number).
            counts = g.sequence.media_counts
            assert int(counts.sum()) == g.model_kwargs["image_grid_thw"].shape[0]
    if original.layout is DataLayout.PACKED_VARLEN:
        # Sample lengths survive the split; each group is renumbered from 0.
        lengths = torch.cat(
            [g.sequence.global_cu_seqlens.diff() for g in groups if g.sequence.global_cu_seqlens is not None]
        )
        assert torch.equal(lengths, original.sequence.global_cu_seqlens.diff())
        for g in groups:
            if g.sequence.global_cu_seqlens is not None:
                assert torch.equal(g.model_kwargs["cu_seqlens"], g.sequence.global_cu_seqlens)
                assert torch.equal(g.model_kwargs["seq_idx"], g.sequence.seq_ids.to(torch.int32))
    for g in groups:
        revalidated(g)


@PROFILE
@given(batches(), st.data())
def test_pp_microbatches_return_n_groups_that_concatenate_back(
    b: PuzzletronBatch, data: st.DataObject
) -> None:
    n = data.draw(st.integers(1, b.batch_size + 1))
    if n > b.batch_size:
        try:
            b.pp_microbatches(n)
        except BatchValidationError:
            return
        raise AssertionError("n > B must raise")
    groups = b.pp_microbatches(n)
    assert len(groups) == n
    assert all(g.batch_size >= 1 for g in groups)
    assert max(g.batch_size for g in groups) - min(g.batch_size for g in groups) <= 1
    _assert_rows_reassemble(b, groups)


@PROFILE
@given(batches(max_rows=6), st.data())
def test_dp_slice_over_all_ranks_partitions_rows_exactly_once(
    b: PuzzletronBatch, data: st.DataObject
) -> None:
    assume(not (b.layout is DataLayout.PACKED_VARLEN and b.batch_size == 1))  # the packed-row case is below
    divisors = [d for d in range(2, b.batch_size + 1) if b.batch_size % d == 0]
    assume(divisors)
    dp = data.draw(st.sampled_from(divisors))
    shards = tuple(b.dp_slice(dp_rank=r, dp_size=dp) for r in range(dp))
    assert {s.batch_size for s in shards} == {b.batch_size // dp}
    _assert_rows_reassemble(b, shards)


@PROFILE
@given(batches(layouts=(DataLayout.PACKED_VARLEN,), media=("none",), max_rows=1), st.data())
def test_dp_slice_never_splits_a_packed_sample(b: PuzzletronBatch, data: st.DataObject) -> None:
    n = b.sequence.global_cu_seqlens.numel() - 1
    dp = data.draw(st.integers(2, n + 1))
    if dp > n:
        try:
            b.dp_slice(dp_rank=0, dp_size=dp)
        except BatchValidationError:
            return
        raise AssertionError("fewer samples than ranks must raise")
    shards = [b.dp_slice(dp_rank=r, dp_size=dp) for r in range(dp)]
    ids, tokens = b.sequence.seq_ids[0], b.input_ids[0]
    lengths = b.sequence.global_cu_seqlens.diff().tolist()
    seen = 0
    for rank, shard in enumerate(shards):
        start, stop = shard.source_metadata["dp_packed_sample_range"]
        assert start == seen
        seen = stop
        assert stop - start in (n // dp, n // dp + 1)
        # The shard's valid tokens are exactly the original tokens of samples [start, stop), in order.
        want = tokens[(ids >= start) & (ids < stop)]
        got = shard.input_ids[0][shard.sequence.seq_ids[0] >= 0]
        assert torch.equal(got, want)
        assert shard.sequence.global_cu_seqlens.diff().tolist() == lengths[start:stop]
        assert shard.sample_ids[0].endswith(f":dp-{rank}")
        revalidated(shard)
    assert seen == n


@PROFILE
@given(batches(), st.integers(1, 4))
def test_pad_batch_adds_only_fully_masked_rows_and_shares_media(b: PuzzletronBatch, multiple: int) -> None:
    out = b.pad_batch_to_multiple(multiple)
    assert out.batch_size % multiple == 0
    assert out.batch_size - b.batch_size == (-b.batch_size) % multiple
    B = b.batch_size
    assert torch.equal(out.input_ids[:B], b.input_ids)
    assert torch.equal(out.labels[:B], b.labels)
    assert (out.labels[B:] == -100).all()
    assert not out.hidden_mask[B:].any()
    assert not out.ce_mask[B:].any()
    assert not out.model_kwargs["attention_mask"][B:].any()
    if "pixel_values" in b.model_kwargs:
        assert out.model_kwargs["pixel_values"].data_ptr() == b.model_kwargs["pixel_values"].data_ptr()
        assert out.model_kwargs["image_grid_thw"] is b.model_kwargs["image_grid_thw"]
        assert out.sequence.media_counts[B:].eq(0).all()
    if b.sequence.seq_ids is not None:
        assert (out.sequence.seq_ids[B:] == -1).all()
        assert out.sequence.global_cu_seqlens is b.sequence.global_cu_seqlens
    revalidated(out)

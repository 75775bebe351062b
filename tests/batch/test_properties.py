"""Property tests over random valid batches (see `_batch_strategies` for everything a batch may hold): row
splits and padding are exact, for every known kwarg (AutoModel per-row ``cu_seqlens``,
``packed_token_indices``, THD ``seq_lens*``, ``seq_idx``, per-row counts, image and video media). The CP
properties are in ``test_cp.py``, the fingerprint ones in ``test_fingerprint.py``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from _batch_strategies import THD_SENTINEL, assert_token_kwargs_match_layout, batches, revalidated
from puzzletron.dataset import DataLayout, PuzzletronBatch
from puzzletron.dataset.batch import FLAT_BACKEND_KWARGS
from puzzletron.dataset.errors import BatchValidationError

PROFILE = settings(max_examples=60, deadline=None)

# (pixel key, grid key, per-item keys, value of item 0 in the strategy's pixels)
IMAGES = ("pixel_values", "image_grid_thw", ("image_grid_thw",), 0.0)
VIDEOS = ("pixel_values_videos", "video_grid_thw", ("video_grid_thw", "second_per_grid_ts"), 1000.0)


def _cat(groups: Sequence[PuzzletronBatch], get: Callable[[PuzzletronBatch], Any], dim: int = 0) -> Any:
    parts = [get(g) for g in groups]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=dim)
    return type(parts[0])(item for part in parts for item in part)


def _as_list(value: Any) -> list[Any]:
    return value.tolist() if isinstance(value, torch.Tensor) else list(value)


def _item_counts(b: PuzzletronBatch, family: tuple[Any, ...]) -> list[int] | None:
    counts = b.sequence.media_counts if family is IMAGES else b.model_kwargs.get("n_videos_per_sample")
    return None if counts is None else _as_list(counts)


def _assert_media_follow_rows(original: PuzzletronBatch, groups: Sequence[PuzzletronBatch]) -> None:
    """Each group holds exactly the images/videos of its rows (a pixel row's value is its item number)."""
    for family in (IMAGES, VIDEOS):
        pixel_key, _, item_keys, first_value = family
        if pixel_key not in original.model_kwargs:
            continue
        counts = _item_counts(original, family)
        row = 0
        for g in groups:
            m0 = sum(counts[:row])
            m1 = m0 + sum(counts[row : row + g.batch_size])
            row += g.batch_size
            pixels = original.model_kwargs[pixel_key]
            item_of_row = pixels[:, 0] - first_value
            want = pixels[(item_of_row >= m0) & (item_of_row < m1)]
            assert torch.equal(g.model_kwargs[pixel_key], want)
            for key in item_keys:
                assert _as_list(g.model_kwargs[key]) == _as_list(original.model_kwargs[key][m0:m1]), key
            assert _item_counts(g, family) == counts[row - g.batch_size : row]


def _assert_rows_reassemble(original: PuzzletronBatch, groups: Sequence[PuzzletronBatch]) -> None:
    """Concatenating ``groups`` row-wise gives back every row-shaped tensor of ``original``."""
    for name in ("input_ids", "labels", "ce_mask", "kd_mask", "hidden_mask"):
        assert torch.equal(_cat(groups, lambda g, n=name: getattr(g, n)), getattr(original, name)), name
    assert _cat(groups, lambda g: g.sample_ids) == original.sample_ids
    kw = original.model_kwargs
    for key in (
        "attention_mask",
        "inputs_embeds",
        "packed_token_indices",
        "seq_lens",
        "seq_lens_padded",
        "num_patches",
        "n_images_per_sample",
        "n_videos_per_sample",
    ):
        if key in kw:
            got = _cat(groups, lambda g, k=key: g.model_kwargs[k])
            assert torch.equal(got, kw[key]) if isinstance(got, torch.Tensor) else got == kw[key], key
    pos = kw.get("position_ids")
    if pos is not None:
        assert torch.equal(_cat(groups, lambda g: g.model_kwargs["position_ids"], dim=pos.dim() - 2), pos)
    cu = kw.get("cu_seqlens")
    if isinstance(cu, torch.Tensor) and cu.dim() == 2 and original.batch_size > 1:
        assert torch.equal(_cat(groups, lambda g: g.model_kwargs["cu_seqlens"]), cu)  # per-row: sliced
    _assert_media_follow_rows(original, groups)
    if original.layout is DataLayout.PACKED_VARLEN:
        # Whole samples only: lengths survive the split in order; each group is renumbered from 0.
        lengths = torch.cat([g.sequence.global_cu_seqlens.diff() for g in groups])
        assert torch.equal(lengths, original.sequence.global_cu_seqlens.diff())
        for g in groups:
            n = g.sequence.global_cu_seqlens.numel() - 1
            valid = g.sequence.seq_ids[g.sequence.seq_ids >= 0]
            assert valid.tolist() == sorted(valid.tolist()) and set(valid.tolist()) == set(range(n))
            if isinstance(cu, torch.Tensor) and cu.dim() == 1:
                assert torch.equal(g.model_kwargs["cu_seqlens"], g.sequence.global_cu_seqlens)
            if "seq_idx" in kw:
                assert torch.equal(g.model_kwargs["seq_idx"], g.sequence.seq_ids.to(torch.int32))
            if "max_seqlen" in kw:
                assert g.model_kwargs["max_seqlen"] == max(
                    g.sequence.global_cu_seqlens.diff().tolist(), default=0
                )
    for g in groups:
        if len(groups) > 1:
            assert not set(FLAT_BACKEND_KWARGS) & set(g.model_kwargs)
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
@given(batches(layouts=(DataLayout.PACKED_VARLEN,), media=("none",), videos=False, max_rows=1), st.data())
def test_dp_slice_deals_whole_packed_samples_exactly_once(b: PuzzletronBatch, data: st.DataObject) -> None:
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
    kw = b.model_kwargs
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
        assert_token_kwargs_match_layout(b, shard)
        revalidated(shard)
    assert seen == n
    assert "cu_seq_lens_q" not in kw or all("cu_seq_lens_q" not in s.model_kwargs for s in shards)


@PROFILE
@given(batches(), st.integers(1, 4))
def test_pad_batch_adds_only_fully_masked_rows_and_never_copies_media(
    b: PuzzletronBatch, multiple: int
) -> None:
    out = b.pad_batch_to_multiple(multiple)
    B = b.batch_size
    assert out.batch_size % multiple == 0
    assert out.batch_size - B == (-B) % multiple
    if out.batch_size == B:
        assert out is b
        return
    extra = out.batch_size - B
    # The original rows are untouched ...
    assert torch.equal(out.input_ids[:B], b.input_ids)
    assert torch.equal(out.labels[:B], b.labels)
    assert out.sample_ids[:B] == b.sample_ids
    # ... and the new ones are fully masked: no target, no attention, no sample.
    assert (out.labels[B:] == -100).all()
    for mask in (out.hidden_mask, out.ce_mask, out.kd_mask, out.model_kwargs["attention_mask"]):
        assert not mask[B:].any()
    if b.sample_ids:
        assert out.sample_ids[B:] == tuple(f"__pp_padding_{i}" for i in range(extra))
    kw, new = b.model_kwargs, out.model_kwargs
    fills = {
        "seq_idx": -1,
        "packed_token_indices": -1,
        "seq_lens": THD_SENTINEL,
        "seq_lens_padded": THD_SENTINEL,
    }
    for key in ("input_ids", "inputs_embeds", "num_patches", *fills):
        if key in kw:
            assert torch.equal(new[key][:B], kw[key])
            assert (new[key][B:] == fills.get(key, 0)).all(), key
    if "position_ids" in kw:
        axis = kw["position_ids"].dim() - 2
        assert torch.equal(new["position_ids"].narrow(axis, 0, B), kw["position_ids"])
        assert not new["position_ids"].narrow(axis, B, extra).any()
    cu = kw.get("cu_seqlens")
    if isinstance(cu, torch.Tensor) and cu.dim() == 2:
        assert new["cu_seqlens"][B:].tolist() == [[0] + [-1] * (cu.shape[1] - 1)] * extra
    elif isinstance(cu, torch.Tensor):
        assert new["cu_seqlens"] is cu  # flat cu over the valid tokens: padding rows add none
    for key in ("n_images_per_sample", "n_videos_per_sample"):
        if key in kw:
            assert list(new[key])[B:] == [0] * extra and list(new[key])[:B] == list(kw[key])
    # Media are the very same objects: padding never copies an image or a video.
    for key in (
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "second_per_grid_ts",
    ):
        if key in kw:
            assert new[key] is kw[key]
    if b.sequence.media_counts is not None:
        assert out.sequence.media_counts.tolist() == [*b.sequence.media_counts.tolist(), *[0] * extra]
    if b.sequence.seq_ids is not None:
        assert (out.sequence.seq_ids[B:] == -1).all()
        assert out.sequence.global_cu_seqlens is b.sequence.global_cu_seqlens
    assert not set(FLAT_BACKEND_KWARGS) & set(new)
    revalidated(out)

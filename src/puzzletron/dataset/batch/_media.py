"""Media owned by a group of rows: images through ``sequence.media_counts``, videos through a per-row
count kwarg, each family's per-item kwargs and pixels (one entry per item, or flat patches aligned
through its grid) sliced to the rows' range.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from puzzletron.dataset.batch import segments as _segments
from puzzletron.dataset.batch._keys import PER_IMAGE_KWARGS, PER_VIDEO_KWARGS, VIDEO_KWARGS
from puzzletron.dataset.batch._tables import media_len
from puzzletron.dataset.batch._validation import video_counts
from puzzletron.dataset.batch._view import BatchView
from puzzletron.dataset.errors import BatchValidationError

__all__ = ["media_slices"]


def media_slices(b: BatchView, start: int, stop: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(kwargs updates, sequence updates) giving rows ``[start, stop)`` exactly their images and videos."""
    if start == 0 and stop == b.batch_size:
        return {}, {}
    updates, seq_updates = _image_slices(b, start, stop)
    updates.update(_video_slices(b, start, stop))
    return updates, seq_updates


def _image_slices(b: BatchView, start: int, stop: int) -> tuple[dict[str, Any], dict[str, Any]]:
    kwargs = b.model_kwargs
    counts = b.sequence.media_counts
    if counts is None:
        if any(media_len(kwargs.get(k)) > 0 for k in ("pixel_values", *PER_IMAGE_KWARGS)):
            raise BatchValidationError(
                "cannot split image media by rows without sequence.media_counts (images per row)"
            )
        return {}, {}
    offsets = _segments.media_offsets_from_counts(counts).tolist()  # one host read: [B + 1]
    updates = _aligned_media(kwargs, offsets, start, stop, "pixel_values", "image_grid_thw", PER_IMAGE_KWARGS)
    new_counts = counts[start:stop]
    seq_updates = {
        "media_counts": new_counts,
        "media_offsets": _segments.media_offsets_from_counts(new_counts).to(
            b.sequence.media_offsets.dtype if b.sequence.media_offsets is not None else torch.long
        ),
    }
    return updates, seq_updates


def _video_slices(b: BatchView, start: int, stop: int) -> dict[str, Any]:
    """Rows own videos through a per-row count kwarg (sliced with the rows by ``per_row_sequences`` or
    ``batch_axis_tensors``); the video kwargs follow it like the image ones follow ``media_counts``."""
    kwargs = b.model_kwargs
    present = [k for k in VIDEO_KWARGS if media_len(kwargs.get(k)) > 0]
    if not present:
        return {}
    counts = video_counts(kwargs, b.batch_size)
    if counts is None:
        raise BatchValidationError(
            f"cannot split video media {present} by rows without per-row video counts: pass "
            f"model_kwargs['n_videos_per_sample'] with B={b.batch_size} entries, or keep the batch whole"
        )
    offsets = [0, *itertools.accumulate(counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
    return _aligned_media(
        kwargs, offsets, start, stop, "pixel_values_videos", "video_grid_thw", PER_VIDEO_KWARGS
    )


def _aligned_media(
    kwargs: Mapping[str, Any],
    offsets: Sequence[int],
    start: int,
    stop: int,
    pixel_key: str,
    grid_key: str,
    per_item_keys: Sequence[str],
) -> dict[str, Any]:
    """Slices of one media family (images or videos) owned by rows ``[start, stop)``.

    ``offsets`` ``[B + 1]`` are the host media offsets of the rows. Per-item kwargs are sliced by media
    range; pixels by media range when they hold one entry per item, else by the flat patch ranges of the
    grid (``0, cumsum(t*h*w)``), else it is an error.
    """
    m0, m1, total = offsets[start], offsets[stop], offsets[-1]
    updates: dict[str, Any] = {}
    for key in per_item_keys:
        if kwargs.get(key) is not None:
            updates[key] = kwargs[key][m0:m1]
    pixels = kwargs.get(pixel_key)
    if pixels is None:
        return updates
    grid = kwargs.get(grid_key)
    if not isinstance(pixels, torch.Tensor) or pixels.shape[0] == total:
        updates[pixel_key] = pixels[m0:m1]
    elif isinstance(grid, torch.Tensor):
        patches = _segments.patch_offsets_from_grid(grid).tolist()
        if patches[-1] != pixels.shape[0]:
            raise BatchValidationError(
                f"{pixel_key} has {pixels.shape[0]} rows but {grid_key} describes {patches[-1]} "
                f"patches of {total} items"
            )
        updates[pixel_key] = pixels[patches[m0] : patches[m1]]
    else:
        raise BatchValidationError(
            f"cannot align flat {pixel_key} without {grid_key} ({pixels.shape[0]} rows for {total} items)"
        )
    return updates

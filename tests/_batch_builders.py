"""Hand-written `PuzzletronBatch`es the tests under ``tests/batch/`` share: a packed row of given sample
lengths, three media rows (images as one row each or as flat patches), a plain ``[2, 3]`` batch, three video
rows, and the fields of a ``[2, 3]`` batch with overrides. Token values are positions and pixel values item
numbers, so a misplaced token or image shows in the values."""

from __future__ import annotations

from typing import Any

import torch

from puzzletron.dataset import DataLayout, PackedSequenceMetadata, PuzzletronBatch

__all__ = ["media_batch", "packed_row", "plain", "two_by_three", "video_batch"]


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


def two_by_three(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model_kwargs": {"input_ids": torch.ones(2, 3, dtype=torch.long)}}
    return {**base, **fields}

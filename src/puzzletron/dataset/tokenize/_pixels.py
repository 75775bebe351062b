"""``pixel_values`` of RGB images bit for bit as ``Qwen2VLImageProcessorPil`` gives them, with less work.

The image processor (transformers 5.18, ``models/qwen2_vl/image_processing_pil_qwen2_vl.py``) resizes each
image with PIL (bicubic, to the grid's size), then ``rescale`` (``uint8 -> float64 * 1/255 -> float32``),
``normalize`` (``(x - mean[c]) / std[c]`` in float32) and ``patchify`` (a transpose into
``[patches, C * T * P * P]``, the frame repeated ``T`` times). After the resize every output value is a
function of one ``uint8`` and its channel, so the arithmetic is done once per (channel, value) into a
256-entry table per channel (the same float32 operations in the same order: identical results); each
image's table indices are transposed into patch order as uint16 (half the bytes a float32 transpose
moves) and the table is gathered straight into the output, in float32 or directly in ``bfloat16``
(each entry rounded as ``Tensor.to(bfloat16)`` rounds it): about half the processor's time in bfloat16.
Only a plain processor qualifies (`fast_pixels` returns None otherwise and the processor itself runs);
tests compare every batch's pixels with the processor's own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["fast_pixels"]

_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
_TABLES: dict[tuple[Any, ...], np.ndarray] = {}


def _plain(ip: Any) -> bool:
    """Whether `ip` is a Qwen2-VL PIL image processor doing exactly resize, rescale, normalize, patchify."""
    return (
        type(ip).__name__ == "Qwen2VLImageProcessorPil"
        and bool(getattr(ip, "do_resize", False))
        and bool(getattr(ip, "do_rescale", False))
        and bool(getattr(ip, "do_normalize", False))
        and int(getattr(ip, "resample", -1)) == _BICUBIC
        and len(list(getattr(ip, "image_mean", ()) or ())) == 3
        and len(list(getattr(ip, "image_std", ()) or ())) == 3
    )


def _table(ip: Any, dtype: torch.dtype) -> np.ndarray:
    """``[3, 256]``: every (channel, uint8 value) through rescale and normalize, in `dtype`'s bits."""
    key = (float(ip.rescale_factor), tuple(ip.image_mean), tuple(ip.image_std), dtype)
    if key not in _TABLES:
        values = np.arange(256, dtype=np.uint8).astype(np.float64) * float(ip.rescale_factor)
        values = values.astype(np.float32)  # rescale: float64 product, then float32
        mean = np.asarray(ip.image_mean, dtype=np.float32)[:, None]
        std = np.asarray(ip.image_std, dtype=np.float32)[:, None]
        table = (values[None, :] - mean) / std  # normalize, in float32
        if dtype == torch.bfloat16:  # the bits of each entry rounded as Tensor.to(bfloat16) rounds it
            table = torch.from_numpy(table).to(torch.bfloat16).view(torch.int16).numpy()
        _TABLES[key] = np.ascontiguousarray(table)
    return _TABLES[key]


def fast_pixels(
    image_processor: Any, images: list[Any], grid: np.ndarray, *, patch_size: int, merge_size: int,
    temporal_patch_size: int, dtype: torch.dtype,
) -> torch.Tensor | None:  # fmt: skip
    """``pixel_values`` ``[sum(h * w), 3 * T * P * P]`` in `dtype` of RGB PIL `images` whose grids ``[m, 3]``
    are `grid` (from their sizes: `GridConfig.grids`), equal to the image processor's; None when the
    processor is not a plain ``Qwen2VLImageProcessorPil`` or `dtype` is neither float32 nor bfloat16."""
    if not _plain(image_processor) or dtype not in (torch.float32, torch.bfloat16):
        return None
    table = _table(image_processor, dtype).reshape(-1)  # [3 * 256]: entry c * 256 + v
    p, m, t = patch_size, merge_size, temporal_patch_size
    grid = np.asarray(grid, dtype=np.int64).reshape(-1, 3)
    if any(getattr(image, "mode", None) != "RGB" for image in images):
        return None
    counts = grid[:, 1] * grid[:, 2]
    flat = np.empty((int(counts.sum()), 3 * t * p * p), dtype=table.dtype)  # written once, image by image
    start = 0
    for image, (_, gh, gw), n in zip(images, grid.tolist(), counts.tolist(), strict=True):
        resized = np.asarray(image.resize((gw * p, gh * p), resample=_BICUBIC, reducing_gap=None))
        index = resized.astype(np.uint16)  # [H, W, C] -> the table entry of each value
        index[..., 1] += 256
        index[..., 2] += 512
        # (gh/m, gw/m, m, m, C, p, p): patchify's order, moved as uint16
        blocks = index.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
        values = table[np.ascontiguousarray(blocks).reshape(n, 3, 1, p * p)]
        # the frame repeated over the temporal patch (patchify's broadcast)
        flat[start : start + n].reshape(n, 3, t, p * p)[...] = values
        start += n
    tensor = torch.from_numpy(flat)
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor

"""The image grid a Qwen2-VL-family image processor gives an image, computed from the image's size alone.

`GridConfig.grids` is the image processor's ``smart_resize`` + patchify, vectorised::

    grid (t, h, w) = (1, H' / patch, W' / patch)      tokens = t * h * w / merge**2

where ``(H', W')`` is ``(height, width)`` rounded to multiples of ``patch * merge`` and scaled into
``[min_pixels, max_pixels]`` (the image processor's ``size["shortest_edge"]`` / ``size["longest_edge"]``).
An image with an aspect ratio over 200 is refused by the processor; `grids` marks it instead.

Pure math on sizes: no processor, no image. `tokenize.processor` reads a processor's `GridConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["MAX_ASPECT", "GridConfig"]

MAX_ASPECT = 200  # the image processor refuses max(h, w) / min(h, w) above this


@dataclass(frozen=True)
class GridConfig:
    """What the image grid depends on: ``patch_size``, ``merge_size``, ``temporal_patch_size`` and the
    pixel budget ``[min_pixels, max_pixels]`` (the image processor's ``size``)."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int

    def grids(self, widths: np.ndarray, heights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(grid int64 [m, 3], refused bool [m])`` of images of ``widths`` / ``heights`` ``[m]``: exactly
        the image processor's ``image_grid_thw`` (``smart_resize``: Python's round-half-even, float64);
        ``refused`` marks aspect ratios over 200, which the processor rejects (their grid is meaningless).

        >>> g = GridConfig(14, 2, 2, 56 * 56, 448 * 448)
        >>> g.grids(np.array([56, 640]), np.array([56, 480]))[0].tolist()  # 640x480 is over max_pixels
        [[1, 4, 4], [1, 26, 36]]
        """
        w = np.asarray(widths, dtype=np.float64)
        h = np.asarray(heights, dtype=np.float64)
        factor = self.patch_size * self.merge_size
        small = np.maximum(np.minimum(w, h), 1.0)
        refused = (np.minimum(w, h) <= 0) | (np.maximum(w, h) / small > MAX_ASPECT)
        h_bar = np.round(h / factor) * factor  # numpy rounds half to even, like Python's round
        w_bar = np.round(w / factor) * factor
        area = np.maximum(h * w, 1.0)
        over = h_bar * w_bar > self.max_pixels
        under = ~over & (h_bar * w_bar < self.min_pixels)
        beta = np.sqrt(area / self.max_pixels)
        h_over = np.maximum(factor, np.floor(h / beta / factor) * factor)
        w_over = np.maximum(factor, np.floor(w / beta / factor) * factor)
        beta = np.sqrt(self.min_pixels / area)
        h_under = np.ceil(h * beta / factor) * factor
        w_under = np.ceil(w * beta / factor) * factor
        h_bar = np.where(over, h_over, np.where(under, h_under, h_bar))
        w_bar = np.where(over, w_over, np.where(under, w_under, w_bar))
        grid = np.stack(
            [np.ones_like(h_bar), h_bar // self.patch_size, w_bar // self.patch_size], axis=-1
        ).astype(np.int64)
        grid[refused] = 0
        return grid.reshape(-1, 3), refused.reshape(-1)

    def is_own_target(self, grid: np.ndarray) -> np.ndarray:
        """``bool [m]``: whether the target size of each grid of ``grid`` ``[m, 3]`` (``(w * P, h * P)``)
        gives that grid back. True but where ``smart_resize`` kept a side at ``patch * merge`` past
        ``max_pixels`` (an aspect ratio near 200 under a small budget): there the target holds more than
        ``max_pixels``."""
        grid = np.asarray(grid, dtype=np.int64).reshape(-1, 3)
        again, _ = self.grids(grid[:, 2] * self.patch_size, grid[:, 1] * self.patch_size)
        return (again == grid).all(axis=1)

    def first_other(self, images: list[Any], grid: np.ndarray) -> int:
        """The position of the first decoded image (PIL, as displayed) whose size gives another grid than
        its row of ``grid`` ``[m, 3]`` (the one its recorded size gave), else -1: a subset manifest that
        recorded another size than the image's."""
        sizes = np.asarray([image.size for image in images], dtype=np.int64).reshape(-1, 2)
        found, _ = self.grids(sizes[:, 0], sizes[:, 1])
        other = np.flatnonzero((found != np.asarray(grid, dtype=np.int64).reshape(-1, 3)).any(axis=1))
        return int(other[0]) if other.size else -1

    def tokens(self, grid: np.ndarray) -> np.ndarray:
        """``[m]`` tokens each image of ``grid`` ``[m, 3]`` becomes: ``t * h * w / merge**2``."""
        grid = np.asarray(grid, dtype=np.int64).reshape(-1, 3)
        return grid.prod(axis=1) // self.merge_size**2

    def facts(self) -> dict[str, int]:
        return {
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
        }

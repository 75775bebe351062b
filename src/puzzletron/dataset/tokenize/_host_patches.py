"""An image's patches in the processor's order, each value through a table, in one compiled pass (numba).

``Qwen2VLImageProcessorPil``'s ``patchify`` reorders the resized ``[h, w, C]`` image into
``[patches, C, T, P * P]``: merged patches (``m x m``) row by row, the patches of one in row order, a
plane a channel, the frame repeated ``T`` times. After the resize each output value is a function of one
uint8 and its channel (`tokenize._pixels`: a ``[3, 256]`` table of the rescale and normalise, or the
values themselves for the uint8 transport), so the table lookup and the reorder are one pass: a band of
``m * P`` rows is looked up into channel planes (a lookup a value, read once), then copied out in runs of
``P`` values. Copies and lookups only: bit for bit what the numpy ops give.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["patchify_rgbx"]


@njit(nogil=True, boundscheck=False, cache=False)
def _patchify(
    image: np.ndarray, table: np.ndarray, patch: int, merge: int, out: np.ndarray, planes: np.ndarray
) -> None:
    """``image`` uint8 ``[h, w, 4]`` (RGBX) -> ``out`` ``[patches, 3, T, P * P]`` in ``table``'s dtype
    (``[3, 256]``)."""
    width = image.shape[1]
    frames = out.shape[2]
    band = merge * patch
    n = 0
    for by in range(image.shape[0] // band):
        for row in range(band):
            line = image[by * band + row]
            for c in range(3):
                lookup = table[c]
                plane = planes[c, row]
                for x in range(width):
                    plane[x] = lookup[line[x, c]]
        for bx in range(width // band):
            for my in range(merge):
                for mx in range(merge):
                    x0 = (bx * merge + mx) * patch
                    for c in range(3):
                        for py in range(patch):
                            source = planes[c, my * patch + py]
                            for t in range(frames):
                                target = out[n, c, t]
                                for px in range(patch):
                                    target[py * patch + px] = source[x0 + px]
                    n += 1


def patchify_rgbx(
    image: np.ndarray, table: np.ndarray, *, patch_size: int, merge_size: int, out: np.ndarray
) -> None:
    """Write the patches of ``image`` (uint8 ``[h, w, 4]`` RGBX, ``h`` and ``w`` multiples of
    ``patch_size * merge_size``) into ``out`` (``[h * w / P**2, 3, T, P * P]``, C-contiguous), each value
    ``table[c, value]`` (``[3, 256]``, ``out``'s dtype). The first call of a dtype compiles (under a
    second)."""
    band = patch_size * merge_size
    planes = np.empty((3, band, image.shape[1]), table.dtype)  # one band of merged patches, looked up
    _patchify(image, table, patch_size, merge_size, out, planes)

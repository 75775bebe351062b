"""An image's patches in the processor's order, each value through a table, in one compiled pass (numba).

``Qwen2VLImageProcessorPil``'s ``patchify`` reorders the resized ``[h, w, C]`` image into
``[patches, C, T, P * P]``: merged patches (``m x m``) row by row, the patches of one in row order, a
plane a channel, the frame repeated ``T`` times. After the resize each output value is a function of one
uint8 and its channel (`tokenize._pixels`: a ``[3, 256]`` table of the rescale and normalise, or the
values themselves for the uint8 transport), so the table lookup and the reorder are one pass: a band of
``m * P`` rows is looked up into channel planes (a lookup a value, read once; for uint8 each channel split
from the pixel read as one uint32), each patch's first frame copied out of them row by row, then its other
frames copied from the first, several values a machine word. The kernel is compiled for one ``(P, m)``
at a time, those two constants in the code, so the copy of a patch row has a fixed length the compiler
unrolls (with the frame copies, half the uint8 patchify's CPU of runtime-length copies a frame each).
Copies and lookups only: bit for bit what the numpy ops give.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import numpy as np
from numba import njit

__all__ = ["patchify_rgbx"]

_NO_TABLE = np.zeros((3, 256), np.uint8)  # stands in where the values are their own output
# where each channel of an RGBX pixel read as one uint32 lies, on this machine's byte order
_SHIFTS = np.array([0, 8, 16] if sys.byteorder == "little" else [24, 16, 8], dtype=np.uint32)


@njit(nogil=True, boundscheck=False, cache=False)
def _look_up_band(image: np.ndarray, table: np.ndarray, top: int, planes: np.ndarray) -> None:
    """``planes[c, row, x] = table[c, image[top + row, x, c]]`` over one band (``image``: uint8
    ``[h, w * 4]``)."""
    for row in range(planes.shape[1]):
        line = image[top + row]
        for c in range(3):
            lookup = table[c]
            plane = planes[c, row]
            for x in range(planes.shape[2]):
                plane[x] = lookup[line[x * 4 + c]]


@njit(nogil=True, boundscheck=False, cache=False)
def _split_band(pixels: np.ndarray, top: int, planes: np.ndarray, shifts: np.ndarray) -> None:
    """``planes[c, row, x]`` = channel ``c`` of ``pixels[top + row, x]`` (uint32 RGBX; ``shifts``: each
    channel's bit offset on this machine's byte order), for the values themselves (uint8)."""
    red, green, blue = planes[0], planes[1], planes[2]
    for row in range(planes.shape[1]):
        line = pixels[top + row]
        r, g, b = red[row], green[row], blue[row]
        for x in range(planes.shape[2]):
            value = line[x]
            r[x] = (value >> shifts[0]) & 255
            g[x] = (value >> shifts[1]) & 255
            b[x] = (value >> shifts[2]) & 255


@functools.cache
def _patchify_kernel(patch: int, merge: int) -> Callable[..., None]:
    """The compiled patchify of one patch size and merge size (closure constants to numba)."""

    @njit(nogil=True, boundscheck=False, cache=False)
    def patchify(
        image: np.ndarray, table: np.ndarray, identity: bool, out: np.ndarray, wide_out: np.ndarray,
        planes: np.ndarray, shifts: np.ndarray,
    ) -> None:  # fmt: skip
        """``image`` uint8 ``[h, w, 4]`` (RGBX) -> ``out`` (``[patches, 3, T, P * P]``; ``wide_out`` the
        same memory a word at a time) a band of ``m * P`` rows at a time, looked up into ``planes``
        (``[3, m * P, w]``, ``table``'s dtype; the values themselves where ``identity``)."""
        band = merge * patch
        frames, words = out.shape[2], wide_out.shape[3]
        flat = image.reshape(image.shape[0], -1)
        pixels = image.view(np.uint32).reshape(image.shape[0], -1)
        n = 0
        for top in range(0, image.shape[0] - band + 1, band):
            if identity:
                _split_band(pixels, top, planes, shifts)
            else:
                _look_up_band(flat, table, top, planes)
            for bx in range(planes.shape[2] // band):
                for my in range(merge):
                    for mx in range(merge):
                        x0 = (bx * merge + mx) * patch
                        for c in range(3):
                            target = out[n, c, 0]
                            for py in range(patch):
                                source = planes[c, my * patch + py]
                                for px in range(patch):
                                    target[py * patch + px] = source[x0 + px]
                            first = wide_out[n, c, 0]
                            for t in range(1, frames):
                                again = wide_out[n, c, t]
                                for i in range(words):
                                    again[i] = first[i]
                        n += 1

    return patchify


def patchify_rgbx(
    image: np.ndarray, table: np.ndarray | None, *, patch_size: int, merge_size: int, out: np.ndarray
) -> None:
    """Write the patches of ``image`` (uint8 ``[h, w, 4]`` RGBX, C-contiguous, ``h`` and ``w`` multiples of
    ``patch_size * merge_size``) into ``out`` (``[h * w / P**2, 3, T, P * P]``, C-contiguous), each value
    ``table[c, value]`` (``[3, 256]``, ``out``'s dtype), or the value itself where ``table`` is None (uint8).
    The first call of a ``(P, m)`` and dtype compiles (under a second)."""
    dtype = np.dtype(np.uint8) if table is None else table.dtype
    # a frame copied from the first in words as wide as divide a frame's bytes, up to 8
    frame_bytes = patch_size * patch_size * dtype.itemsize
    word = np.dtype(f"u{next(f for f in (8, 4, 2, 1) if frame_bytes % f == 0)}")
    planes = np.empty((3, patch_size * merge_size, image.shape[1]), dtype)
    _patchify_kernel(patch_size, merge_size)(
        image, _NO_TABLE if table is None else table, table is None, out, out.view(word), planes, _SHIFTS
    )

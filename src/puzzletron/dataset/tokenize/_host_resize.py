"""Pillow's bicubic resize of an RGB image on the host, bit for bit, in compiled loops (numba).

Pillow's own resize (``src/libImaging/Resample.c``) is scalar C: about half of a VLM loader worker's CPU
in the default mode. This is the same arithmetic (`tokenize._resize.axis_taps`: the taps and fixed-point
weights; ``2**21 + sum(value * weight) >> 22`` clamped to ``[0, 255]`` in int32; the intermediate image
stored as uint8; Pillow's pass order), laid out so each tap is one multiply-add over many contiguous
values, which the compiler vectorises:

- the vertical pass: one output row is a weighted sum of whole input rows (``W * 4`` bytes each);
- the horizontal pass: rows go 16 at a time, the strip transposed to ``[W, 16]`` pixels so one output
  column is a weighted sum of whole strip rows (16 pixels' 4 bytes), then transposed back.

Integer operations only, so the result is the same on every machine. Images are Pillow's 4-byte RGBX
layout (``[H, W, 4]`` uint8, what `tokenize._pixels._rgbx_view` reads in place); the fourth byte is
resampled too and means nothing. The rules: ``docs/bit-exact-pixels.md``; tests compare the result with
``PIL.Image.resize`` on every size pair drawn.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from puzzletron.dataset.tokenize._resize import PRECISION_BITS, axis_taps, passes

__all__ = ["resize_rgbx"]

_STRIP = 16  # rows of the horizontal pass at a time: 64 int32 accumulators, a few vector registers
_HALF = 1 << (PRECISION_BITS - 1)


@njit(nogil=True, boundscheck=False, cache=False)
def _vertical(src: np.ndarray, first: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
    """``src`` uint8 ``[H, V]`` (V = width * 4) -> ``out`` uint8 ``[n_out, V]``: each output row the
    fixed-point sum of its taps' input rows."""
    n_in, width = src.shape
    n_out, taps = weights.shape
    acc = np.empty(width, np.int32)
    for y in range(n_out):
        start = first[y]
        acc[:] = _HALF
        for k in range(min(taps, n_in - start)):  # past its taps a row's weights are 0
            weight = weights[y, k]
            row = src[start + k]
            for i in range(width):
                acc[i] += np.int32(row[i]) * weight
        for i in range(width):
            out[y, i] = min(max(acc[i] >> PRECISION_BITS, 0), 255)


@njit(nogil=True, boundscheck=False, cache=False)
def _strip_in(src: np.ndarray, top: int, count: int, strip: np.ndarray) -> None:
    """``strip[j, r] = src[top + r, j]`` for the strip's ``count`` rows (uint32 pixels)."""
    for j in range(src.shape[1]):
        for r in range(count):
            strip[j, r] = src[top + r, j]


@njit(nogil=True, boundscheck=False, cache=False)
def _strip_out(result: np.ndarray, top: int, count: int, out: np.ndarray) -> None:
    """``out[top + r, x] = result[x, r]`` for the strip's ``count`` rows (uint32 pixels)."""
    for r in range(count):
        for x in range(result.shape[0]):
            out[top + r, x] = result[x, r]


@njit(nogil=True, boundscheck=False, cache=False)
def _horizontal(src: np.ndarray, first: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
    """``src`` uint32 ``[H, W]`` (one RGBX pixel each) -> ``out`` uint32 ``[H, n_out]``, `_STRIP` rows at
    a time through a transposed strip, so each tap is a contiguous multiply-add over the strip's bytes. (The
    multiply-add is written out here and in `_vertical`: as one shared helper it no longer vectorises,
    1.5x slower.)"""
    rows, n_in = src.shape
    n_out, taps = weights.shape
    strip = np.empty((n_in, _STRIP), np.uint32)
    strip_bytes = strip.view(np.uint8)  # [n_in, _STRIP * 4]
    result = np.empty((n_out, _STRIP), np.uint32)
    result_bytes = result.view(np.uint8)
    lanes = _STRIP * 4
    acc = np.empty(lanes, np.int32)
    for top in range(0, rows, _STRIP):
        count = min(_STRIP, rows - top)
        if count == _STRIP:  # the constant: a full strip's transposes unroll (about 10 % of the pass)
            _strip_in(src, top, _STRIP, strip)
        else:
            _strip_in(src, top, count, strip)
        for x in range(n_out):
            start = first[x]
            acc[:] = _HALF
            for k in range(min(taps, n_in - start)):
                weight = weights[x, k]
                column = strip_bytes[start + k]
                for i in range(lanes):
                    acc[i] += np.int32(column[i]) * weight
            for i in range(lanes):
                result_bytes[x, i] = min(max(acc[i] >> PRECISION_BITS, 0), 255)
        if count == _STRIP:
            _strip_out(result, top, _STRIP, out)
        else:
            _strip_out(result, top, count, out)


def resize_rgbx(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    """``pixels`` uint8 ``[H, W, 4]`` (C-contiguous RGBX) resized to ``[height, width, 4]`` exactly as
    ``PIL.Image.resize((width, height), BICUBIC, reducing_gap=None)`` resizes the RGB image (a new array;
    `pixels` itself where neither side changes). The first call in a process compiles (about a second)."""
    out = pixels
    for dim, n_in, size in passes(pixels.shape[0], pixels.shape[1], height, width):
        first, weights = axis_taps(n_in, size)
        rows, cols = out.shape[0], out.shape[1]
        if dim == 0:
            result = np.empty((size, cols, 4), np.uint8)
            _vertical(out.reshape(rows, cols * 4), first, weights, result.reshape(size, cols * 4))
        else:
            result = np.empty((rows, size, 4), np.uint8)
            pixels_in, pixels_out = out.view(np.uint32), result.view(np.uint32)  # one RGBX pixel each
            _horizontal(pixels_in.reshape(rows, cols), first, weights, pixels_out.reshape(rows, size))
        out = result
    return out

"""Pillow's bicubic resize of an RGB ``uint8`` image, bit for bit, as torch ops that run where the image is.

It lets decoded images be resized after ``.to(device)``, so the resize that dominates a VLM worker's CPU
can leave it (`tokenize._pixels.resized_patches`; ``build_vlm_batches(..., device_resize=True)``). It must
be the image processor's resize exactly. Pillow (``src/libImaging/Resample.c``, ``ImagingResampleInner``)
resizes an 8-bit image in two separable passes, horizontal then vertical, each a fixed-point convolution:

- for every output column (row) ``o`` of an axis of ``n_in -> n_out``: ``scale = n_in / n_out``, the
  filter stretched by ``max(scale, 1)``, support ``2 * max(scale, 1)``; taps from
  ``first = max(0, trunc(center - support + 0.5))`` up to ``min(n_in, trunc(center + support + 0.5))``
  around ``center = (o + 0.5) * scale``; weights the bicubic kernel (``a = -0.5``) at
  ``(tap - center + 0.5) / max(scale, 1)``, divided by their sum (summed in tap order), in float64;
- the weights in fixed point: ``trunc(w * 2**22 +- 0.5)`` (``PRECISION_BITS`` 22, rounded half away from
  zero), int32;
- each pass: ``2**21 + sum(value * weight)`` in int32 (no overflow: at most 255 * ~1.2 * 2**22), then
  ``>> 22`` clamped to ``[0, 255]``, stored as ``uint8`` before the next pass;
- the order of the passes: horizontal first, except (Pillow 13 and later) when the height shrinks by more
  than twice as many pixels as the width (``H - h > 0 and H - h > 2 * (W - w)``): vertical first. The two
  orders differ by the rounding of the intermediate image, so the rule follows the installed Pillow.

`axis_taps` computes the coefficients on the host (float64 numpy, the C code's operations in its order: a
few KiB an image); `resize_rgb` applies them to a ``[H, W, 3]`` uint8 tensor on its device, one gather and
multiply-add per tap (``K`` = 5 to ~9 taps at the processor's scales), no host sync. Tests compare it with
``PIL.Image.resize`` on every size pair drawn. The rules: ``docs/bit-exact-pixels.md``.
"""

from __future__ import annotations

import math

import numpy as np
import PIL
import torch

__all__ = ["PRECISION_BITS", "axis_taps", "host_to_device", "passes", "resize_rgb"]

PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed point for 8-bit images (2 bits of headroom for the lobes)
# Pillow 13 (python-pillow/Pillow#9549) runs the vertical pass first when the height shrinks much more
_VERTICAL_FIRST_RULE = int(PIL.__version__.split(".")[0]) >= 13


def _bicubic(x: np.ndarray) -> np.ndarray:
    """Pillow's ``bicubic_filter`` (``a = -0.5``) in its operation order, float64."""
    a = -0.5
    x = np.abs(x)
    inner = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    outer = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, inner, np.where(x < 2.0, outer, 0.0))


def axis_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """``(first int64 [n_out], weights int32 [n_out, K])``: the input index of each output's first tap and
    its ``K`` fixed-point weights (0 past the taps it has), Pillow's ``precompute_coeffs`` +
    ``normalize_coeffs_8bpc`` for one axis of ``n_in`` -> ``n_out`` pixels."""
    scale = float(n_in) / n_out
    filterscale = max(scale, 1.0)
    support = 2.0 * filterscale
    ksize = math.ceil(support) * 2 + 1
    center = (np.arange(n_out, dtype=np.float64) + 0.5) * scale
    first = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    count = np.minimum(np.trunc(center + support + 0.5), n_in).astype(np.int64) - first
    tap = np.arange(ksize, dtype=np.int64)
    weights = _bicubic(((tap[None, :] + first[:, None]) - center[:, None] + 0.5) * (1.0 / filterscale))
    weights = np.where(tap[None, :] < count[:, None], weights, 0.0)
    total = np.zeros(n_out, dtype=np.float64)
    for k in range(ksize):  # summed in tap order, as the C loop sums (np.sum would pair them)
        total += weights[:, k]
    weights = weights / np.where(total == 0.0, 1.0, total)[:, None]  # a zero sum leaves them as they are
    fixed = np.trunc(np.where(weights < 0, -0.5, 0.5) + weights * (1 << PRECISION_BITS))
    return first, fixed.astype(np.int32)


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device`; to an accelerator from pinned memory, so the copy is queued, not waited for."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _pass(image: torch.Tensor, first: np.ndarray, weights: np.ndarray, dim: int) -> torch.Tensor:
    """One axis of the resize: ``image`` uint8 with that axis at ``dim`` -> uint8 with ``n_out`` there."""
    n_in = image.shape[dim]
    device = image.device
    taps = weights.shape[1]
    index = np.minimum(first[:, None] + np.arange(taps)[None, :], n_in - 1)  # a weight-0 tap may point past
    index_t = host_to_device(np.ascontiguousarray(index.T), device)
    weight_shape = [1] * image.dim()
    weight_shape[dim] = weights.shape[0]
    weights_t = host_to_device(np.ascontiguousarray(weights.T), device)
    values = image.to(torch.int32)
    total = torch.full((), 1 << (PRECISION_BITS - 1), dtype=torch.int32, device=device)
    for k in range(taps):
        total = total + values.index_select(dim, index_t[k]) * weights_t[k].reshape(weight_shape)
    return (total >> PRECISION_BITS).clamp_(0, 255).to(torch.uint8)


def passes(rows: int, cols: int, height: int, width: int) -> list[tuple[int, int, int]]:
    """Pillow's passes of a resize ``[rows, cols] -> [height, width]`` in the order the installed Pillow
    runs them: ``(dim, n_in, n_out)`` for each axis whose size changes (0: rows, 1: columns; an axis that
    keeps its size is not resampled)."""
    vertical_first = _VERTICAL_FIRST_RULE and rows - height > 0 and rows - height > 2 * (cols - width)
    sizes = {0: (rows, height), 1: (cols, width)}
    return [
        (dim, *sizes[dim]) for dim in ((0, 1) if vertical_first else (1, 0)) if sizes[dim][0] != sizes[dim][1]
    ]


def resize_rgb(image: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """``image`` uint8 ``[H, W, 3]`` resized to ``[height, width, 3]`` exactly as
    ``PIL.Image.resize((width, height), BICUBIC, reducing_gap=None)`` resizes it, on ``image``'s device.
    An axis whose size does not change is left as it is (Pillow skips that pass)."""
    out = image
    for dim, n_in, n_out in passes(int(image.shape[0]), int(image.shape[1]), height, width):
        out = _pass(out, *axis_taps(n_in, n_out), dim=dim)
    return out

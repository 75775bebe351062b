"""``pixel_values`` of RGB images bit for bit as ``Qwen2VLImageProcessorPil`` gives them, with less work.

The image processor (transformers 5.18, ``models/qwen2_vl/image_processing_pil_qwen2_vl.py``) resizes each
image with PIL (bicubic, to the grid's size), then ``rescale`` (``uint8 -> float64 * 1/255 -> float32``),
``normalize`` (``(x - mean[c]) / std[c]`` in float32) and ``patchify`` (a transpose into
``[patches, C * T * P * P]``, the frame repeated ``T`` times). After the resize every output value is a
function of one ``uint8`` and its channel, so the arithmetic is done once per (channel, value) into a
256-entry table per channel (the same float32 operations in the same order: identical results; in
``bfloat16`` each entry rounded as ``Tensor.to(bfloat16)`` rounds it). Each image is read where Pillow holds
it (`_rgbx_view`: RGBX, no copy), resized by the same integer arithmetic as Pillow's in compiled loops
(`tokenize._host_resize`, 2-3x faster than Pillow's scalar C), and looked up and patchified in one compiled
pass (`tokenize._host_patches`) into the batch's buffer. About 0.4-0.55x the processor's CPU before these
kernels (``benchmarks/bench_vlm_cpu.py``).
Only a plain processor qualifies (`fast_pixels` returns None otherwise and the processor itself runs);
tests compare every batch's pixels with the processor's own.

The uint8 transport (``dtype=torch.uint8``): the resized values themselves, patchified, a quarter of
float32's bytes; `pixel_normalization` is what turns them into the processor's output later and
`normalize_pixels` does it wherever the tensor is (on the accelerator after ``.to(device)``: the table of
``[3, 256]`` float32 values built there by the same float64 rescale and float32 normalise, then one
gather), so its result is the processor's float32 output bit for bit.

`resized_patches` is the step before that, on the device too: decoded uint8 images (``[H, W, 3]``, as
``np.asarray`` of the RGB PIL image) resized by `tokenize._resize.resize_rgb` (Pillow's bicubic in fixed
point, bit for bit) and patchified into the uint8 patches above, so neither the resize nor the normalise
needs a worker's CPU.

The decoded-image transport (``build_vlm_batches(..., pixel_dtype=torch.uint8, device_resize=True)``):
a worker only decodes; `decoded_pixels` hands each image on as uint8 ``[H, W, 3]``, at its own size, or
already at its target size (Pillow's resize, the processor's) when it holds over twice the target's
pixels, so no image costs more bytes than its uint8 patches (``2 * 3`` bytes a target pixel). Either
way the grid of an entry's own size is the image's grid (``smart_resize`` of a target size is that size),
so `normalized_pixels` finds every target from the entries' shapes and the batch's ``pixel_resize`` (the
`GridConfig` facts), with no read of ``image_grid_thw``'s values, and no host sync.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import torch

from puzzletron.dataset.distributed.transport import batch_buffer
from puzzletron.dataset.tokenize._resize import host_to_device, resize_rgb
from puzzletron.dataset.tokenize.grid import GridConfig

__all__ = [
    "decoded_pixels",
    "fast_pixels",
    "normalize_pixels",
    "normalized_pixels",
    "pixel_normalization",
    "resized_patches",
    "resizes_exactly",
]

_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
_TABLES: dict[tuple[Any, ...], np.ndarray] = {}
# [gh/m, m, p, gw/m, m, p, C] -> (gh/m, gw/m, m, m, C, p, p): patchify's order (numpy and torch alike)
_PATCH_ORDER = (0, 3, 1, 4, 6, 2, 5)


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
    return _table_of(pixel_normalization(ip), dtype)


def _table_of(norm: dict[str, Any], dtype: torch.dtype) -> np.ndarray:
    """`_table` of a `pixel_normalization` (IEEE operations: the same bits on any device)."""
    key = (norm["rescale_factor"], tuple(norm["image_mean"]), tuple(norm["image_std"]), dtype)
    if key not in _TABLES:
        values = np.arange(256, dtype=np.uint8).astype(np.float64) * float(norm["rescale_factor"])
        values = values.astype(np.float32)  # rescale: float64 product, then float32
        mean = np.asarray(norm["image_mean"], dtype=np.float32)[:, None]
        std = np.asarray(norm["image_std"], dtype=np.float32)[:, None]
        table = (values[None, :] - mean) / std  # normalize, in float32
        if dtype == torch.bfloat16:  # the bits of each entry rounded as Tensor.to(bfloat16) rounds it
            table = torch.from_numpy(table).to(torch.bfloat16).view(torch.int16).numpy()
        _TABLES[key] = np.ascontiguousarray(table)
    return _TABLES[key]


def pixel_normalization(ip: Any) -> dict[str, Any]:
    """What turns the uint8 patches of `ip` (an image processor that rescales and normalises) into its
    output: ``rescale_factor``, ``image_mean`` and ``image_std`` (3 each), as JSON-able floats."""
    return {
        "rescale_factor": float(ip.rescale_factor),
        "image_mean": [float(v) for v in ip.image_mean],
        "image_std": [float(v) for v in ip.image_std],
    }


def normalize_pixels(
    pixels: torch.Tensor, norm: dict[str, Any], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 patches ``[patches, 3 * T * P * P]`` (channel-major columns) -> the image processor's
    ``pixel_values`` in `dtype` (float32 then cast, as ``Tensor.to`` rounds), on `pixels`' device: rescale in
    float64 then float32, ``(x - mean[c]) / std[c]`` in float32 (the processor's operations: a ``[3, 256]``
    table built on the host, queued to the device without a wait, then one gather)."""
    device = pixels.device
    table = host_to_device(_table_of(norm, torch.float32).reshape(-1), device)  # entry c * 256 + v
    width = pixels.shape[1]
    base = (
        torch.arange(width, dtype=torch.int32, device=device)
        .div_(width // 3, rounding_mode="floor")
        .mul_(256)
    )
    return table[pixels.int() + base].to(dtype)


def normalized_pixels(
    kwargs: dict[str, Any], metadata: Any, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """A model's `kwargs` with uint8 ``pixel_values`` normalised where they are (after ``batch.to(device)``:
    on the accelerator) when the batch's `metadata` (``source_metadata``) holds ``pixel_normalization``
    (``build_vlm_batches(..., pixel_dtype=torch.uint8)``): exactly the image processor's float32 output,
    then `dtype` (the model's; float32 when None). Decoded images (a list of uint8 ``[H, W, 3]``, with
    ``pixel_resize`` in `metadata`: ``device_resize=True``) are resized and patchified there first
    (`resized_patches`). What `clients.attention.model_inputs` calls."""
    norm, pixels = metadata.get("pixel_normalization"), kwargs.get("pixel_values")
    if norm is None:
        return kwargs
    if isinstance(pixels, list | tuple) and metadata.get("pixel_resize") is not None:
        device = pixels[0].device if pixels else _device_of(kwargs)
        pixels = _patches_of_decoded(list(pixels), metadata["pixel_resize"], device)
    if not isinstance(pixels, torch.Tensor) or pixels.dtype != torch.uint8:
        return kwargs
    return {**kwargs, "pixel_values": normalize_pixels(pixels, norm, dtype or torch.float32)}


def _device_of(kwargs: dict[str, Any]) -> torch.device:
    ids = kwargs.get("input_ids")
    return ids.device if isinstance(ids, torch.Tensor) else torch.device("cpu")


def _patches_of_decoded(
    images: list[torch.Tensor], facts: dict[str, Any], device: torch.device
) -> torch.Tensor:
    """uint8 patches of decoded images (each at its own or its target size: `decoded_pixels`); each target
    from the entry's shape, a host fact (no read of a device value)."""
    config = GridConfig(**{k: int(v) for k, v in facts.items()})
    if not images:
        width = 3 * config.temporal_patch_size * config.patch_size**2
        return torch.zeros(0, width, dtype=torch.uint8, device=device)
    sizes = np.asarray([(int(i.shape[1]), int(i.shape[0])) for i in images], dtype=np.int64).reshape(-1, 2)
    grid, _ = config.grids(sizes[:, 0], sizes[:, 1])
    return resized_patches(
        images, grid, patch_size=config.patch_size, merge_size=config.merge_size,
        temporal_patch_size=config.temporal_patch_size,
    )  # fmt: skip


def resizes_exactly(image_processor: Any) -> bool:
    """Whether `image_processor` is one whose resize `tokenize._resize` reproduces bit for bit (a plain
    ``Qwen2VLImageProcessorPil``: bicubic resize, rescale, normalise, patchify): the decoded-image
    transport's condition."""
    return _plain(image_processor)


def _rgbx_view(image: Any) -> np.ndarray | None:
    """A read-only uint8 ``[H, W, 4]`` view of an RGB PIL `image`'s own memory: Pillow keeps RGB pixels as
    4 bytes (RGBX) and exports them through the Arrow C data interface without a copy, where
    ``np.asarray`` packs them into a new ``bytes`` object first (a copy of every pixel). None where the
    export is refused (an image whose rows span several of Pillow's memory blocks, over ~16 MiB; a Pillow
    before 11.2)."""
    try:
        pixels = pa.array(image).flatten().to_numpy(zero_copy_only=True)
    except (AttributeError, TypeError, ValueError, pa.ArrowException):
        return None
    width, height = image.size
    return pixels.reshape(height, width, 4)


def _rgb_view(image: Any) -> np.ndarray:
    """A read-only uint8 ``[H, W, 3]`` view of an RGB PIL `image`'s own memory (`_rgbx_view`), or
    ``np.asarray``'s copy where that is refused."""
    rgbx = _rgbx_view(image)
    return np.asarray(image) if rgbx is None else rgbx[..., :3]


def _resized_rgbx(image: Any, width: int, height: int) -> np.ndarray:
    """uint8 ``[height, width, 4]`` (RGBX): RGB PIL `image` resized as the processor resizes it (Pillow's
    bicubic, ``reducing_gap=None``) by `tokenize._host_resize` (the same integers, 2-3x faster), from the
    image's memory read in place (an RGBA copy where that is refused). Read-only: the image's own memory
    where the size does not change."""
    from puzzletron.dataset.tokenize._host_resize import resize_rgbx  # numba: imported on first use

    rgbx = _rgbx_view(image)
    if rgbx is None:
        rgbx = np.asarray(image.convert("RGBA"))
    return resize_rgbx(rgbx, width, height)


def decoded_pixels(images: list[Any], grid: np.ndarray, config: GridConfig) -> list[torch.Tensor]:
    """The decoded-image transport's ``pixel_values``: one uint8 ``[H, W, 3]`` tensor a RGB PIL image of
    `images`, whose grids ``[m, 3]`` (under `config`) are `grid`, each of a size whose grid is its image's:
    the image as it is, or resized to its target ``(w * P, h * P)`` as the processor resizes it where it
    holds more than twice the target's pixels (so no more bytes than its uint8 patches) or its own size
    gives another grid (decoded at a reduced size: ``draft``), unless the target does not give the grid
    back (`GridConfig.is_own_target`; then the image as it is). `ValueError` for an image neither way
    describes (a draft of such a grid: `pipelines._vlm_media` never drafts them)."""
    grid = np.asarray(grid, dtype=np.int64).reshape(-1, 3)
    sizes = np.asarray([image.size for image in images], dtype=np.int64).reshape(-1, 2)
    own, _ = config.grids(sizes[:, 0], sizes[:, 1])
    describes = (own == grid).all(axis=1)
    target = grid[:, [2, 1]] * config.patch_size  # (width, height)
    resize = (~describes | (sizes.prod(axis=1) > 2 * target.prod(axis=1))) & config.is_own_target(grid)
    if (bad := np.flatnonzero(~describes & ~resize)).size:
        k = int(bad[0])
        raise ValueError(
            f"decoded image {k} is {sizes[k, 0]}x{sizes[k, 1]}, which gives grid {own[k].tolist()}, not its "
            f"{grid[k].tolist()}, whose target size does not give it back either: decode it in full"
        )
    out = []
    for image, (width, height), again in zip(images, target.tolist(), resize.tolist(), strict=True):
        pixels = _resized_rgbx(image, width, height)[..., :3] if again else _rgb_view(image)
        out.append(torch.from_numpy(np.array(pixels, order="C")))  # a writable copy
    return out


def fast_pixels(
    image_processor: Any, images: list[Any], grid: np.ndarray, *, patch_size: int, merge_size: int,
    temporal_patch_size: int, dtype: torch.dtype,
) -> torch.Tensor | None:  # fmt: skip
    """``pixel_values`` ``[sum(h * w), 3 * T * P * P]`` in `dtype` of RGB PIL `images` whose grids ``[m, 3]``
    are `grid` (from their sizes: `GridConfig.grids`), equal to the image processor's; None when the
    processor is not a plain ``Qwen2VLImageProcessorPil`` or `dtype` is not float32, bfloat16 or uint8
    (the resized values, unnormalised: `normalize_pixels`)."""
    if not _plain(image_processor) or dtype not in (torch.float32, torch.bfloat16, torch.uint8):
        return None
    if any(getattr(image, "mode", None) != "RGB" for image in images):
        return None
    from puzzletron.dataset.tokenize._host_patches import patchify_rgbx  # numba: imported on first use

    p, m, t = patch_size, merge_size, temporal_patch_size
    # [3, 256]: the output of each (channel, value); none for uint8 (the values themselves)
    table = None if dtype == torch.uint8 else _table(image_processor, dtype)
    out_dtype = np.dtype(np.uint8) if table is None else table.dtype
    grid = np.asarray(grid, dtype=np.int64).reshape(-1, 3)
    counts = grid[:, 1] * grid[:, 2]
    shape = (int(counts.sum()), 3, t, p * p)
    # in a loader worker, built where it crosses to the trainer (`transport.batch_buffer`: no copy there)
    out = batch_buffer(int(np.prod(shape)) * out_dtype.itemsize).view(out_dtype).reshape(shape)
    start = 0
    for image, (_, gh, gw), n in zip(images, grid.tolist(), counts.tolist(), strict=True):
        resized = _resized_rgbx(image, gw * p, gh * p)
        patchify_rgbx(resized, table, patch_size=p, merge_size=m, out=out[start : start + n])
        start += n
    tensor = torch.from_numpy(out.reshape(len(out), -1))
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def resized_patches(
    images: list[torch.Tensor],
    grid: np.ndarray,
    *,
    patch_size: int,
    merge_size: int,
    temporal_patch_size: int,
) -> torch.Tensor:
    """uint8 patches ``[sum(h * w), 3 * T * P * P]`` of decoded RGB images (uint8 ``[H, W, 3]`` each, on any
    device) whose grids ``[m, 3]`` (host, from their sizes: `GridConfig.grids`) are `grid`: each resized to
    ``(w * P, h * P)`` as Pillow's bicubic resizes it (`tokenize._resize.resize_rgb`) and patchified in the
    processor's order, on the images' device. `normalize_pixels` of the result is the image processor's
    ``pixel_values`` bit for bit."""
    p, m, t = patch_size, merge_size, temporal_patch_size
    parts = []
    for image, (_, gh, gw) in zip(
        images, np.asarray(grid, dtype=np.int64).reshape(-1, 3).tolist(), strict=True
    ):
        resized = resize_rgb(image, gw * p, gh * p)
        blocks = resized.reshape(gh // m, m, p, gw // m, m, p, 3).permute(_PATCH_ORDER)
        values = blocks.reshape(gh * gw, 3, 1, p * p).expand(gh * gw, 3, t, p * p)  # the frame T times
        parts.append(values.reshape(gh * gw, 3 * t * p * p))
    if not parts:
        return torch.zeros(0, 3 * t * p * p, dtype=torch.uint8)
    return torch.cat(parts)

"""The bit-exact pixel path: ``pixel_values`` of RGB images equal ``Qwen2VLImageProcessorPil``'s own output
(float32, and bfloat16 as ``Tensor.to`` rounds it) for images resized up and down under both fixture
configs, and any other processor (or image) falls back to the processor itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from _conversation_samples import pil_image
from _vlm_reference import LOADERS
from puzzletron.dataset.tokenize import vlm_processor
from puzzletron.dataset.tokenize._pixels import (
    fast_pixels,
    normalize_pixels,
    pixel_normalization,
    resized_patches,
)

SIZES = [(20, 20), (56, 56), (57, 300), (300, 57), (448, 448), (640, 480), (1000, 30), (3, 90), (129, 131)]


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pixels_equal_the_image_processor(
    kind: str, dtype: torch.dtype, processor_dirs: dict[str, Path]
) -> None:
    processor = LOADERS[kind](processor_dirs[kind])
    parts = vlm_processor(processor)
    images = [pil_image(i, size) for i, size in enumerate(SIZES)]
    grid, _ = parts.grid.grids(*np.array(SIZES).T)
    want = processor.image_processor(images=images, return_tensors="pt")
    got, grid_out, computed = parts.pixels(images, grid, dtype=dtype)
    assert computed and torch.equal(grid_out, want["image_grid_thw"])
    assert got.dtype == dtype and torch.equal(got, want["pixel_values"].to(dtype))


def test_another_processor_or_image_mode_falls_back(processor_dirs: dict[str, Path]) -> None:
    processor = LOADERS["qwen2_5_vl"](processor_dirs["qwen2_5_vl"])
    parts = vlm_processor(processor)
    images = [pil_image(1, (60, 80))]
    grid, _ = parts.grid.grids(np.array([60]), np.array([80]))
    options = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "dtype": torch.float32}
    assert fast_pixels(processor.image_processor, images, grid, **options) is not None
    assert fast_pixels(processor.image_processor, [images[0].convert("L")], grid, **options) is None
    assert fast_pixels(processor.image_processor, images, grid, **{**options, "dtype": torch.float16}) is None
    processor.image_processor.do_normalize = False
    assert fast_pixels(processor.image_processor, images, grid, **options) is None
    got, _, computed = vlm_processor(processor).pixels(images, grid)
    want = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    assert not computed and torch.equal(got, want)


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_uint8_pixels_and_decoded_images_resized_on_device_normalise_to_the_processor_output(
    kind: str, processor_dirs: dict[str, Path]
) -> None:
    processor = LOADERS[kind](processor_dirs[kind])
    parts = vlm_processor(processor)
    images = [pil_image(i, size) for i, size in enumerate(SIZES)]
    grid, _ = parts.grid.grids(*np.array(SIZES).T)
    raw = processor.image_processor(images=images, return_tensors="pt", do_rescale=False, do_normalize=False)
    want = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    got, _, computed = parts.pixels(images, grid, dtype=torch.uint8)
    assert computed and got.dtype == torch.uint8 and torch.equal(got, raw["pixel_values"].to(torch.uint8))
    norm = pixel_normalization(processor.image_processor)
    normalised = normalize_pixels(got, norm)
    assert normalised.dtype == torch.float32 and (normalised - want).abs().max() <= 1e-6
    assert torch.equal(normalised, want)  # in fact bit for bit
    assert torch.equal(normalize_pixels(got, norm, torch.bfloat16), want.to(torch.bfloat16))
    # the same from the decoded images, resized where they are (Pillow's fixed point in torch)
    decoded = [torch.from_numpy(np.asarray(image).copy()) for image in images]
    g = parts.grid
    on_device = resized_patches(
        decoded, grid, patch_size=g.patch_size, merge_size=g.merge_size,
        temporal_patch_size=g.temporal_patch_size,
    )  # fmt: skip
    assert on_device.dtype == torch.uint8 and torch.equal(normalize_pixels(on_device, norm), want)


def test_uint8_pixels_of_another_processor_come_from_the_processor_unnormalised(
    processor_dirs: dict[str, Path],
) -> None:
    processor = LOADERS["qwen2_5_vl"](processor_dirs["qwen2_5_vl"])
    images = [pil_image(1, (60, 80)), pil_image(2, (300, 57))]
    grid, _ = vlm_processor(processor).grid.grids(np.array([60, 300]), np.array([80, 57]))
    want = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    processor.image_processor.resample = 2  # bilinear: not the plain processor, the processor runs
    got, _, computed = vlm_processor(processor).pixels(images, grid, dtype=torch.uint8)
    expected = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    assert not computed and got.dtype == torch.uint8
    assert torch.equal(normalize_pixels(got, pixel_normalization(processor.image_processor)), expected)
    assert not torch.equal(expected, want)  # it did run the other resize

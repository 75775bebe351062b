"""The bit-exact pixel path: ``pixel_values`` of RGB images equal ``Qwen2VLImageProcessorPil``'s own output
(float32, and bfloat16 as ``Tensor.to`` rounds it) for images resized up and down under both fixture
configs, and any other processor (or image) falls back to the processor itself."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from _conversation_samples import jpeg_bytes, pil_image
from _host_reads import host_reads
from _vlm_reference import LOADERS
from puzzletron.dataset.conversation.images import decode_rgb
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.tokenize import GridConfig, vlm_processor
from puzzletron.dataset.tokenize._pixels import (
    _rgb_view,
    _rgbx_view,
    decoded_pixels,
    fast_pixels,
    normalize_pixels,
    normalized_pixels,
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


@pytest.mark.parametrize("patch_size", [15, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_pixels_equal_the_image_processor_for_an_odd_or_even_patch(
    patch_size: int, dtype: torch.dtype, processor_dirs: dict[str, Path]
) -> None:
    # an odd patch has an odd count of values a row, so its values are gathered one at a time
    processor = LOADERS["qwen2_5_vl"](processor_dirs["qwen2_5_vl"])
    image_processor = processor.image_processor
    image_processor.patch_size = patch_size
    images = [pil_image(i, size) for i, size in enumerate(SIZES)]
    config = dataclasses.replace(vlm_processor(processor).grid, patch_size=patch_size)
    grid, _ = config.grids(*np.array(SIZES).T)
    raw = {"do_rescale": False, "do_normalize": False} if dtype == torch.uint8 else {}
    want = image_processor(images=images, return_tensors="pt", **raw)
    assert torch.equal(want["image_grid_thw"], torch.as_tensor(grid))
    got = fast_pixels(
        image_processor, images, grid, patch_size=patch_size, merge_size=2, temporal_patch_size=2, dtype=dtype
    )
    assert got is not None and got.dtype == dtype and torch.equal(got, want["pixel_values"].to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_pixels_equal_the_image_processor_for_an_image_too_large_to_read_in_place(
    dtype: torch.dtype, processor_dirs: dict[str, Path]
) -> None:
    # 2100x2100 RGB spans several of Pillow's memory blocks: resized from an RGBA copy instead
    processor = LOADERS["qwen2_5_vl"](processor_dirs["qwen2_5_vl"])
    images = [pil_image(3, (2100, 2100)), pil_image(4, (90, 90))]
    assert _rgbx_view(images[0]) is None and _rgbx_view(images[1]) is not None
    grid, _ = vlm_processor(processor).grid.grids(np.array([2100, 90]), np.array([2100, 90]))
    raw = {"do_rescale": False, "do_normalize": False} if dtype == torch.uint8 else {}
    want = processor.image_processor(images=images, return_tensors="pt", **raw)["pixel_values"]
    options = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "dtype": dtype}
    got = fast_pixels(processor.image_processor, images, grid, **options)
    assert got is not None and torch.equal(got, want.to(dtype))


@pytest.mark.parametrize("size", [(1, 1), (3, 5), (1148, 812), (2100, 2100)])
def test_the_rgb_view_is_the_image_as_numpy_reads_it(size: tuple[int, int]) -> None:
    # 2100x2100 RGB spans several of Pillow's memory blocks: Arrow refuses it, numpy's copy stands in
    image = pil_image(5, size)
    view = _rgb_view(image)
    assert view.shape == (size[1], size[0], 3) and view.dtype == np.uint8
    assert np.array_equal(view, np.asarray(image))
    # read in place (4 bytes a pixel: RGBX) where Pillow holds the image in one block of memory
    assert view.strides[1] == (3 if size == (2100, 2100) else 4)


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


def _entries_and_metadata(processor: Any, images: list[Any]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    parts = vlm_processor(processor)
    sizes = np.array([image.size for image in images])
    grid, _ = parts.grid.grids(sizes[:, 0], sizes[:, 1])
    entries = parts.decoded(images, grid)
    norm = pixel_normalization(processor.image_processor)
    return entries, {"pixel_normalization": norm, "pixel_resize": parts.grid.facts()}


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_decoded_images_travel_at_their_size_or_their_target_and_normalise_to_the_processor_output(
    kind: str, processor_dirs: dict[str, Path]
) -> None:
    processor = LOADERS[kind](processor_dirs[kind])
    g = vlm_processor(processor).grid
    images = [pil_image(i, size) for i, size in enumerate([*SIZES, (1500, 1100), (2000, 90)])]
    entries, metadata = _entries_and_metadata(processor, images)
    want = processor.image_processor(images=images, return_tensors="pt")
    patches = want["image_grid_thw"].prod(dim=1)
    kept = [tuple(e.shape) == (i.size[1], i.size[0], 3) for e, i in zip(entries, images, strict=True)]
    assert any(kept) and not all(kept)  # small images as they are, large ones at their target
    for entry, image, grid, kept_whole, n in zip(
        entries, images, want["image_grid_thw"].tolist(), kept, patches, strict=True
    ):
        assert entry.dtype == torch.uint8 and entry.shape[2] == 3
        assert entry.nbytes <= int(n) * 3 * g.temporal_patch_size * g.patch_size**2  # <= its uint8 patches
        if not kept_whole:
            assert tuple(entry.shape[:2]) == (grid[1] * g.patch_size, grid[2] * g.patch_size)
        else:
            assert torch.equal(entry, torch.from_numpy(np.asarray(image).copy()))
    inputs = normalized_pixels({"pixel_values": entries}, metadata)
    assert torch.equal(inputs["pixel_values"], want["pixel_values"])
    as_bf16 = normalized_pixels({"pixel_values": entries}, metadata, torch.bfloat16)["pixel_values"]
    assert torch.equal(as_bf16, want["pixel_values"].to(torch.bfloat16))


def test_a_decoded_image_too_large_to_read_in_place_travels_as_a_writable_copy() -> None:
    # 2100x2072 is its own target under a 12.8M-pixel budget, so it travels whole; over 16 MiB as RGBX
    config = GridConfig(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=12845056
    )
    image = pil_image(6, (2100, 2072))
    grid, _ = config.grids(np.array([2100]), np.array([2072]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns of a tensor over a read-only array (Pillow's bytes)
        (entry,) = decoded_pixels([image], grid, config)
    assert torch.equal(entry, torch.from_numpy(np.asarray(image).copy())) and entry.is_contiguous()


def test_a_drafted_image_travels_so_that_its_size_gives_its_grid(processor_dirs: dict[str, Path]) -> None:
    processor = LOADERS["qwen2_5_vl"](processor_dirs["qwen2_5_vl"])
    parts = vlm_processor(processor)
    g = parts.grid
    for shown in [(1200, 1000), (3000, 2000), (900, 2400)]:
        grid, _ = g.grids(np.array([shown[0]]), np.array([shown[1]]))
        target = (int(grid[0, 2]) * g.patch_size, int(grid[0, 1]) * g.patch_size)
        drafted = decode_rgb(jpeg_bytes(3, shown), draft=target)
        assert drafted.size != shown  # the decoder's DCT scaling took it below its shown size
        (entry,) = parts.decoded([drafted], grid)
        height, width = int(entry.shape[0]), int(entry.shape[1])
        assert np.array_equal(g.grids(np.array([width]), np.array([height]))[0], grid)
        assert entry.nbytes <= int(grid.prod()) * 3 * g.temporal_patch_size * g.patch_size**2
        norm = {"pixel_normalization": pixel_normalization(processor.image_processor),
                "pixel_resize": g.facts()}  # fmt: skip
        want = processor.image_processor(images=[drafted], return_tensors="pt")["pixel_values"]
        assert torch.equal(normalized_pixels({"pixel_values": [entry]}, norm)["pixel_values"], want)


def test_resizing_and_normalising_decoded_images_reads_no_tensor_value(
    processor_dirs: dict[str, Path],
) -> None:
    processor = LOADERS["qwen3_vl"](processor_dirs["qwen3_vl"])
    entries, metadata = _entries_and_metadata(processor, [pil_image(i, s) for i, s in enumerate(SIZES)])
    kwargs = {"pixel_values": entries, "input_ids": torch.zeros(1, 4, dtype=torch.long)}
    assert host_reads(lambda: normalized_pixels(kwargs, metadata)) == []
    empty = normalized_pixels({**kwargs, "pixel_values": []}, metadata)["pixel_values"]
    assert empty.shape == (0, 3 * 2 * 16**2) and empty.dtype == torch.float32


def test_device_resize_refuses_a_processor_whose_resize_it_cannot_reproduce(
    processor_dirs: dict[str, Path],
) -> None:
    processor = LOADERS["qwen2_5_vl"](processor_dirs["qwen2_5_vl"])
    processor.image_processor.resample = 2  # bilinear
    with pytest.raises(ConfigError, match=r"device_resize needs a Qwen2VLImageProcessorPil"):
        vlm_processor(processor).decoded([pil_image(1, (60, 80))], np.array([[1, 6, 4]]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an accelerator")
def test_on_cuda_decoded_images_are_resized_and_normalised_without_a_host_sync(
    processor_dirs: dict[str, Path],
) -> None:
    processor = LOADERS["qwen2_5_vl"](processor_dirs["qwen2_5_vl"])
    images = [pil_image(i, s) for i, s in enumerate(SIZES)]
    entries, metadata = _entries_and_metadata(processor, images)
    on_device = [e.to("cuda") for e in entries]
    kwargs = {"pixel_values": on_device, "input_ids": torch.zeros(1, 4, dtype=torch.long, device="cuda")}
    normalized_pixels(kwargs, metadata)  # warm: the caching allocators
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = normalized_pixels(kwargs, metadata)["pixel_values"]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    assert torch.equal(got.cpu(), want)


def test_an_image_whose_target_does_not_give_its_grid_back_travels_at_its_own_size() -> None:
    config = GridConfig(16, 2, 2, 32 * 32, 256 * 256)  # a small budget: 3130x34 keeps a side of 32
    image = pil_image(5, (3130, 34))
    grid, _ = config.grids(np.array([3130]), np.array([34]))
    assert not config.is_own_target(grid).any()
    (entry,) = decoded_pixels([image], grid, config)
    assert tuple(entry.shape) == (34, 3130, 3)  # as it is: its own size gives its grid
    small = image.resize((1500, 16))  # a size whose grid is another, and the target cannot stand in
    with pytest.raises(ValueError, match=r"decoded image 0 is 1500x16, which gives grid"):
        decoded_pixels([small], grid, config)

"""`resize_rgbx` (the compiled host resize) is Pillow's bicubic resize bit for bit: every size pair drawn
(up, down, one axis, tall and wide, more rows than one strip of the horizontal pass, the pass order Pillow
13 switches on), on random and on saturated images (the clamp at 0 and 255), read in place from Pillow."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from puzzletron.dataset.tokenize._host_resize import resize_rgbx
from puzzletron.dataset.tokenize._pixels import _rgbx_view


def _pil(image: Image.Image, width: int, height: int) -> np.ndarray:
    return np.asarray(image.resize((width, height), resample=3, reducing_gap=None))


def _image(rows: int, cols: int, seed: int, *, saturated: bool = False) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (rows, cols, 3), dtype=np.uint8)
    if saturated:  # hard edges: the kernel's negative lobes overshoot and the clamp decides
        pixels = np.where(pixels > 127, 255, 0).astype(np.uint8)
    return Image.fromarray(pixels)


sizes = st.integers(min_value=1, max_value=160)


@settings(max_examples=150, deadline=None)
@given(
    rows=sizes, cols=sizes, height=sizes, width=sizes, seed=st.integers(0, 2**32 - 1), saturated=st.booleans()
)
def test_the_host_resize_is_pillows_bicubic_bit_for_bit(
    rows: int, cols: int, height: int, width: int, seed: int, saturated: bool
) -> None:
    image = _image(rows, cols, seed, saturated=saturated)
    got = resize_rgbx(_rgbx_view(image), width, height)
    assert got.dtype == np.uint8 and got.shape == (height, width, 4)
    assert np.array_equal(got[..., :3], _pil(image, width, height))


@pytest.mark.parametrize(
    ("rows", "cols", "height", "width"),
    [
        (300, 120, 40, 150),  # vertical first under Pillow 13
        (233, 266, 6, 212),
        (1500, 60, 28, 56),
        (37, 1000, 37, 333),  # the width alone, a short last strip of rows
        (1000, 37, 333, 37),  # the height alone
        (64, 64, 448, 812),  # a small image up to the processor's minimum
        (1148, 812, 1148, 812),  # neither side changes
    ],
)
def test_the_host_resize_matches_pillow_in_both_pass_orders_and_on_one_axis(
    rows: int, cols: int, height: int, width: int
) -> None:
    image = _image(rows, cols, rows * cols)
    assert np.array_equal(resize_rgbx(_rgbx_view(image), width, height)[..., :3], _pil(image, width, height))


def test_an_unchanged_size_is_the_image_itself_and_the_input_is_left_as_it_was() -> None:
    image = _image(50, 70, 1)
    pixels = _rgbx_view(image)
    before = pixels.copy()
    assert resize_rgbx(pixels, 70, 50) is pixels
    resize_rgbx(pixels, 33, 91)
    assert np.array_equal(pixels, before) and not pixels.flags.writeable  # read in place, never written

"""`resize_rgb` is Pillow's bicubic resize bit for bit: every size pair drawn (up, down, one axis, tall and
wide, the pass order Pillow 13 switches on), on random and on saturated images (the clamp at 0 and 255)."""

from __future__ import annotations

import numpy as np
import PIL
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from puzzletron.dataset.tokenize._resize import axis_taps, resize_rgb


def _pil(image: np.ndarray, width: int, height: int) -> np.ndarray:
    return np.asarray(Image.fromarray(image).resize((width, height), resample=3, reducing_gap=None))


sizes = st.integers(min_value=1, max_value=160)


@settings(max_examples=120, deadline=None)
@given(
    rows=sizes, cols=sizes, height=sizes, width=sizes, seed=st.integers(0, 2**32 - 1), saturated=st.booleans()
)
def test_resize_is_pillows_bicubic_bit_for_bit(
    rows: int, cols: int, height: int, width: int, seed: int, saturated: bool
) -> None:
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (rows, cols, 3), dtype=np.uint8)
    if saturated:  # hard edges: the kernel's negative lobes overshoot and the clamp decides
        image = np.where(image > 127, 255, 0).astype(np.uint8)
    got = resize_rgb(torch.from_numpy(image), width, height)
    assert got.dtype == torch.uint8 and got.shape == (height, width, 3)
    assert np.array_equal(got.numpy(), _pil(image, width, height))


@pytest.mark.parametrize(
    ("rows", "cols", "height", "width"),
    [(300, 120, 40, 150), (233, 266, 6, 212), (100, 100, 50, 150), (100, 100, 150, 50), (1500, 60, 28, 56)],
)
def test_the_pass_order_follows_the_installed_pillow(rows: int, cols: int, height: int, width: int) -> None:
    image = np.random.default_rng(rows * cols).integers(0, 256, (rows, cols, 3), dtype=np.uint8)
    assert np.array_equal(
        resize_rgb(torch.from_numpy(image), width, height).numpy(), _pil(image, width, height)
    )
    vertical_first = rows - height > 0 and rows - height > 2 * (cols - width)
    if vertical_first and int(PIL.__version__.split(".")[0]) >= 13:  # the order matters for these
        horizontal = resize_rgb(resize_rgb(torch.from_numpy(image), width, rows), width, height)
        assert not np.array_equal(horizontal.numpy(), _pil(image, width, height))


def test_taps_are_fixed_point_weights_summing_to_one_within_rounding() -> None:
    for n_in, n_out in [(10, 3), (3, 10), (1500, 1120), (7, 7)]:
        first, weights = axis_taps(n_in, n_out)
        assert weights.dtype == np.int32 and (first >= 0).all() and (first < n_in).all()
        assert (np.abs(weights.astype(np.int64).sum(axis=1) - (1 << 22)) <= weights.shape[1]).all()

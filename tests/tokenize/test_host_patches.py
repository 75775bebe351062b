"""`patchify_rgbx` writes an image's patches in the processor's order (merged patches row by row, a plane a
channel, the frame repeated ``T`` times), each value through its channel's table, as numpy's reshape and
transpose of ``patchify`` and a fancy-index lookup give them, for every dtype the pixel path emits, and
the values themselves without a table (uint8)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzletron.dataset.tokenize._host_patches import patchify_rgbx

_IDENTITY = np.tile(np.arange(256, dtype=np.uint8), (3, 1))


def _reference(image: np.ndarray, table: np.ndarray, p: int, m: int, t: int) -> np.ndarray:
    """The processor's patchify of ``table[c, image[..., c]]``: ``[patches, 3, t, p * p]``."""
    h, w = image.shape[:2]
    values = np.stack([table[c][image[..., c]] for c in range(3)], axis=-1)  # [h, w, 3]
    blocks = values.reshape(h // (m * p), m, p, w // (m * p), m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    patches = blocks.reshape(-1, 3, 1, p * p)
    return np.repeat(patches, t, axis=2)


@settings(max_examples=60, deadline=None)
@given(
    bands=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    geometry=st.sampled_from([(14, 2, 2), (16, 2, 2), (15, 2, 2), (14, 1, 1), (4, 3, 3)]),
    dtype=st.sampled_from([np.uint8, np.int16, np.float32]),
    seed=st.integers(0, 2**32 - 1),
)
def test_patches_are_the_processors_order_through_the_table(
    bands: tuple[int, int], geometry: tuple[int, int, int], dtype: type, seed: int
) -> None:
    p, m, t = geometry
    rng = np.random.default_rng(seed)
    h, w = bands[0] * m * p, bands[1] * m * p
    image = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    table = rng.integers(-30000, 30000, (3, 256)).astype(dtype)  # distinct per channel: a mix-up shows
    out = np.full((h * w // p**2, 3, t, p * p), 7, dtype=dtype)
    patchify_rgbx(image, table, patch_size=p, merge_size=m, out=out)
    assert np.array_equal(out, _reference(image, table, p, m, t))
    if dtype == np.uint8:  # no table: the values themselves
        patchify_rgbx(image, None, patch_size=p, merge_size=m, out=out)
        assert np.array_equal(out, _reference(image, _IDENTITY, p, m, t))


@pytest.mark.parametrize("readonly", [True, False])
def test_patches_of_an_image_read_in_place_leave_it_unchanged(readonly: bool) -> None:
    image = np.random.default_rng(3).integers(0, 256, (56, 84, 4), dtype=np.uint8)
    before = image.copy()
    image.flags.writeable = not readonly
    out = np.zeros((56 * 84 // 196, 3, 2, 196), dtype=np.uint8)
    patchify_rgbx(image, None, patch_size=14, merge_size=2, out=out)
    assert np.array_equal(image, before) and np.array_equal(out, _reference(before, _IDENTITY, 14, 2, 2))

"""`GridConfig`, the image grid from an image's size: transformers' own ``smart_resize`` over thousands of
sizes, and a target size giving its grid back (what the decoded-image transport relies on) but past
``max_pixels``."""

from __future__ import annotations

import numpy as np
import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from puzzletron.dataset.tokenize.grid import GridConfig

CONFIGS = {
    "qwen2_5 hub": GridConfig(14, 2, 2, 56 * 56, 28 * 28 * 16384),
    "qwen3 hub": GridConfig(16, 2, 2, 65536, 16777216),
    "fixture": GridConfig(14, 2, 2, 56 * 56, 448 * 448),
    "small patch 16": GridConfig(16, 2, 2, 32 * 32, 256 * 256),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_grids_equal_smart_resize_over_thousands_of_sizes(name: str) -> None:
    config = CONFIGS[name]
    rng = np.random.default_rng(1)
    sides = [1, 2, 3, 13, 27, 28, 29, 55, 56, 57, 200, 201, 4000]
    edges = np.array([(w, h) for w in sides for h in sides])
    sizes = np.concatenate([rng.integers(1, 5000, (3000, 2)), edges, [[1500, 8], [2, 300], [300, 2]]])
    grid, refused = config.grids(sizes[:, 0], sizes[:, 1])
    factor = config.patch_size * config.merge_size
    for (w, h), g, r in zip(sizes.tolist(), grid.tolist(), refused.tolist(), strict=True):
        try:
            h_bar, w_bar = smart_resize(h, w, factor, config.min_pixels, config.max_pixels)
        except ValueError:
            assert r, (w, h)
            continue
        assert not r and g == [1, h_bar // config.patch_size, w_bar // config.patch_size], (w, h)
    assert refused.sum() > 0


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_grid_of_an_images_target_size_is_its_grid_but_past_max_pixels(name: str) -> None:
    # what lets the device find a decoded image's target from its shape whether it travels at its own size
    # or was resized to its target in the worker (tokenize._pixels.decoded_pixels)
    config = CONFIGS[name]
    sizes = np.concatenate([np.random.default_rng(2).integers(1, 5000, (5000, 2)), [[3130, 34], [28, 2839]]])
    grid, refused = config.grids(sizes[:, 0], sizes[:, 1])
    grid = grid[~refused]
    again, refused_again = config.grids(grid[:, 2] * config.patch_size, grid[:, 1] * config.patch_size)
    same = (again == grid).all(axis=1)
    assert not refused_again.any() and np.array_equal(config.is_own_target(grid), same)
    over = grid[:, 1] * grid[:, 2] * config.patch_size**2 > config.max_pixels
    assert np.array_equal(~same, over)  # only where smart_resize kept a side past max_pixels
    assert over.any() == (name == "small patch 16")

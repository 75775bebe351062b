"""`plan_vlm`, hand-checked: exact lengths packed under ``packing_ratio``, no pack over ``pack_size`` and none
empty, ``truncate`` cutting only text after the last image (else dropping, counted), ``split`` refused, and
one sample a row for the unpacked layouts; `row_sums` adds a per-sample quantity over each row."""

from __future__ import annotations

import numpy as np
import pytest

from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.packing import plan_vlm, row_sums


def _spec(pack_size: int = 10, **packing) -> PuzzletronDataSpec:
    return PuzzletronDataSpec.from_mapping(
        {"modality": "multimodal", "layout": "packed_varlen", "max_sample_length": pack_size,
         "packing": {"pack_size": pack_size, **packing}}
    )  # fmt: skip


def test_packs_are_exact_full_and_never_over_or_empty() -> None:
    lengths = np.array([6, 4, 5, 5, 3, 7, 10], dtype=np.uint32)
    plan = plan_vlm(lengths, np.zeros(7, np.uint32), _spec(), seed=0)
    rows = sorted(tuple(sorted(lengths[list(r)].tolist())) for r in plan.rows)
    assert rows == [(3, 7), (4, 6), (5, 5), (10,)] and plan.dropped == () and plan.efficiency == 1.0


def test_packing_ratio_caps_each_pack_but_a_longer_sample_gets_its_own() -> None:
    lengths = np.array([4, 4, 4, 9, 3], dtype=np.uint32)
    plan = plan_vlm(lengths, np.zeros(5, np.uint32), _spec(packing_ratio=0.8), seed=0)
    assert plan.capacity == 8
    assert sorted(sorted(lengths[list(r)].tolist()) for r in plan.rows) == [[3, 4], [4, 4], [9]]


def test_truncate_keeps_every_image_or_drops_the_sample() -> None:
    lengths = np.array([14, 14, 6], dtype=np.uint32)
    media_end = np.array([9, 11, 3], dtype=np.uint32)  # sample 1's last image ends past the pack
    plan = plan_vlm(lengths, media_end, _spec(long_samples="truncate"), seed=0)
    assert plan.dropped == (1,) and plan.dropped_tokens == 14
    assert (plan.cut_samples, plan.cut_tokens) == (1, 4)
    assert plan.units.length.tolist() == [10, 14, 6] and plan.total_tokens == 16
    assert row_sums(plan, np.array([5, 7, 1])).sum() == 6  # images of the kept samples, whole


def test_split_is_refused() -> None:
    with pytest.raises(ConfigError, match="long_samples='split' is not supported for multimodal"):
        plan_vlm(np.array([30]), np.array([0]), _spec(long_samples="split"))


@pytest.mark.parametrize("layout", ["padded_varlen", "fixed"])
def test_unpacked_layouts_plan_one_sample_a_row_in_order(layout: str) -> None:
    spec = PuzzletronDataSpec.from_mapping(
        {"modality": "multimodal", "layout": layout, "max_sample_length": 8}
    )
    lengths, media_end = np.array([5, 12, 12, 8]), np.array([2, 6, 9, 8])
    plan = plan_vlm(lengths, media_end, spec)
    assert plan.rows == ((0,), (1,), (3,)) and plan.dropped == (2,)
    assert plan.units.length.tolist() == [5, 8, 12, 8] and (plan.cut_samples, plan.cut_tokens) == (1, 4)

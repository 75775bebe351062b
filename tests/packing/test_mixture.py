"""A mixture's epoch order (`packing.mixture`): exact token shares at every prefix, budgets, bad weights."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.packing.mixture import MixtureWeights, mixture_epoch


def _delivered(epoch, tokens: list[np.ndarray]) -> np.ndarray:
    """``[n, K]`` each component's real tokens after each row of the epoch."""
    flat = np.concatenate(tokens).astype(np.int64)
    comp = epoch.components(epoch.order)
    per = np.zeros((epoch.order.shape[0], len(tokens)), dtype=np.int64)
    per[np.arange(epoch.order.shape[0]), comp] = flat[epoch.order]
    return per.cumsum(axis=0)


def test_golden_two_components_interleave_by_their_tokens() -> None:
    """The docstring's example: shares 0.5 / 0.5, rows of 4 (a) and 2 (b) tokens: b a b b a b b a b."""
    weights = MixtureWeights.parse(["a", "b"], {"a": 1, "b": 1})
    tokens = [np.array([4, 4, 4]), np.array([2, 2, 2, 2, 2, 2])]
    epoch = mixture_epoch(tokens, weights, seed=0, epoch=0, shuffle=False)
    names = ["ab"[c] for c in epoch.components(epoch.order)]
    assert "".join(names) == "babbabbab"
    assert epoch.num_tokens == 24  # both passes used up at once


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 60), min_size=1, max_size=5),
    raw_weights=st.lists(st.integers(1, 9), min_size=5, max_size=5),
    pack=st.integers(4, 64),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_every_prefix_holds_each_share_within_two_rows(sizes, raw_weights, pack, seed, data) -> None:
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(max(1, pack // 2), pack + 1, size=n) for n in sizes]
    names = [f"c{i}" for i in range(len(sizes))]
    weights = MixtureWeights.parse(names, dict(zip(names, raw_weights, strict=False)))
    num_tokens = data.draw(st.none() | st.integers(1, 40 * pack))
    epoch = mixture_epoch(tokens, weights, seed=seed, epoch=1, num_tokens=num_tokens)
    cum = _delivered(epoch, tokens)
    total = cum.sum(axis=1, keepdims=True)
    share = np.asarray(weights.shares[0])
    assert np.abs(cum - total * share).max(initial=0) <= 2 * pack
    if num_tokens is not None:  # within one row of the budget
        assert abs(int(total[-1, 0]) - num_tokens) <= pack


def test_without_num_tokens_the_first_component_to_run_out_is_used_once_and_the_others_subsampled() -> None:
    rng = np.random.default_rng(3)
    tokens = [rng.integers(90, 101, size=n) for n in (200, 50, 400)]
    weights = MixtureWeights.parse(["a", "b", "c"], {"a": 0.3, "b": 0.2, "c": 0.5})
    epoch = mixture_epoch(tokens, weights, seed=7, epoch=0)
    comp = epoch.components(epoch.order)
    local = epoch.order - epoch.offsets[comp]
    # b (50 rows at 20 %) limits the epoch: every one of its rows, once
    assert sorted(local[comp == 1].tolist()) == list(range(50))
    for c, n in ((0, 200), (2, 400)):
        used = local[comp == c]
        assert np.unique(used).shape[0] == used.shape[0] < n  # a seeded sub-sample, no row twice
    assert epoch.num_tokens == math.floor(tokens[1].sum() / 0.2)


def test_num_tokens_repeats_a_component_in_reshuffled_passes() -> None:
    tokens = [np.full(10, 8), np.full(10, 8)]
    weights = MixtureWeights.parse(["a", "b"], {"a": 3, "b": 1})
    epoch = mixture_epoch(tokens, weights, seed=1, epoch=0, num_tokens=8 * 80)
    comp = epoch.components(epoch.order)
    a = (epoch.order - epoch.offsets[comp])[comp == 0]
    assert a.shape[0] == 60  # 6 passes of a's 10 rows
    passes = a.reshape(6, 10)
    assert all(sorted(p.tolist()) == list(range(10)) for p in passes)
    assert len({tuple(p.tolist()) for p in passes}) > 1  # each pass reshuffled


def test_order_is_a_function_of_rows_weights_seed_and_epoch_only() -> None:
    rng = np.random.default_rng(0)
    tokens = [rng.integers(1, 50, size=30), rng.integers(1, 50, size=40)]
    weights = MixtureWeights.parse(["a", "b"], {"a": 1, "b": 2})
    one = mixture_epoch(tokens, weights, seed=5, epoch=2)
    assert np.array_equal(one.order, mixture_epoch(tokens, weights, seed=5, epoch=2).order)
    assert not np.array_equal(one.order, mixture_epoch(tokens, weights, seed=5, epoch=3).order)
    assert not np.array_equal(one.order, mixture_epoch(tokens, weights, seed=6, epoch=2).order)


def test_a_schedule_holds_each_regime_share_within_two_rows() -> None:
    rng = np.random.default_rng(1)
    pack = 32
    tokens = [rng.integers(16, pack + 1, size=400), rng.integers(16, pack + 1, size=400)]
    schedule = [(0, {"a": 0.8, "b": 0.2}), (3000, {"a": 0.2, "b": 0.8}), (6000, {"a": 0.5, "b": 0.5})]
    weights = MixtureWeights.parse(["a", "b"], schedule)
    epoch = mixture_epoch(tokens, weights, seed=0, epoch=0, num_tokens=9000)
    cum = _delivered(epoch, tokens)
    total = cum.sum(axis=1)
    for start, stop, share in ((0, 3000, 0.8), (3000, 6000, 0.2), (6000, 9000, 0.5)):
        inside = (total > start) & (total <= stop)
        first = int(np.flatnonzero(inside)[0])
        base = cum[first - 1] if first else np.zeros(2, dtype=np.int64)
        since = cum[inside] - base
        assert np.abs(since[:, 0] - since.sum(axis=1) * share).max() <= 2 * pack


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"a": 1, "z": 1}, "unknown component 'z'"),
        ({"a": 1}, "no weight for component(s) ['b']"),
        ({"a": -1, "b": 1}, "must be >= 0"),
        ({"a": float("nan"), "b": 1}, "finite number"),
        ({"a": 0, "b": 0}, "every weight is 0"),
        ({"a": True, "b": 1}, "finite number"),
        ([(0, {"a": 1, "b": 1}), (0, {"a": 1, "b": 2})], "must increase"),
        ([(5, {"a": 1, "b": 1})], "start at from_token 0"),
        ([(0, {"a": 1, "b": 1}), (-3, {"a": 1, "b": 2})], "integer >= 0"),
        ("a", "weights must be"),
    ],
)
def test_bad_weights_are_one_clear_error(weights, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        MixtureWeights.parse(["a", "b"], weights)


def test_a_weighted_component_without_rows_is_refused() -> None:
    weights = MixtureWeights.parse(["a", "b"], {"a": 1, "b": 1})
    with pytest.raises(ConfigError, match="'b' has a positive weight but no usable row"):
        mixture_epoch([np.array([3, 4]), np.array([], dtype=np.int64)], weights, seed=0, epoch=0)

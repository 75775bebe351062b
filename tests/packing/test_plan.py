"""The packing planner, pure over lengths: every sample placed once or counted as dropped, exactly
best-fit decreasing, deterministic and independent of how the lengths were chunked, a seeded row order, within
one row of the lower bound per 10k chat-like lengths, estimated lengths planned to the packing ratio, the
long-sample policies (drop, raise, truncate, split), and errors naming the sample or the seed."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
from puzzletron.dataset.packing import PackingError, PackingPlan, plan_packing


def _chat_lengths(n: int, *, seed: int, pack_size: int = 4096) -> np.ndarray:
    raw = np.random.default_rng(seed).lognormal(np.log(600), 1.0, size=n)
    return np.clip(np.rint(raw), 1, pack_size).astype(np.int64)


def _reference_bfd(lengths: list[int], capacity: int) -> list[tuple[int, ...]]:
    """Textbook best-fit decreasing, O(n * rows): ties go to the row that reached its capacity first."""
    order = sorted(range(len(lengths)), key=lambda i: (-min(lengths[i], capacity), i))
    rows: list[list[int]] = []
    remaining: list[int] = []
    touched: list[int] = []
    for step, i in enumerate(order):
        need = min(lengths[i], capacity)
        fits = [r for r in range(len(rows)) if remaining[r] >= need]
        if fits:
            best = min(fits, key=lambda r: (remaining[r], touched[r]))
            rows[best].append(i)
            remaining[best] -= need
            touched[best] = step
        else:
            rows.append([i])
            remaining.append(capacity - need)
            touched.append(step)
    return sorted(tuple(sorted(r)) for r in rows)


lengths_st = st.lists(st.integers(min_value=1, max_value=80), max_size=120)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, pack_size=st.integers(min_value=1, max_value=64), seed=st.integers(0, 2**31))
def test_every_sample_is_placed_once_or_counted_as_dropped_and_no_row_overflows(lengths, pack_size, seed):
    plan = plan_packing(lengths, PackingSpec(pack_size=pack_size), seed=seed)
    placed = plan.sample_order.tolist()
    assert len(placed) == len(set(placed))
    assert sorted(placed + list(plan.dropped)) == list(range(len(lengths)))
    assert all(lengths[i] > pack_size for i in plan.dropped)
    assert plan.dropped_tokens == sum(lengths[i] for i in plan.dropped)
    for row, row_len in zip(plan.rows, plan.row_lengths.tolist(), strict=True):
        assert row and list(row) == sorted(row)
        assert row_len == sum(lengths[i] for i in row) <= pack_size
    assert plan.num_rows >= plan.lower_bound_rows
    assert plan.total_tokens == sum(lengths[i] for i in placed)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, pack_size=st.integers(min_value=1, max_value=64))
def test_plan_is_exactly_best_fit_decreasing(lengths, pack_size):
    kept = [i for i, n in enumerate(lengths) if n <= pack_size]
    plan = plan_packing(lengths, PackingSpec(pack_size=pack_size))
    expected = _reference_bfd([lengths[i] for i in kept], pack_size)
    assert sorted(plan.rows) == sorted(tuple(kept[j] for j in row) for row in expected)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, seed=st.integers(0, 2**31), cuts=st.lists(st.integers(0, 120), max_size=6))
def test_plan_is_deterministic_and_independent_of_how_lengths_were_chunked(lengths, seed, cuts):
    spec = PackingSpec(pack_size=96)
    whole = plan_packing(lengths, spec, seed=seed)
    chunks = np.split(np.asarray(lengths, dtype=np.int64), sorted(c for c in cuts if c <= len(lengths)))
    rechunked = plan_packing(np.concatenate(chunks), spec, seed=seed)
    from_generator = plan_packing((int(n) for n in lengths), spec, seed=seed)
    for other in (rechunked, from_generator, plan_packing(list(lengths), spec, seed=seed)):
        assert other.rows == whole.rows
        assert other.summary() == whole.summary()


def test_seed_orders_rows_but_not_their_contents():
    lengths = _chat_lengths(2000, seed=3)
    a = plan_packing(lengths, PackingSpec(pack_size=4096), seed=1)
    b = plan_packing(lengths, PackingSpec(pack_size=4096), seed=2)
    assert a.rows != b.rows
    assert sorted(a.rows) == sorted(b.rows)


@pytest.mark.parametrize("seed", range(5))
def test_chat_lengths_pack_at_995_percent_within_one_row_of_the_bound_per_10k(seed):
    plan = plan_packing(_chat_lengths(10_000, seed=seed), PackingSpec(pack_size=4096))
    assert plan.efficiency >= 0.995
    assert plan.num_rows - plan.lower_bound_rows <= 1


def test_a_million_chat_lengths_stay_within_one_row_of_the_bound_per_10k():
    # Behaviour only; the < 2 s planning time is measured in benchmarks/bench_packing.py.
    plan = plan_packing(_chat_lengths(1_000_000, seed=0), PackingSpec(pack_size=4096))
    assert plan.efficiency >= 0.995
    assert plan.num_rows - plan.lower_bound_rows <= 100  # one row per 10k samples


def test_long_samples_are_dropped_and_counted():
    plan = plan_packing([3, 9, 4, 12, 5], PackingSpec(pack_size=8))
    assert plan.dropped == (1, 3) and plan.dropped_tokens == 21
    assert sorted(plan.rows) == [(0, 4), (2,)]
    assert plan.total_tokens == 12 and plan.lower_bound_rows == 2 and plan.slots == 16
    assert plan.efficiency == pytest.approx(12 / 16)


def test_long_sample_raises_naming_it_when_drop_is_off():
    spec = PackingSpec(pack_size=8, drop_long_samples=False)
    expected = r"sample 1 \('doc-b'\) has 9 tokens > pack_size 8.*drop_long_samples"
    with pytest.raises(PackingError, match=expected):
        plan_packing([3, 9, 4], spec, sample_ids=["doc-a", "doc-b", "doc-c"])


@pytest.mark.parametrize("bad", [[3, 0, 2], [3, -1]])
def test_empty_or_negative_lengths_are_errors_naming_the_sample(bad):
    with pytest.raises(PackingError, match=r"sample 1 has length"):
        plan_packing(bad, PackingSpec(pack_size=8))


def test_estimated_lengths_are_planned_to_the_packing_ratio_capacity():
    spec = PackingSpec(pack_size=100, packing_ratio=0.8)
    lengths = [50, 30, 20, 85, 10]
    exact = plan_packing(lengths, spec)
    estimated = plan_packing(lengths, spec, estimated=True)
    assert exact.capacity == 100 and estimated.capacity == 80
    assert max(exact.row_lengths) == 100
    # 85 > 80 but <= pack_size: a row of its own; every other row is filled to at most 80.
    assert (3,) in estimated.rows
    assert all(n <= 80 for row, n in zip(estimated.rows, estimated.row_lengths, strict=True) if row != (3,))


def test_packing_ratio_golden_exact_lengths_fill_to_pack_size_estimated_to_the_ratio():
    spec = PackingSpec(pack_size=100, packing_ratio=0.8)
    lengths = [50, 30, 20, 85, 10]
    # Exact (text): BFD to 100: 85 | 50 | 30 joins 50 (20 left) | 20 joins it (0) | 10 joins 85 (5 left).
    assert sorted(plan_packing(lengths, spec).rows) == [(0, 1, 2), (3, 4)]
    # Estimated (VLM): BFD to 80: 85 alone | 50 | 30 joins 50 (0 left) | 20 | 10 joins 20.
    assert sorted(plan_packing(lengths, spec, estimated=True).rows) == [(0, 1), (2, 4), (3,)]


def test_estimated_lengths_over_pack_size_are_still_dropped_or_raise():
    lengths = [120, 50, 90]
    plan = plan_packing(lengths, PackingSpec(pack_size=100, packing_ratio=0.5), estimated=True)
    assert plan.dropped == (0,) and plan.dropped_tokens == 120 and sorted(plan.rows) == [(1,), (2,)]
    strict = PackingSpec(pack_size=100, packing_ratio=0.5, drop_long_samples=False)
    with pytest.raises(PackingError, match=r"sample 0 \('big'\) has 120 tokens > pack_size 100"):
        plan_packing(lengths, strict, estimated=True, sample_ids=["big", "mid", "high"])


def test_empty_input_gives_an_empty_plan():
    plan = plan_packing([], PackingSpec(pack_size=8))
    assert isinstance(plan, PackingPlan)
    assert plan.num_rows == 0 and plan.efficiency == 1.0 and plan.rows == ()


def test_plan_arrays_are_read_only():
    plan = plan_packing([1, 2, 3], PackingSpec(pack_size=4))
    with pytest.raises(ValueError):
        plan.sample_order[0] = 5
    assert math.isclose(plan.summary()["efficiency"], 6 / 8)


@pytest.mark.parametrize("seed", [-1, 2.0, False])
def test_a_bad_seed_is_an_error_naming_it(seed):
    with pytest.raises(PackingError, match=r"seed must be an int >= 0"):
        plan_packing([3, 4], PackingSpec(pack_size=8), seed=seed)


def test_packing_errors_belong_to_the_library_error_hierarchy() -> None:
    from puzzletron.dataset.errors import PuzzletronDataError

    with pytest.raises(PuzzletronDataError, match="sample 1 has 20 tokens > pack_size 10"):
        plan_packing([5, 20], PackingSpec(pack_size=10, drop_long_samples=False))


# -- long-sample policies ---------------------------------------------------------------------------


def test_policy_follows_drop_long_samples_unless_named_and_a_contradiction_is_an_error() -> None:
    assert PackingSpec(8).long_samples == "drop"
    assert PackingSpec(8, drop_long_samples=False).long_samples == "raise"
    assert PackingSpec(8, long_samples="split").long_samples == "split"
    assert (
        PuzzletronDataSpec.from_mapping(
            {
                "modality": "text",
                "layout": "packed_varlen",
                "max_sample_length": 8,
                "packing": {"pack_size": 8, "long_samples": "truncate"},
            }
        ).packing.long_samples
        == "truncate"
    )
    with pytest.raises(
        ValueError, match="long_samples must be one of drop, raise, truncate, split; got 'cut'"
    ):
        PackingSpec(8, long_samples="cut")
    with pytest.raises(
        ValueError, match=r"long_samples=.drop. contradicts data\.packing\.drop_long_samples=False"
    ):
        PackingSpec(8, drop_long_samples=False, long_samples="drop")


def _packing(block: dict[str, Any]) -> PackingSpec:
    spec = PuzzletronDataSpec.from_mapping(
        {"modality": "text", "layout": "packed_varlen", "max_sample_length": 8, "packing": block}
    )
    assert spec.packing is not None
    return spec.packing


@pytest.mark.parametrize("policy", ["raise", "truncate", "split"])
def test_a_named_policy_wins_over_the_default_drop_long_samples(policy: str) -> None:
    """The README's ``packing: {long_samples: raise}``: the user set one key, so nothing contradicts."""
    assert _packing({"pack_size": 8, "long_samples": policy}).long_samples == policy
    assert PackingSpec(8, long_samples=policy) == _packing({"pack_size": 8, "long_samples": policy})
    assert PackingSpec(8, long_samples=policy).drop_long_samples is False  # nothing is dropped


def test_both_keys_set_in_a_block_must_agree() -> None:
    assert _packing({"pack_size": 8, "drop_long_samples": False, "long_samples": "raise"}).long_samples == (
        "raise"
    )
    assert _packing({"pack_size": 8, "drop_long_samples": True, "long_samples": "drop"}).drop_long_samples
    with pytest.raises(ValueError, match=r"long_samples='raise' contradicts .*drop_long_samples=True"):
        _packing({"pack_size": 8, "drop_long_samples": True, "long_samples": "raise"})
    with pytest.raises(ValueError, match=r"long_samples='split' contradicts .*drop_long_samples=True"):
        _packing({"pack_size": 8, "drop_long_samples": "true", "long_samples": "split"})


def test_truncate_keeps_the_first_pack_size_tokens_and_counts_what_it_cut() -> None:
    plan = plan_packing([3, 10, 6], PackingSpec(4, long_samples="truncate"), seed=0)
    assert plan.dropped == () and plan.cut_samples == 2 and plan.cut_tokens == (10 - 4) + (6 - 4)
    assert plan.total_tokens == 3 + 4 + 4
    assert sorted(plan.units.length.tolist()) == [3, 4, 4]
    assert sorted(i for row in plan.rows for i in row) == [0, 1, 2]


def test_split_covers_every_token_of_a_long_sample_exactly_once() -> None:
    plan = plan_packing([3, 10, 6], PackingSpec(4, long_samples="split"), seed=1)
    units = plan.units
    assert plan.cut_samples == 2 and plan.cut_tokens == 0 and plan.total_tokens == 19
    spans = sorted(zip(units.sample.tolist(), units.start.tolist(), units.length.tolist(), strict=True))
    assert spans == [(0, 0, 3), (1, 0, 4), (1, 4, 4), (1, 8, 2), (2, 0, 4), (2, 4, 2)]
    assert sorted(i for row in plan.rows for i in row) == list(range(6))
    assert all(length <= 4 for length in plan.row_lengths.tolist())

"""`packing._plan_checks.plan_problems`: every plan the planner makes is sound against its lengths (every
policy, estimated or not), and any one damage a published plan could carry is named: an entry served twice
and another never, a row length that is not its entries' sum, a unit shifted or shortened, a dropped entry
placed, a sample's truncation other than its first pack_size tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzletron.dataset.config import PackingSpec
from puzzletron.dataset.packing import IndexSequence, Units, plan_packing
from puzzletron.dataset.packing._plan_checks import plan_problems

PACK = 32
lengths_st = st.lists(st.integers(1, 3 * PACK), min_size=1, max_size=300).map(
    lambda v: np.asarray(v, dtype=np.uint32)
)
policies = st.sampled_from(["drop", "truncate", "split"])


@settings(max_examples=80, deadline=None)
@given(lengths_st, policies, st.booleans(), st.integers(0, 2**31))
def test_every_plan_the_planner_makes_is_sound(lengths, policy: str, estimated: bool, seed: int) -> None:
    spec = PackingSpec(PACK, packing_ratio=0.8, long_samples=policy)
    plan = plan_packing(lengths, spec, estimated=estimated, seed=seed)
    assert plan_problems(plan, lengths) == []


def _units(plan, **arrays) -> object:
    return dataclasses.replace(plan, units=dataclasses.replace(plan.units, **arrays))


def _damaged(plan, kind: str, rng: np.random.Generator):
    """`plan` with one damage of `kind`, or None when this plan cannot carry it."""
    order, rows = np.array(plan.sample_order), np.array(plan.row_lengths)
    if kind == "twice" and order.size >= 2:
        i, j = rng.choice(order.size, 2, replace=False)
        order[i] = order[j]
        return dataclasses.replace(plan, sample_order=order)
    if kind == "dropped placed" and len(plan.dropped) and order.size:
        order[rng.integers(order.size)] = plan.dropped[0]
        return dataclasses.replace(plan, sample_order=order)
    if kind == "row length" and rows.size:
        rows[rng.integers(rows.size)] -= 1
        return dataclasses.replace(plan, row_lengths=rows)
    if kind == "unit start" and plan.units is not None:
        start = np.array(plan.units.start)
        start[rng.integers(start.size)] += 1
        return _units(plan, start=start)
    if kind == "unit length" and plan.units is not None and np.any(plan.units.length > 1):
        length = np.array(plan.units.length)
        length[rng.choice(np.flatnonzero(length > 1))] -= 1
        return _units(plan, length=length)
    if kind == "not dropped" and len(plan.dropped):
        return dataclasses.replace(plan, dropped=IndexSequence(np.asarray(plan.dropped.array()[1:])))
    return None


@settings(max_examples=120, deadline=None)
@given(
    lengths_st,
    policies,
    st.sampled_from(["twice", "dropped placed", "row length", "unit start", "unit length", "not dropped"]),
    st.integers(0, 2**31),
)
def test_any_one_damage_is_named(lengths, policy: str, kind: str, seed: int) -> None:
    plan = plan_packing(lengths, PackingSpec(PACK, long_samples=policy), seed=seed)
    damaged = _damaged(plan, kind, np.random.default_rng(seed))
    if damaged is not None:
        assert plan_problems(damaged, lengths) != []


def test_units_that_do_not_tile_a_sample_are_named() -> None:
    lengths = np.array([10, 70, 5], dtype=np.uint32)
    plan = plan_packing(lengths, PackingSpec(PACK, long_samples="split"))
    assert plan_problems(plan, lengths) == []
    u = plan.units
    shifted = Units(u.sample, u.start + np.array([0, 0, 1, 0, 0]), u.length, u.piece, u.split)
    assert plan_problems(dataclasses.replace(plan, units=shifted), lengths) == [
        "units [0, 5) do not start at piece * pack_size"
    ]
    short = Units(u.sample, u.start, u.length - np.array([0, 0, 0, 1, 0]), u.piece, u.split)
    assert plan_problems(dataclasses.replace(plan, units=short), lengths) == [
        "units [0, 5) do not tile their samples exactly"
    ]
    with pytest.raises(AssertionError):  # the same plan checked against other lengths
        assert plan_problems(plan, lengths + 1) == []

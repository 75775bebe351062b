"""Largest-remainder quotas and deficit redistribution: pure integer functions, exact fractions."""

from __future__ import annotations

from fractions import Fraction

import pytest

from puzzletron.dataset.acquisition import largest_remainder_quotas, redistribute_deficit


def test_golden_weights_10_30_total_7_give_2_5() -> None:
    assert largest_remainder_quotas({"a": 10, "b": 30}, 7) == {"a": 2, "b": 5}


def test_golden_three_equal_weights_total_2_give_1_1_0() -> None:
    assert largest_remainder_quotas({"a": 1, "b": 1, "c": 1}, 2) == {"a": 1, "b": 1, "c": 0}


def test_ties_go_to_the_earlier_key_whatever_the_names() -> None:
    assert largest_remainder_quotas({"z": 1, "a": 1, "m": 1}, 1) == {"z": 1, "a": 0, "m": 0}
    assert largest_remainder_quotas({"z": 1, "a": 1, "m": 1}, 5) == {"z": 2, "a": 2, "m": 1}


def test_exact_fractions_where_floats_would_misrank() -> None:
    # 0.1 + 0.2 style weights: remainders compared exactly, not as floats
    weights = {"a": 1, "b": 2, "c": 3_000_000_000_000_001}
    total = 3_000_000_000_000_004
    quotas = largest_remainder_quotas(weights, total)
    assert sum(quotas.values()) == total
    whole = sum(weights.values())
    for name, w in weights.items():
        assert abs(Fraction(total * w, whole) - quotas[name]) < 1


@pytest.mark.parametrize("total", [0, 1, 7, 100, 513])
def test_quotas_sum_to_total_and_stay_within_one_of_the_exact_share(total: int) -> None:
    weights = {"sparsetables": 5, "plotqa_cot": 3, "wiki_en": 2, "x": 7}
    quotas = largest_remainder_quotas(weights, total)
    assert list(quotas) == list(weights)
    assert sum(quotas.values()) == total
    for name, w in weights.items():
        exact = Fraction(total * w, sum(weights.values()))
        assert exact - 1 < quotas[name] <= exact + 1


def test_bad_weights_and_totals_are_errors() -> None:
    with pytest.raises(ValueError, match="positive"):
        largest_remainder_quotas({"a": 0}, 3)
    with pytest.raises(ValueError, match="non-negative"):
        largest_remainder_quotas({"a": 1}, -1)
    with pytest.raises(ValueError, match="at least one"):
        largest_remainder_quotas({}, 1)


def test_redistribution_weighs_by_max_weight_minus_taken_or_one() -> None:
    # b is far below its weight (30 - 2 = 28), c is past it (1 -> max(1 - 5, 1) = 1)
    extra = redistribute_deficit({"a": 10, "b": 30, "c": 1}, {"a": 3, "b": 2, "c": 5}, ["b", "c"], 5)
    assert extra == {"b": 5, "c": 0}
    assert redistribute_deficit({"a": 1, "b": 1}, {"a": 4, "b": 9}, ["a", "b"], 3) == {"a": 2, "b": 1}
    assert redistribute_deficit({"a": 1}, {"a": 0}, [], 3) == {}

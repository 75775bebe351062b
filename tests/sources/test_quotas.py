"""Largest-remainder quotas and deficit redistribution: pure integer functions, exact fractions; the
round-robin with an injected loader (no Hub)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from _conversation_samples import multi_row, nemotron_row, single_row
from puzzletron.dataset.errors import ConfigError, PuzzletronDataError, SubsetError
from puzzletron.dataset.sources import (
    RejectedRow,
    VlmAcquisitionSpec,
    largest_remainder_quotas,
    materialize_intersyn_subset,
    materialize_nemotron_vlm_dataset,
    redistribute_deficit,
)


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
    with pytest.raises(ValueError, match=r"total must be an int >= 0; got -1"):
        largest_remainder_quotas({"a": 1}, -1)
    with pytest.raises(ValueError, match="at least one"):
        largest_remainder_quotas({}, 1)


def test_redistribution_weighs_by_max_weight_minus_taken_or_one() -> None:
    # b is far below its weight (30 - 2 = 28), c is past it (1 -> max(1 - 5, 1) = 1)
    extra = redistribute_deficit({"a": 10, "b": 30, "c": 1}, {"a": 3, "b": 2, "c": 5}, ["b", "c"], 5)
    assert extra == {"b": 5, "c": 0}
    assert redistribute_deficit({"a": 1, "b": 1}, {"a": 4, "b": 9}, ["a", "b"], 3) == {"a": 2, "b": 1}
    assert redistribute_deficit({"a": 1}, {"a": 0}, [], 3) == {}


@pytest.mark.parametrize("total", [2.5, True, "3", None])
def test_a_total_that_is_not_an_integer_is_a_config_error(total) -> None:
    with pytest.raises(ConfigError, match=r"total must be an int >= 0; got "):
        largest_remainder_quotas({"a": 1, "b": 2}, total)


def _materialize_one(tmp_path, loader) -> dict:
    """One sample of the subset ``only`` from ``loader``, at a fixed revision."""
    return materialize_nemotron_vlm_dataset(
        VlmAcquisitionSpec(output_dir=tmp_path / "s", subsets=("only",), num_samples=1),
        sample_loader=loader,
        revision_resolver=lambda source, revision: "a" * 40,
    )


def test_a_loader_row_that_is_not_a_mapping_is_rejected_and_recorded(tmp_path) -> None:
    """An injected loader yielding junk: the row is recorded as rejected, the run goes on (no crash)."""

    def loader(subset: str, **_: object):
        yield ["not", "a", "row"]
        yield nemotron_row(1)

    manifest = _materialize_one(tmp_path, loader)
    assert manifest["diagnostics"]["rejected_rows"] == [
        {"subset": "only", "row_id": None, "reason": "expected a row mapping, got list"}
    ]
    assert manifest["diagnostics"]["materialized_rows"] == {"only": 1}


def test_snapshot_errors_belong_to_the_library_hierarchy(tmp_path) -> None:
    """A caller catching `PuzzletronDataError` (or `SubsetError`) sees a mismatching snapshot too."""

    def loader(subset: str, **_: object):
        yield nemotron_row(1)

    spec = VlmAcquisitionSpec(output_dir=tmp_path / "s", subsets=("only",), num_samples=1)
    materialize_nemotron_vlm_dataset(spec, sample_loader=loader, revision_resolver=lambda s, r: "a" * 40)
    other = VlmAcquisitionSpec(output_dir=tmp_path / "s", subsets=("only",), num_samples=1, seed=7)
    with pytest.raises(SubsetError, match="does not match requested acquisition"):
        materialize_nemotron_vlm_dataset(other, sample_loader=loader, revision_resolver=lambda s, r: "a" * 40)
    with pytest.raises(PuzzletronDataError, match="does not match requested acquisition"):
        materialize_intersyn_subset(tmp_path / "s", dataset_loader=loader)


def test_a_loader_may_yield_a_rejected_row_with_its_own_reason(tmp_path) -> None:
    """A `RejectedRow` in place of a row (what `hub_vlm_rows` yields for a missing image or a bad line) is
    recorded with exactly its id and reason; the next row fills the quota."""

    def loader(subset: str, **_: object):
        yield RejectedRow("only@12", "invalid JSON at byte 12: Expecting value")
        yield RejectedRow("r7", "image(s) ['7.png'] not found in any of the 3 tar shards")
        yield nemotron_row(1)

    manifest = _materialize_one(tmp_path, loader)
    assert manifest["diagnostics"]["rejected_rows"] == [
        {"subset": "only", "row_id": "only@12", "reason": "invalid JSON at byte 12: Expecting value"},
        {
            "subset": "only",
            "row_id": "r7",
            "reason": "image(s) ['7.png'] not found in any of the 3 tar shards",
        },
    ]
    assert manifest["sample_count"] == 1


def test_an_intersyn_loader_may_yield_rejected_rows_too(tmp_path) -> None:
    def loader(source: str, *, split: str, revision: str):
        yield RejectedRow(f"{split}-bad", "unreadable")
        yield single_row(0) if split == "train" else multi_row(0)

    manifest = materialize_intersyn_subset(tmp_path / "i", rows_per_source=1, dataset_loader=loader)
    assert [(r["dataset"], r["row_id"], r["reason"]) for r in manifest["diagnostics"]["rejected_rows"]] == [
        ("finyorko/single_turn", "train-bad", "unreadable"),
        ("finyorko/multi-turn", "multi-bad", "unreadable"),
    ]
    assert manifest["sample_count"] == 2

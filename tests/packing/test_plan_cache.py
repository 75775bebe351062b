"""`packing.plan_cache`: a plan is planned once per key, published atomically, memory-mapped by every later
caller (other processes too), equal to a fresh `plan_packing` for every long-sample policy, never served
when damaged, and pickled as a reference to its folder."""

from __future__ import annotations

import json
import multiprocessing
import pickle
from pathlib import Path

import numpy as np
import pytest

from _token_store_data import ROWS_PER_SHARD
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec, TokenizeOptions
from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.packing import IndexSequence, plan_packing
from puzzletron.dataset.packing import plan_cache as plan_cache_module
from puzzletron.dataset.packing.plan_cache import MappedPlan, cached_plan, load_plan, plan_key
from puzzletron.dataset.pipelines.text import build_batches
from puzzletron.dataset.tokenize import build_token_store

LENGTHS = np.random.default_rng(5).integers(1, 60, size=2_000).astype(np.uint32)
LENGTHS[[3, 17, 400]] = [150, 260, 99]  # longer than pack_size 64: dropped, truncated or split


def _same_plan(a, b) -> None:
    for name in ("sample_order", "row_offsets", "row_lengths"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert tuple(a.dropped) == tuple(b.dropped)
    assert a.summary() == b.summary()
    assert (a.units is None) == (b.units is None)
    if a.units is not None:
        for name in ("sample", "start", "length", "piece", "split"):
            assert np.array_equal(getattr(a.units, name), getattr(b.units, name)), name


@pytest.mark.parametrize("policy", ["drop", "truncate", "split"])
def test_a_cached_plan_equals_a_fresh_one_and_is_mapped_read_only(policy: str, tmp_path: Path) -> None:
    spec = PackingSpec(64, long_samples=policy)
    plan = cached_plan(LENGTHS, spec, lengths_identity="L", cache=tmp_path, seed=7)
    _same_plan(plan, plan_packing(LENGTHS, spec, seed=7))
    assert isinstance(plan, MappedPlan) and isinstance(plan.sample_order, np.memmap)
    assert not plan.sample_order.flags.writeable
    again = cached_plan(LENGTHS, spec, lengths_identity="L", cache=tmp_path, seed=7)
    _same_plan(again, plan)


def test_a_published_plan_is_mapped_without_planning_again(tmp_path: Path, monkeypatch) -> None:
    spec = PackingSpec(64)
    first = cached_plan(LENGTHS, spec, lengths_identity="L", cache=tmp_path, seed=1)

    def no_planning(*args, **kwargs):
        raise AssertionError("a published plan must be reused")

    monkeypatch.setattr(plan_cache_module, "plan_packing", no_planning)
    _same_plan(cached_plan(LENGTHS, spec, lengths_identity="L", cache=tmp_path, seed=1), first)
    with pytest.raises(AssertionError, match="must be reused"):  # another key is another plan
        cached_plan(LENGTHS, spec, lengths_identity="L", cache=tmp_path, seed=2)


def test_the_key_follows_every_input_of_the_plan() -> None:
    base = plan_key("L", PackingSpec(64), estimated=False, seed=0)
    others = [
        plan_key("M", PackingSpec(64), estimated=False, seed=0),
        plan_key("L", PackingSpec(65), estimated=False, seed=0),
        plan_key("L", PackingSpec(64, packing_ratio=0.9), estimated=False, seed=0),
        plan_key("L", PackingSpec(64, long_samples="split"), estimated=False, seed=0),
        plan_key("L", PackingSpec(64), estimated=True, seed=0),
        plan_key("L", PackingSpec(64), estimated=False, seed=1),
    ]
    assert len({base, *others}) == 7 and base == plan_key("L", PackingSpec(64), estimated=False, seed=0)


def _count_planning(args: tuple[str, str]) -> str:
    cache, marker = args
    real = plan_cache_module.plan_packing

    def counted(*a, **k):
        with open(marker, "a") as f:
            f.write("planned\n")
        return real(*a, **k)

    plan_cache_module.plan_packing = counted
    plan = cached_plan(LENGTHS, PackingSpec(64), lengths_identity="L", cache=cache, seed=3)
    return plan.folder.name


def test_concurrent_processes_plan_once_and_all_map_the_same_plan(tmp_path: Path) -> None:
    marker = tmp_path / "planned.txt"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        folders = pool.map(_count_planning, [(str(tmp_path / "cache"), str(marker))] * 8)
    assert len(set(folders)) == 1
    assert marker.read_text().splitlines() == ["planned"]


@pytest.mark.parametrize(
    "damage",
    ["truncated sample order", "total tokens edited", "other format", "missing array"],
)
def test_a_damaged_plan_is_refused_by_the_reader_and_planned_again_by_the_cache(
    damage: str, tmp_path: Path
) -> None:
    spec = PackingSpec(64)
    folder = cached_plan(LENGTHS, spec, lengths_identity="L", cache=tmp_path, seed=0).folder
    meta = json.loads((folder / "plan.json").read_text())
    if damage == "truncated sample order":
        np.save(folder / "sample_order.npy", np.load(folder / "sample_order.npy")[:-3])
    elif damage == "total tokens edited":
        (folder / "plan.json").write_text(json.dumps({**meta, "total_tokens": meta["total_tokens"] + 1}))
    elif damage == "other format":
        (folder / "plan.json").write_text(json.dumps({**meta, "version": 99}))
    else:
        (folder / "row_lengths.npy").unlink()
    with pytest.raises(SnapshotError, match=str(folder)):
        load_plan(folder)
    _same_plan(
        cached_plan(LENGTHS, spec, lengths_identity="L", cache=tmp_path, seed=0), plan_packing(LENGTHS, spec)
    )


def test_a_mapped_plan_pickles_as_its_folder(tmp_path: Path) -> None:
    plan = cached_plan(LENGTHS, PackingSpec(64, long_samples="split"), lengths_identity="L", cache=tmp_path)
    blob = pickle.dumps(plan)
    assert len(blob) < 1_000 < plan.sample_order.nbytes  # a reference, not a copy of the arrays
    _same_plan(pickle.loads(blob), plan)


def test_dropped_indices_are_one_array_that_compares_like_a_tuple() -> None:
    dropped = plan_packing(LENGTHS, PackingSpec(64)).dropped
    assert isinstance(dropped, IndexSequence)
    assert dropped == (3, 17, 400) and list(dropped) == [3, 17, 400] and len(dropped) == 3
    assert dropped[1] == 17 and dropped[1:] == (17, 400) and dropped != (3, 17)
    assert plan_packing(np.array([5, 6]), PackingSpec(64)).dropped == ()


@pytest.fixture(scope="module")
def store(snapshot: Path, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stores") / "store"
    options = TokenizeOptions(rows_per_shard=ROWS_PER_SHARD)
    return build_token_store(snapshot, tokenizer=tokenizer_dir, output=out, options=options)


def test_batches_from_a_store_use_the_plan_cache_and_stay_identical(store: Path, tmp_path: Path) -> None:
    spec = PuzzletronDataSpec.from_mapping(
        {"modality": "text", "layout": "packed_varlen", "max_sample_length": 64, "packing": {"pack_size": 64}}
    )
    cached = build_batches(store, spec=spec, batch_size=2, seed=4, plan_cache=tmp_path / "plans")
    assert isinstance(cached.plan, MappedPlan) and cached.plan.folder.parent == tmp_path / "plans"
    fresh = plan_packing(cached.tokenized.samples.lengths, spec.packing, seed=4)
    _same_plan(cached.plan, fresh)
    again = build_batches(store, spec=spec, batch_size=2, seed=4, plan_cache=tmp_path / "plans")
    assert [b.fingerprint for b in again] == [b.fingerprint for b in cached]
    beside = build_batches(store, spec=spec, batch_size=2, seed=4)  # default: beside the store
    assert beside.plan.folder.parent == store.with_name(f".{store.name}.plans")
    assert [b.fingerprint for b in beside] == [b.fingerprint for b in cached]


def test_an_unwritable_plan_cache_plans_in_memory(store: Path, tmp_path: Path, caplog) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    spec = PuzzletronDataSpec.from_mapping(
        {"modality": "text", "layout": "packed_varlen", "max_sample_length": 64, "packing": {"pack_size": 64}}
    )
    batches = build_batches(store, spec=spec, batch_size=2, plan_cache=blocked / "plans")
    assert not isinstance(batches.plan, MappedPlan) and "planning in memory" in caplog.text

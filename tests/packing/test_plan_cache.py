"""`packing.plan_cache`: a plan is planned once per key, published atomically, memory-mapped by every later
caller (other processes too), equal to a fresh `plan_packing` for every long-sample policy, never served
when damaged, and pickled as a reference to its folder."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import pickle
from pathlib import Path

import numpy as np
import pytest

from _token_store_data import ROWS_PER_SHARD
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec, TokenizeOptions
from puzzletron.dataset.errors import PackingError, SnapshotError
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
    pool = multiprocessing.get_context("fork").Pool(4)
    try:
        folders = pool.map(_count_planning, [(str(tmp_path / "cache"), str(marker))] * 8)
    finally:  # close + join: the workers exit when their queue ends, whatever handlers they inherited
        pool.close()
        pool.join()
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


def _edit_in_place(path: Path, index: int, delta: int) -> None:
    """Add `delta` to element `index` of the ``.npy`` array at `path`, in place (same size, same header)."""
    array = np.load(path, mmap_mode="r+")
    array[index] += delta
    array.flush()
    del array


@pytest.mark.parametrize(
    ("policy", "name", "index", "delta"),
    [
        ("drop", "sample_order", 5, 1),  # one sample served twice, another never
        ("drop", "row_lengths", 0, -1),
        ("split", "units_start", -1, 4),  # a piece's tokens shifted: overlapping and lost tokens
        ("split", "units_length", 0, 1),
        ("truncate", "units_length", 3, -1),
        ("drop", "dropped", 0, 1),
    ],
)
def test_a_plan_changed_in_place_is_refused_and_replanned_under_the_lock_not_served(
    policy: str, name: str, index: int, delta: int, tmp_path: Path
) -> None:
    spec = PackingSpec(64, long_samples=policy)
    folder = cached_plan(LENGTHS, spec, lengths_identity="L", cache=tmp_path, seed=0).folder
    _edit_in_place(folder / f"{name}.npy", index, delta)
    with pytest.raises(
        SnapshotError, match=rf"{folder}: {name}\.npy differs from the checksum plan.json records"
    ):
        load_plan(folder)
    again = cached_plan(LENGTHS, spec, lengths_identity="L", cache=tmp_path, seed=0)
    _same_plan(again, plan_packing(LENGTHS, spec))
    _same_plan(load_plan(folder), again)  # the damaged entry was replaced: every later run maps it


def test_a_worker_maps_a_replaced_file_only_after_checking_it(tmp_path: Path) -> None:
    plan = cached_plan(LENGTHS, PackingSpec(64), lengths_identity="L", cache=tmp_path)
    blob = pickle.dumps(plan)
    _same_plan(pickle.loads(blob), plan)  # the files this process verified: mapped as they are
    order = plan.folder / "sample_order.npy"
    damaged = np.load(order).copy()
    damaged[[0, 1]] = damaged[[1, 0]]  # the same entries, another order
    np.save(tmp_path / "new.npy", damaged)
    (tmp_path / "new.npy").replace(order)  # another file (inode) under the same name
    with pytest.raises(SnapshotError, match=r"sample_order\.npy differs from the checksum"):
        pickle.loads(blob)


def test_a_planner_that_breaks_the_invariants_publishes_nothing(tmp_path: Path, monkeypatch) -> None:
    spec = PackingSpec(64)
    good = plan_packing(LENGTHS, spec)
    order = np.array(good.sample_order)
    order[1] = order[0]  # a sample twice in its row
    monkeypatch.setattr(
        plan_cache_module, "plan_packing", lambda *a, **k: dataclasses.replace(good, sample_order=order)
    )
    with pytest.raises(PackingError, match=r"breaks its invariants: rows .* not in ascending entry order"):
        cached_plan(LENGTHS, spec, lengths_identity="L", cache=tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == []


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

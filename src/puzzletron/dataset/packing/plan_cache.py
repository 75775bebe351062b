"""A packing plan built once and memory-mapped by every rank and every restart.

Planning 75M sample lengths takes tens of seconds and ~2 GiB on each rank that does it, and its arrays
(``sample_order``, and the units of ``truncate``/``split``) are hundreds of MB to GB private to each rank.
`cached_plan` plans once per key, writes the plan's arrays as ``.npy`` files into a content-addressed folder
(published atomically, under a lock, so concurrent ranks of a node, or of a cluster on a shared file system,
plan once), and every caller maps them read-only: file-backed pages the ranks of a node share.

The key (`plan_key`) is everything the plan depends on: the identity of the lengths (a token store's
identity hash), the packing spec (``pack_size``, ``packing_ratio``, the long-sample policy), ``estimated``,
the seed and `PLANNER_VERSION`. A folder is ``<cache>/<first 16 hex digits of the key>/``::

    plan.json           {"format": "puzzletron-packing-plan", "version": 1, "key": ..., scalars}
    sample_order.npy    int64 [n_placed]        row_offsets.npy  int64 [rows + 1]
    row_lengths.npy     int64 [rows]            dropped.npy      int64 [n_dropped]
    units_<field>.npy   the cut samples' spans (truncate / split only)

A folder is checked before it is served (format, version, key, array shapes and their cross-field sums,
O(rows) work); one that fails is planned again, never served.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.config import PackingSpec
from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.packing._plan import IndexSequence, PackingPlan, plan_packing
from puzzletron.dataset.packing._units import Units
from puzzletron.dataset.storage.atomic import locked, staging_dir

__all__ = [
    "PLANNER_VERSION",
    "PLAN_FORMAT",
    "MappedPlan",
    "cached_plan",
    "load_plan",
    "plan_key",
    "save_plan",
]

PLAN_FORMAT = "puzzletron-packing-plan"
PLAN_VERSION = 1
PLANNER_VERSION = 1  # bump when plan_packing's output for the same inputs changes
_META = "plan.json"
_ARRAYS = ("sample_order", "row_offsets", "row_lengths", "dropped")
_UNIT_FIELDS = tuple(f.name for f in fields(Units))
_SCALARS = ("pack_size", "capacity", "num_samples", "total_tokens", "dropped_tokens", "seed", "policy")


@dataclass(frozen=True, eq=False)
class MappedPlan(PackingPlan):
    """A `PackingPlan` whose arrays are mapped from a plan folder; it pickles as that folder (a DataLoader
    worker started by spawn maps the same files instead of receiving a copy of every array)."""

    folder: Path = field(default=Path(), repr=False)
    key: str = field(default="", repr=False)

    def __reduce__(self) -> tuple[Any, ...]:
        return load_plan, (self.folder, self.key)


def plan_key(lengths_identity: str, spec: PackingSpec, *, estimated: bool, seed: int) -> str:
    """The hex SHA-256 naming a plan: what ``plan_packing`` depends on, and nothing else."""
    blob = {
        "format": PLAN_FORMAT,
        "planner": PLANNER_VERSION,
        "lengths": lengths_identity,
        "pack_size": int(spec.pack_size),
        "packing_ratio": float(spec.packing_ratio),
        "long_samples": spec.long_samples,
        "estimated": bool(estimated),
        "seed": int(seed),
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def save_plan(plan: PackingPlan, folder: Path, *, key: str) -> None:
    """Write `plan` into the empty folder `folder` (arrays first, ``plan.json`` last)."""
    for name in _ARRAYS:
        value = getattr(plan, name)
        array = value.array() if isinstance(value, IndexSequence) else np.asarray(value, dtype=np.int64)
        np.save(folder / f"{name}.npy", array.astype(np.int64, copy=False))
    if plan.units is not None:
        for name in _UNIT_FIELDS:
            np.save(folder / f"units_{name}.npy", getattr(plan.units, name))
    meta = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "key": key, "units": plan.units is not None}
    meta |= {name: getattr(plan, name) for name in (*_SCALARS, "cut_samples", "cut_tokens")}
    (folder / _META).write_text(json.dumps(meta, sort_keys=True) + "\n")


def _array(folder: Path, name: str) -> np.ndarray:
    try:
        return np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{folder}: {name}.npy is missing or unreadable ({exc})") from exc


def load_plan(folder: str | Path, key: str | None = None) -> MappedPlan:
    """The plan in `folder`, its arrays memory-mapped read-only; `SnapshotError` naming what is wrong
    (format, version, key, shapes and sums that disagree) before any array is served."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / _META).read_text())
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{folder}: {_META} is missing or unreadable ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != PLAN_FORMAT or meta.get("version") != PLAN_VERSION:
        raise SnapshotError(f"{folder}: not a {PLAN_FORMAT} version {PLAN_VERSION} ({_META})")
    if key is not None and meta.get("key") != key:
        raise SnapshotError(f"{folder}: holds the plan of key {meta.get('key')!r}, not {key!r}")
    arrays = {name: _array(folder, name) for name in _ARRAYS}
    units = None
    if meta.get("units"):
        units = Units(**{name: _array(folder, f"units_{name}") for name in _UNIT_FIELDS})
    _check(folder, meta, arrays, units)
    return MappedPlan(
        **{name: meta[name] for name in _SCALARS},
        sample_order=arrays["sample_order"],
        row_offsets=arrays["row_offsets"],
        row_lengths=arrays["row_lengths"],
        dropped=IndexSequence(arrays["dropped"]),
        units=units,
        cut_samples=meta["cut_samples"],
        cut_tokens=meta["cut_tokens"],
        folder=folder,
        key=str(meta["key"]),
    )


def _check(folder: Path, meta: dict[str, Any], arrays: dict[str, np.ndarray], units: Units | None) -> None:
    """Shapes and sums that must agree (O(rows) work: ``sample_order`` is only checked by its length)."""
    order, offsets, lengths = arrays["sample_order"], arrays["row_offsets"], arrays["row_lengths"]
    problems = []
    if any(a.ndim != 1 or a.dtype != np.int64 for a in arrays.values()):
        problems.append("every array must be 1-D int64")
    elif (
        offsets.shape[0] != lengths.shape[0] + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != order.shape[0]
    ):
        problems.append("row_offsets do not cut sample_order into row_lengths' rows")
    elif np.any(np.diff(offsets) <= 0) or int(lengths.sum()) != meta.get("total_tokens"):
        problems.append("a row is empty or the row lengths do not add up to total_tokens")
    elif np.any(lengths > meta.get("pack_size", 0)):
        problems.append("a row is longer than pack_size")
    if units is not None and len({getattr(units, f).shape[0] for f in _UNIT_FIELDS if f != "split"}) != 1:
        problems.append("the units' arrays differ in length")
    if problems:
        raise SnapshotError(f"{folder}: damaged packing plan: {'; '.join(problems)}")


def cached_plan(
    lengths: Any,
    spec: PackingSpec,
    *,
    lengths_identity: str,
    cache: str | Path,
    seed: int = 0,
    estimated: bool = False,
    sample_ids: Sequence[str] | None = None,
) -> PackingPlan:
    """`plan_packing` of `lengths`, planned once per key under `cache` and memory-mapped from there.

    ``lengths_identity`` must change whenever the lengths can (a token store's identity hash does). The
    first caller plans and publishes under a lock; later callers, on any rank sharing `cache`, map it.
    """
    key = plan_key(lengths_identity, spec, estimated=estimated, seed=seed)
    folder = Path(cache).absolute() / key[:16]
    plan = _published(folder, key)
    if plan is None:
        with locked(folder):
            if _published(folder, key) is None:
                shutil.rmtree(folder, ignore_errors=True)  # damaged (a cache: planning again is correct)
                planned = plan_packing(lengths, spec, estimated=estimated, seed=seed, sample_ids=sample_ids)
                with staging_dir(folder) as tmp:
                    save_plan(planned, tmp, key=key)
        plan = load_plan(folder, key)
    return plan


def _published(folder: Path, key: str) -> MappedPlan | None:
    """The complete, sound plan in `folder`, else None (nothing there, or a damaged plan)."""
    if not (folder / _META).is_file():
        return None
    try:
        return load_plan(folder, key)
    except SnapshotError:
        return None

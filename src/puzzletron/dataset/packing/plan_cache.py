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

Before a plan is published, its arrays as written are read back and checked against the lengths
(`_plan_checks.plan_problems`: a permutation of the planned entries, units tiling each sample, row lengths
the sums of their entries), and ``plan.json`` records each file's xxh3_128. Every caller that maps a folder
verifies those checksums on the file it maps (streamed reads, nothing of the file kept resident) plus the
O(rows) cross-field sums; one that fails is planned again under the lock, never served.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from puzzletron.dataset.config import PackingSpec
from puzzletron.dataset.errors import PackingError, SnapshotError
from puzzletron.dataset.packing._plan import IndexSequence, PackingPlan, plan_packing
from puzzletron.dataset.packing._plan_checks import plan_problems
from puzzletron.dataset.packing._units import Units
from puzzletron.dataset.storage.atomic import locked, staging_dir

_LOG = logging.getLogger(__name__)

__all__ = [
    "PLANNER_VERSION",
    "PLAN_FORMAT",
    "MappedPlan",
    "cached_plan",
    "load_plan",
    "plan_key",
    "save_plan",
    "store_plan",
]

PLAN_FORMAT = "puzzletron-packing-plan"
PLAN_VERSION = 2  # 2: plan.json records every file's xxh3_128 (version 1 folders are planned again)
_CHECKSUM = "xxh3_128"
_READ = 1 << 26  # bytes of a plan file hashed at a time
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
    pins: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)

    def __reduce__(self) -> tuple[Any, ...]:
        # A worker maps the files this process verified (the same device, inode, size and time: not hashed
        # again); any other file there is verified against plan.json's checksums first.
        return load_plan, (self.folder, self.key, self.pins)


def plan_key(
    lengths_identity: str, spec: PackingSpec, *, estimated: bool, seed: int, keep_at_least: bool = False
) -> str:
    """The hex SHA-256 naming a plan: what ``plan_packing`` depends on, and nothing else (``keep_at_least``:
    whether the plan had its shortest cuts, which ``lengths_identity`` then covers too)."""
    blob: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "planner": PLANNER_VERSION,
        "lengths": lengths_identity,
        "pack_size": int(spec.pack_size),
        "packing_ratio": float(spec.packing_ratio),
        "long_samples": spec.long_samples,
        "estimated": bool(estimated),
        "seed": int(seed),
    }
    if keep_at_least:  # only then: the keys of plans made before the option stay what they were
        blob["keep_at_least"] = True
    return hashlib.sha256(json.dumps(blob, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _files(units: bool) -> list[str]:
    return [*_ARRAYS, *(f"units_{name}" for name in _UNIT_FIELDS if units)]


def _digest(fh: Any) -> str:
    """The xxh3_128 of the open file `fh`, hashed from a read-only mapping of it in chunks of `_READ` bytes
    (no copy), each chunk's pages dropped from this process after it is hashed (they stay in the page cache):
    whatever the file's size, nothing of it stays resident here."""
    digest = xxhash.xxh3_128()
    size = os.fstat(fh.fileno()).st_size
    if size == 0:
        return digest.hexdigest()
    with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            for start in range(0, size, _READ):
                length = min(_READ, size - start)
                mapped.madvise(mmap.MADV_WILLNEED, start, length)
                digest.update(view[start : start + length])
                mapped.madvise(mmap.MADV_DONTNEED, start, length)
        finally:
            view.release()
    return digest.hexdigest()


def save_plan(plan: PackingPlan, folder: Path, *, key: str) -> None:
    """Write `plan` into the empty folder `folder`: the arrays, then ``plan.json`` with each file's
    checksum, read back from the file as written."""
    for name in _ARRAYS:
        value = getattr(plan, name)
        array = value.array() if isinstance(value, IndexSequence) else np.asarray(value, dtype=np.int64)
        np.save(folder / f"{name}.npy", array.astype(np.int64, copy=False))
    if plan.units is not None:
        for name in _UNIT_FIELDS:
            np.save(folder / f"units_{name}.npy", getattr(plan.units, name))
    sums = {}
    for name in _files(plan.units is not None):
        with open(folder / f"{name}.npy", "rb") as fh:
            sums[f"{name}.npy"] = _digest(fh)
    meta = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "key": key, "units": plan.units is not None}
    meta |= {name: getattr(plan, name) for name in (*_SCALARS, "cut_samples", "cut_tokens")}
    meta["checksums"] = {"algorithm": _CHECKSUM, "files": sums}
    (folder / _META).write_text(json.dumps(meta, sort_keys=True) + "\n")


def _map(folder: Path, name: str, digest: Any, pin: Any) -> tuple[np.ndarray, tuple[int, ...]]:
    """The array of ``<name>.npy`` mapped read-only from the very file whose bytes were checked against
    `digest` (one open file: a file renamed over it meanwhile is not what is mapped), and its pin (device,
    inode, size, modification time). A file with `pin` was verified by this plan's mapper: not hashed
    again."""
    path = folder / f"{name}.npy"
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if tuple(pin or ()) != stamp and _digest(fh) != digest:
                raise SnapshotError(
                    f"{folder}: {name}.npy differs from the checksum {_META} records (damaged)"
                )
            fh.seek(0)
            version = np.lib.format.read_magic(fh)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(fh)
            if dtype.hasobject or fortran:
                raise ValueError(f"dtype {dtype}, fortran order {fortran}")
            if int(np.prod(shape)) == 0:
                return np.zeros(shape, dtype), stamp
            return np.memmap(fh, dtype=dtype, mode="r", offset=fh.tell(), shape=shape), stamp
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{folder}: {name}.npy is missing or unreadable ({exc})") from exc


def load_plan(folder: str | Path, key: str | None = None, pins: dict[str, Any] | None = None) -> MappedPlan:
    """The plan in `folder`, its arrays memory-mapped read-only; `SnapshotError` naming what is wrong
    (format, version, key, a file that differs from its checksum, shapes and sums that disagree) before
    any array is served. ``pins``: files a mapper verified (`MappedPlan.__reduce__`)."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / _META).read_text())
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{folder}: {_META} is missing or unreadable ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != PLAN_FORMAT or meta.get("version") != PLAN_VERSION:
        raise SnapshotError(f"{folder}: not a {PLAN_FORMAT} version {PLAN_VERSION} ({_META})")
    if key is not None and meta.get("key") != key:
        raise SnapshotError(f"{folder}: holds the plan of key {meta.get('key')!r}, not {key!r}")
    checksums = meta.get("checksums")
    names = _files(bool(meta.get("units")))
    sums = checksums.get("files") if isinstance(checksums, dict) else None
    if (
        not isinstance(sums, dict)
        or checksums.get("algorithm") != _CHECKSUM
        or set(sums) != {f"{n}.npy" for n in names}
    ):
        raise SnapshotError(f"{folder}: {_META} does not record the {_CHECKSUM} of every file of the plan")
    mapped = {name: _map(folder, name, sums[f"{name}.npy"], (pins or {}).get(name)) for name in names}
    arrays = {name: mapped[name][0] for name in _ARRAYS}
    units = None
    if meta.get("units"):
        units = Units(**{name: mapped[f"units_{name}"][0] for name in _UNIT_FIELDS})
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
        pins={name: stamp for name, (_, stamp) in mapped.items()},
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
    keep_at_least: Any = None,
) -> PackingPlan:
    """`plan_packing` of `lengths`, planned once per key under `cache` and memory-mapped from there.

    ``lengths_identity`` must change whenever the lengths can (a token store's identity hash does), and
    whenever ``keep_at_least`` can when it is given (a VLM store's does). The first caller plans and
    publishes under a lock; later callers, on any rank sharing `cache`, map it.
    """
    key = plan_key(
        lengths_identity, spec, estimated=estimated, seed=seed, keep_at_least=keep_at_least is not None
    )
    folder = Path(cache).absolute() / key[:16]
    plan = _published(folder, key)
    if plan is None:
        with locked(folder):
            if _published(folder, key) is None:
                shutil.rmtree(folder, ignore_errors=True)  # damaged (a cache: planning again is correct)
                plan = plan_packing(
                    lengths,
                    spec,
                    estimated=estimated,
                    seed=seed,
                    sample_ids=sample_ids,
                    keep_at_least=keep_at_least,
                )
                with staging_dir(folder) as tmp:
                    save_plan(plan, tmp, key=key)
                    del plan  # the arrays as written are checked, not these: memory for one copy at a time
                    _check_written(tmp, key, lengths)
        plan = load_plan(folder, key)
    return plan


def _check_written(tmp: Path, key: str, lengths: Any) -> None:
    """The plan as written in `tmp` (mapped from the files whose checksums its plan.json records) against
    its invariants (`_plan_checks.plan_problems`) before it is published: a `PackingError` means the
    planner or the disk broke it, and nothing is published."""
    problems = plan_problems(load_plan(tmp, key), lengths)
    if problems:
        raise PackingError(f"{tmp}: the packing plan as written breaks its invariants: {'; '.join(problems)}")


def _published(folder: Path, key: str) -> MappedPlan | None:
    """The complete, sound plan in `folder`, else None (nothing there, or a damaged plan)."""
    if not (folder / _META).is_file():
        return None
    try:
        return load_plan(folder, key)
    except SnapshotError:
        return None


def store_plan(
    store: Any,
    spec: PackingSpec,
    *,
    seed: int,
    cache: str | Path | None,
    cache_dir: str | Path | None,
    files: Sequence[str],
    estimated: bool = False,
    keep_at_least: Any = None,
) -> PackingPlan:
    """The plan of a store's samples (a token or VLM store: ``lengths``, ``manifest``, ``path``) through the
    plan cache: in ``cache``, else (a store or cache directory at an URL) this node's object cache, else
    ``cache_dir/.plans``, else ``.<store name>.plans`` beside the store (hidden: a cache directory still
    lists only stores). Its lengths identity is the store's identity hash
    and the SHA-256s of the index ``files`` the plan reads; a cache that cannot be written plans in memory
    (every rank does the work) with a warning."""
    from puzzletron.dataset.packing.sources import StoreNames
    from puzzletron.dataset.storage.object_cache import ObjectCache
    from puzzletron.dataset.storage.objects import is_url

    if cache is None and (is_url(store.path) or is_url(cache_dir)):  # this node's object cache
        cache = ObjectCache.default().root / "plans"
    elif cache is None:
        beside = store.path.with_name(f".{store.path.name}.plans")
        cache = Path(cache_dir, ".plans") if cache_dir is not None else beside
    digests = {r["path"]: r["sha256"] for r in store.manifest["files"]}
    identity = ":".join([store.manifest["identity_sha256"], *(digests[f] for f in files)])
    options = {
        "seed": seed,
        "estimated": estimated,
        "sample_ids": StoreNames(store),
        "keep_at_least": keep_at_least,
    }
    try:
        return cached_plan(store.lengths, spec, lengths_identity=identity, cache=cache, **options)
    except OSError as exc:
        _LOG.warning("plan cache %s is not writable (%s); planning in memory", cache, exc)
        return plan_packing(store.lengths, spec, **options)

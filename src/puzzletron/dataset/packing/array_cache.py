"""Arrays computed once, published in a content-keyed folder, and memory-mapped by every rank after a check.

`cached_arrays` is the shared-state rule of ``docs/trust-model.md`` for derived arrays (a mixture's epoch
order; `puzzletron.dataset.packing.mixture_plan`): the folder is named by the key of everything the arrays
derive from, published atomically under a lock (concurrent ranks compute once), and it is data like a store:
its ``index.json`` names the format, version and key and records each array's dtype, shape and xxh3_64;
every caller checks them before an array is served. A folder that fails the check (edited, truncated,
another key) is computed again and replaced, never served and never refused forever::

    <cache>/<prefix>-<first 16 hex digits of the key>/
        index.json        {"format": "puzzletron-cached-arrays", "version": 1, "key": ..., "arrays": {
                           name: {"dtype": "<i8", "shape": [n], "xxh3_64": ...}}, "meta": {...}}
        <name>.npy        one per array
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.storage.atomic import locked, staging_dir

__all__ = ["ARRAYS_FORMAT", "cached_arrays", "load_arrays", "save_arrays"]

ARRAYS_FORMAT = "puzzletron-cached-arrays"
_VERSION = 1
_INDEX = "index.json"
_MAX_INDEX_BYTES = 1 << 20
_LOG = logging.getLogger(__name__)


def _digest(array: np.ndarray) -> str:
    return f"{xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(array)).cast('B')):016x}"


def save_arrays(folder: Path, key: str, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
    """Write ``arrays`` into the empty folder ``folder`` (arrays first, ``index.json`` last)."""
    entries = {}
    for name, value in arrays.items():
        array = np.ascontiguousarray(value)
        np.save(folder / f"{name}.npy", array, allow_pickle=False)
        entries[name] = {"dtype": array.dtype.str, "shape": list(array.shape), "xxh3_64": _digest(array)}
    index = {"format": ARRAYS_FORMAT, "version": _VERSION, "key": key, "arrays": entries, "meta": dict(meta)}
    (folder / _INDEX).write_text(json.dumps(index, sort_keys=True) + "\n")


def load_arrays(folder: Path, key: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays of ``folder`` mapped read-only, and its ``meta``, after every check of the module
    docstring; `SnapshotError` naming the file and what differs."""
    path = folder / _INDEX
    try:
        with path.open("rb") as f:
            raw = f.read(_MAX_INDEX_BYTES + 1)
        index = json.loads(raw) if len(raw) <= _MAX_INDEX_BYTES else None
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{path}: missing or unreadable ({exc})") from exc
    kind = (index.get("format"), index.get("version")) if isinstance(index, dict) else None
    if kind != (ARRAYS_FORMAT, _VERSION):
        raise SnapshotError(f"{path}: not a {ARRAYS_FORMAT} version {_VERSION} index")
    if index.get("key") != key:
        raise SnapshotError(f"{path}: holds the arrays of key {index.get('key')!r}, not {key!r}")
    entries, meta = index.get("arrays"), index.get("meta")
    if not isinstance(entries, dict) or not isinstance(meta, dict):
        raise SnapshotError(f"{path}: arrays and meta must be objects")
    arrays = {}
    for name, entry in entries.items():
        file = folder / f"{name}.npy"
        try:
            array = np.load(file, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise SnapshotError(f"{file}: missing or unreadable ({exc})") from exc
        if not isinstance(entry, dict) or [array.dtype.str, list(array.shape)] != [
            entry.get("dtype"),
            entry.get("shape"),
        ]:
            raise SnapshotError(f"{file}: dtype or shape differs from {path}")
        if _digest(array) != entry.get("xxh3_64"):
            raise SnapshotError(f"{file}: content differs from the xxh3_64 {path} records (damaged)")
        arrays[name] = array
    return arrays, meta


def cached_arrays(
    folder: Path,
    key: str,
    compute: Callable[[], tuple[Mapping[str, np.ndarray], Mapping[str, Any]]],
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays (and meta) ``compute`` returns, computed once for ``key`` and published in ``folder``;
    every caller maps the checked folder. A folder that cannot be written: computed here (warning)."""
    try:
        return load_arrays(folder, key)
    except SnapshotError as exc:
        if (folder / _INDEX).exists():
            _LOG.warning("%s; computing it again", exc)
    try:
        with locked(folder):
            try:
                return load_arrays(folder, key)
            except SnapshotError:
                shutil.rmtree(folder, ignore_errors=True)  # damaged or partial: a cache, computed again
            arrays, meta = compute()
            with staging_dir(folder) as tmp:
                save_arrays(tmp, key, arrays, meta)
    except OSError as exc:
        _LOG.warning("cache %s is not writable (%s); computing in memory", folder, exc)
        arrays, meta = compute()
        return {k: np.asarray(v) for k, v in arrays.items()}, dict(meta)
    return load_arrays(folder, key)

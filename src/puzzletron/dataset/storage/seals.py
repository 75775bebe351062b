"""A folder sealed when it is complete: ``seal.json``, written last, records every file's size and xxh3_128,
so a later run can tell a folder that is exactly what was written from one damaged since (a finished shard
of a killed build, kept for the rerun).

    write_seal(folder)               # after the last file is written, before the folder is kept
    problem = seal_problem(folder)   # None when every file is there, alone, with its size and digest

The digests are xxh3_128 (the block checksums' family, `formats.blocks`: ~10 GB/s a core), against damage:
a resumed build rereads each finished shard once. What a build publishes is still hashed with SHA-256 into
the manifest, the root of trust (``docs/trust-model.md``).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from puzzletron.dataset.storage.local import hash_file

__all__ = ["SEAL", "file_digest", "parse_seal", "read_seal", "seal_of", "seal_problem", "write_seal"]

SEAL = "seal.json"
_MAX_SEAL_BYTES = 1 << 20


def file_digest(path: Path) -> str:
    """The hex xxh3_128 of the file at `path`."""
    return hash_file(path, xxhash.xxh3_128())


def _files(folder: Path) -> dict[str, Path]:
    """Every entry under `folder` but the seal, by relative POSIX path (directories walked, links not)."""
    out = {}
    for base, dirs, names in os.walk(folder):
        for name in [*names, *(d for d in dirs if os.path.islink(os.path.join(base, d)))]:
            path = Path(base, name)
            rel = path.relative_to(folder).as_posix()
            if rel != SEAL:
                out[rel] = path
    return out


def seal_of(folder: Path) -> dict[str, dict[str, Any]]:
    """``{rel: {"bytes", "xxh3_128"}}`` of every regular file under `folder` (the seal itself aside)."""
    return {
        rel: {"bytes": path.stat().st_size, "xxh3_128": file_digest(path)}
        for rel, path in sorted(_files(folder).items())
    }


def write_seal(folder: Path) -> dict[str, dict[str, Any]]:
    """Seal `folder` as it is now; the seal written."""
    seal = seal_of(folder)
    with open(folder / SEAL, "w", encoding="utf-8") as fh:
        json.dump(seal, fh, sort_keys=True)
    return seal


def _valid(seal: Any) -> bool:
    return isinstance(seal, dict) and all(
        isinstance(rel, str)
        and isinstance(entry, Mapping)
        and type(entry.get("bytes")) is int
        and isinstance(entry.get("xxh3_128"), str)
        for rel, entry in seal.items()
    )


def parse_seal(data: bytes) -> dict[str, dict[str, Any]] | None:
    """The seal in `data` when it is one (a JSON object of ``{bytes, xxh3_128}`` records), else None."""
    try:
        seal = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return seal if _valid(seal) else None


def read_seal(folder: Path) -> dict[str, dict[str, Any]] | None:
    """The seal of `folder`, or None when there is none or it is not one (a regular file, at most 1 MiB)."""
    try:
        fd = os.open(folder / SEAL, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with open(fd, "rb", closefd=False) as fh:
            data = fh.read(_MAX_SEAL_BYTES + 1)
    finally:
        os.close(fd)
    return parse_seal(data) if len(data) <= _MAX_SEAL_BYTES else None


def seal_problem(folder: Path) -> str | None:
    """What is wrong with the sealed `folder` (no seal, a file missing, added, of another size or
    digest), or None when it is exactly what was sealed."""
    seal = read_seal(folder)
    if seal is None:
        return f"{folder}: no {SEAL} (not finished, or written by an older version)"
    files = _files(folder)
    if set(files) != set(seal):
        return f"{folder}: holds {sorted(files)[:8]}, sealed with {sorted(seal)[:8]}"
    for rel, entry in sorted(seal.items()):
        path = files[rel]
        if not path.is_file() or path.is_symlink():
            return f"{path}: not a regular file"
        if path.stat().st_size != entry["bytes"]:
            return f"{path}: {path.stat().st_size} bytes, sealed with {entry['bytes']}"
        if file_digest(path) != entry["xxh3_128"]:
            return f"{path}: its bytes changed since it was sealed"
    return None

"""The text snapshot: a `datasets` ``save_to_disk`` directory of a ``DatasetDict`` (one folder per split)
plus a ``manifest.json`` listing every file with its size and SHA-256. Write, check complete (reuse),
verify (every byte), describe.

The format, with an example manifest: ``docs/text-snapshot-format.md``. Manifests written before the
``format`` key existed (version 1 without ``format``) load, verify and reuse unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.manifest import (
    MANIFEST,
    VerifyReport,
    bytes_on_disk,
    check_file,
    human_size,
    inside,
    load_json,
    parse_json,
    sha256_file,
    verify_file,
)

__all__ = [
    "TEXT_SNAPSHOT_FORMAT",
    "TEXT_SNAPSHOT_KIND",
    "TEXT_SNAPSHOT_VERSION",
    "describe_text_snapshot",
    "is_unnamed_text_snapshot",
    "read_text_snapshot",
    "render_text_snapshot",
    "verify_text_snapshot",
    "write_text_snapshot",
]

TEXT_SNAPSHOT_FORMAT = "puzzletron-text-snapshot"
TEXT_SNAPSHOT_VERSION = 1
TEXT_SNAPSHOT_KIND = "text-snapshot"  # `describe_text_snapshot`'s "kind" (`inspect --json` printed it first)
_WITHIN = "the snapshot"
_SPLIT_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # `datasets` split names; each is a folder of the snapshot


def _fingerprint(acquisition: Mapping[str, Any], split: str) -> str:
    """The `datasets` fingerprint of a split (stored in its ``state.json``): derived from the acquisition,
    never random, so two runs of one request write identical bytes."""
    blob = json.dumps({"identity": acquisition, "split": split}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _file_records(root: Path) -> list[dict[str, Any]]:
    """``[{path, bytes, sha256}]`` of every file under `root` but the manifest, sorted by path (POSIX)."""
    records = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = path.relative_to(root).as_posix()
        records.append({"path": rel, "bytes": path.stat().st_size, "sha256": sha256_file(path)})
    return records


def write_text_snapshot(
    tmp: Path,
    tables: Mapping[str, Any],
    *,
    acquisition: Mapping[str, Any],
    diagnostics: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the Arrow `tables` (split name -> ``pyarrow.Table``) into the empty directory `tmp` with
    ``datasets.DatasetDict.save_to_disk``, then the manifest (written last); return the manifest.

    `acquisition` is what the caller asked for (JSON-ready); reuse compares it. `diagnostics` (JSON-ready,
    e.g. ``rejected_rows``) is recorded when given.
    """
    import datasets

    splits = {}
    for name, table in tables.items():
        try:
            splits[name] = datasets.Dataset(
                datasets.table.InMemoryTable(table), fingerprint=_fingerprint(acquisition, name)
            )
        except (ValueError, TypeError) as exc:  # columns `datasets` has no feature type for
            raise SnapshotError(f"split {name!r}: rows that datasets cannot store ({exc})") from exc
    quiet = not datasets.utils.are_progress_bars_disabled()
    if quiet:  # the library logs; progress bars are the CLI's business
        datasets.utils.disable_progress_bars()
    try:
        datasets.DatasetDict(splits).save_to_disk(str(tmp))
    finally:
        if quiet:
            datasets.utils.enable_progress_bars()
    manifest = {
        "format": TEXT_SNAPSHOT_FORMAT,
        "version": TEXT_SNAPSHOT_VERSION,
        "acquisition": acquisition,
        "splits": {name: len(ds) for name, ds in splits.items()},
        "files": _file_records(tmp),
    }
    if diagnostics:
        manifest["diagnostics"] = dict(diagnostics)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def is_unnamed_text_snapshot(manifest: Mapping[str, Any]) -> bool:
    """A manifest without ``format`` written by the text snapshot writer: ``splits`` and no ``images``."""
    return "format" not in manifest and isinstance(manifest.get("splits"), dict) and "images" not in manifest


def _load(root: Path) -> dict[str, Any]:
    """The text snapshot manifest at `root`, checked for its format, version and the types of its counts
    and file list (not for completeness): nothing else is read before it passes (docs/trust-model.md)."""
    manifest = load_json(root / MANIFEST, "the manifest")
    where = root / MANIFEST
    if not isinstance(manifest, dict):
        raise SnapshotError(f"{where}: expected a JSON object, got {type(manifest).__name__}")
    fmt = manifest.get("format", TEXT_SNAPSHOT_FORMAT)
    if fmt != TEXT_SNAPSHOT_FORMAT:
        raise SnapshotError(f"{where}: a {fmt!r} manifest, not a Puzzle-KD text snapshot")
    if not isinstance(manifest.get("splits"), dict):
        raise SnapshotError(f"{where}: not a Puzzle-KD snapshot manifest (no 'splits' mapping)")
    version = manifest.get("version")
    if type(version) is not int or version != TEXT_SNAPSHOT_VERSION:  # not True, 1.0 or "1"
        raise SnapshotError(
            f"{where}: format version {version!r} is not supported (this code reads {TEXT_SNAPSHOT_VERSION})"
        )
    for split, rows in manifest["splits"].items():
        if not _SPLIT_NAME.fullmatch(split) or split in (".", ".."):
            raise SnapshotError(f"{where}: split name {split!r} is not a plain folder name")
        if type(rows) is not int or rows < 0:
            raise SnapshotError(
                f"{where}: split {split!r} has {rows!r} rows; expected a non-negative integer"
            )
    files = manifest.get("files", [])
    if not isinstance(files, list) or not all(
        isinstance(r, dict) and isinstance(r.get("path"), str) for r in files
    ):
        raise SnapshotError(f"{where}: 'files' is {files!r}; expected a list of file records with a path")
    return manifest


def _split_files(root: Path, split: str) -> list[Path]:
    """The Arrow data files `datasets` listed in ``<split>/state.json``."""
    state = inside(root, f"{split}/state.json", str(root / MANIFEST), noun="split state file", within=_WITHIN)
    try:
        names = [f["filename"] for f in parse_json(state.read_bytes(), "it")["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"{state} is missing or unreadable ({exc})") from exc
    return [inside(root, f"{split}/{name}", str(state), noun="data file", within=_WITHIN) for name in names]


def _incompleteness(root: Path, manifest: Mapping[str, Any]) -> list[str]:
    """What is missing: every listed file with its size (manifests written before files were listed:
    every split's data files)."""
    problems = []
    if "files" in manifest:
        for record in manifest["files"]:
            try:
                check_file(root, record, within=_WITHIN)
            except SnapshotError as exc:
                problems.append(str(exc))
        return problems
    for split in manifest["splits"]:
        try:
            problems += [f"{f} is missing" for f in _split_files(root, split) if not f.is_file()]
        except SnapshotError as exc:
            problems.append(str(exc))
    return problems


def read_text_snapshot(path: str | Path) -> dict[str, Any]:
    """The manifest of the complete text snapshot at `path`; `SnapshotError` saying what is missing otherwise.

    Complete means: every file the manifest lists is there with its size (cheap: what reuse checks;
    `verify_text_snapshot` reads every byte).
    """
    root = Path(path)
    manifest = _load(root)
    problems = _incompleteness(root, manifest)
    if problems:
        raise SnapshotError(f"{root}: incomplete Puzzle-KD snapshot: {'; '.join(problems[:5])}")
    return manifest


def _arrow_rows(path: Path) -> int:
    """Rows in one `datasets` Arrow file (an Arrow IPC stream), reading and validating every record batch
    (its strings UTF-8)."""
    import pyarrow as pa

    rows = 0
    try:  # a Python file object: pyarrow cannot open a path that is not UTF-8
        with open(path, "rb") as source:
            for batch in pa.ipc.open_stream(source):
                try:
                    batch.validate(full=True)  # every string UTF-8: what is published always decodes
                except pa.ArrowInvalid as exc:
                    raise SnapshotError(f"{path}: the rows from {rows} on do not decode ({exc})") from exc
                rows += batch.num_rows
    except pa.ArrowException as exc:
        raise SnapshotError(f"{path}: not a readable Arrow stream ({exc})") from exc
    return rows


def _unlisted(root: Path, records: list[Any]) -> list[str]:
    """Every file, symlink or other entry under `root` that the manifest does not list (the manifest
    aside), and every symlink even where listed: a snapshot is written as regular files only."""
    listed = {r["path"] for r in records}  # `_load` checked every record has a string path
    problems = []
    for folder, dirs, files in os.walk(root):  # symlinked directories are listed, never followed
        for name in sorted(dirs + files):
            path = Path(folder, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                problems.append(f"{root}: {rel} is a symbolic link; a snapshot holds regular files only")
            elif name in files and rel != MANIFEST and rel not in listed:
                problems.append(f"{root}: unexpected file {rel} not in the manifest")
    return problems


def verify_text_snapshot(path: str | Path) -> VerifyReport:
    """Check a text snapshot against its manifest: every file's size and SHA-256, and every split's row
    count (read from its Arrow files).

    Reads every byte; reports every problem (not just the first). ``sample_count`` is the rows found
    over all splits, ``image_count`` is 0. Never raises for a damaged snapshot.
    """
    root = Path(path).absolute()
    try:
        manifest = _load(root)
    except SnapshotError as exc:
        return VerifyReport(str(root), 0, 0, (str(exc),), TEXT_SNAPSHOT_FORMAT)
    problems: list[str] = []
    if "files" not in manifest:
        problems.append(f"{root / MANIFEST}: lists no files (written by an older version); rematerialise")
    for record in manifest.get("files", ()):
        verify_file(root, record, problems, within=_WITHIN)
    if "files" in manifest:
        problems += _unlisted(root, manifest["files"])
    rows = 0
    for split, expected in manifest["splits"].items():
        try:
            found = sum(_arrow_rows(f) for f in _split_files(root, split))
        except (SnapshotError, OSError) as exc:
            problems.append(f"{root}: split {split!r} unreadable: {exc}")
            continue
        rows += found
        if found != expected:
            problems.append(f"{root}: split {split!r} has {found} rows, the manifest says {expected}")
    return VerifyReport(str(root), rows, 0, tuple(problems), TEXT_SNAPSHOT_FORMAT)


def describe_text_snapshot(path: str | Path) -> dict[str, Any]:
    """What a text snapshot's manifest says (splits and row counts, acquisition), and its size on disk."""
    root = Path(path).absolute()
    manifest = _load(root)
    splits = manifest["splits"]
    return {
        "path": str(root),
        "kind": TEXT_SNAPSHOT_KIND,
        "format": TEXT_SNAPSHOT_FORMAT,
        "format_version": manifest.get("version"),
        "splits": splits,
        "row_count": sum(n for n in splits.values() if isinstance(n, int)),
        "acquisition": manifest.get("acquisition"),
        "bytes_on_disk": bytes_on_disk(root),
    }


def render_text_snapshot(info: Mapping[str, Any]) -> list[str]:
    """`describe_text_snapshot`'s summary as lines of text."""
    lines = [f"text snapshot {info['path']} (format {info['format_version']})"]
    lines += [f"split        {split}: {rows} rows" for split, rows in info["splits"].items()]
    acquisition = info["acquisition"] if isinstance(info["acquisition"], dict) else {}
    if acquisition.get("source"):
        lines.append(f"source       {acquisition['source']} @ {acquisition.get('revision')}")
    lines.append(f"on disk      {human_size(info['bytes_on_disk'])} ({info['bytes_on_disk']} bytes)")
    return lines

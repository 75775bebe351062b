"""`puzzletron-data verify DIR` and `puzzletron-data inspect DIR [--json]`: check and describe a snapshot.

Two kinds of directory carry a `manifest.json`: an offline conversation subset (`subset.py`; its manifest
lists `images`) and a Puzzle-KD text snapshot (a `datasets.save_to_disk` directory written by
`acquisition.py`; its manifest is `{version, acquisition, splits, ...}`). Both commands dispatch on the
manifest. Verifying a text snapshot needs `acquisition.verify_text_snapshot`, imported lazily so that this
module does not pull in the acquisition code (and its `pyarrow` import) for conversation subsets.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import SubsetError
from puzzletron.dataset.subset import MANIFEST, describe_subset, verify_subset

__all__ = ["manifest_kind", "register"]

CONVERSATION = "conversation-subset"
TEXT = "text-snapshot"


def manifest_kind(path: str | Path) -> str | None:
    """The kind of snapshot at `path`, read from its `manifest.json`.

    `"text-snapshot"` for a Puzzle-KD manifest (`splits`, no `images`), else `"conversation-subset"`;
    `None` when there is no readable JSON object (the subset code then says what is wrong).
    """
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    return TEXT if isinstance(manifest.get("splits"), dict) and "images" not in manifest else CONVERSATION


def _verify(args: argparse.Namespace) -> int:
    if manifest_kind(args.dir) == TEXT:
        from puzzletron.dataset.acquisition import verify_text_snapshot

        report = verify_text_snapshot(args.dir)
        counts = f"{report.sample_count} rows"
    else:
        report = verify_subset(args.dir)
        counts = f"{report.sample_count} samples, {report.image_count} images"
    if report.ok:
        print(f"OK {report.path}: {counts}, all hashes match")
        return 0
    print(f"FAILED {report.path}: {len(report.problems)} problem(s)")
    for problem in report.problems:
        print(f"  - {problem}")
    return 1


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _bytes_on_disk(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())


def describe_text_snapshot(path: str | Path) -> dict[str, Any]:
    """What a Puzzle-KD text snapshot's manifest says (splits and row counts, acquisition), and its size."""
    root = Path(path).absolute()
    manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    splits = manifest["splits"]
    return {
        "path": str(root),
        "kind": TEXT,
        "format_version": manifest.get("version"),
        "splits": splits,
        "row_count": sum(n for n in splits.values() if isinstance(n, int)),
        "acquisition": manifest.get("acquisition"),
        "bytes_on_disk": _bytes_on_disk(root),
    }


def _print_text_snapshot(info: dict[str, Any]) -> None:
    print(f"text snapshot {info['path']} (format {info['format_version']})")
    for split, rows in info["splits"].items():
        print(f"split        {split}: {rows} rows")
    acquisition = info["acquisition"] if isinstance(info["acquisition"], dict) else {}
    if acquisition.get("source"):
        print(f"source       {acquisition['source']} @ {acquisition.get('revision')}")
    print(f"on disk      {_human(info['bytes_on_disk'])} ({info['bytes_on_disk']} bytes)")


def _print_subset(info: dict[str, Any]) -> None:
    print(f"subset       {info['path']} (format {info['format_version']})")
    print(f"samples      {info['sample_count']}")
    print(f"images       {info['image_count']} ({_human(info['image_bytes'])})")
    for source in info["sources"]:
        print(f"source       {source['dataset']} @ {source['revision']}")
    for fmt, count in info["image_formats"].items():
        print(f"format       {fmt}: {count}")
    if info["image_width"]:
        w, h = info["image_width"], info["image_height"]
        print(f"image size   width {w['min']}..{w['max']}, height {h['min']}..{h['max']}")
    print(f"on disk      {_human(info['bytes_on_disk'])} ({info['bytes_on_disk']} bytes)")


def _inspect(args: argparse.Namespace) -> int:
    text = manifest_kind(args.dir) == TEXT
    try:
        info = describe_text_snapshot(args.dir) if text else describe_subset(args.dir)
    except SubsetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    elif text:
        _print_text_snapshot(info)
    else:
        _print_subset(info)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `verify` and `inspect` to the `puzzletron-data` parser."""
    verify = sub.add_parser(
        "verify",
        help="check every count and SHA-256 of a subset or text snapshot (exit 1 on any mismatch)",
    )
    verify.add_argument("dir", help="conversation subset or Puzzle-KD text snapshot directory")
    verify.set_defaults(handler=_verify)
    inspect = sub.add_parser(
        "inspect", help="describe a subset (counts, sources, image formats and sizes) or a text snapshot"
    )
    inspect.add_argument("dir", help="conversation subset or Puzzle-KD text snapshot directory")
    inspect.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    inspect.set_defaults(handler=_inspect)

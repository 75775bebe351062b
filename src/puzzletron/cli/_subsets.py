"""`puzzletron-data verify DIR` and `puzzletron-data inspect DIR [--json]`: check and describe a subset."""

from __future__ import annotations

import argparse
import json
import sys

from puzzletron.dataset.errors import SubsetError
from puzzletron.dataset.subset import describe_subset, verify_subset

__all__ = ["register"]


def _verify(args: argparse.Namespace) -> int:
    report = verify_subset(args.dir)
    if report.ok:
        print(
            f"OK {report.path}: {report.sample_count} samples, {report.image_count} images, all hashes match"
        )
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


def _inspect(args: argparse.Namespace) -> int:
    try:
        info = describe_subset(args.dir)
    except SubsetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
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
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `verify` and `inspect` to the `puzzletron-data` parser."""
    verify = sub.add_parser(
        "verify", help="check every count and SHA-256 of a subset (exit 1 on any mismatch)"
    )
    verify.add_argument("dir", help="subset directory")
    verify.set_defaults(handler=_verify)
    inspect = sub.add_parser("inspect", help="describe a subset: counts, sources, image formats and sizes")
    inspect.add_argument("dir", help="subset directory")
    inspect.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    inspect.set_defaults(handler=_inspect)

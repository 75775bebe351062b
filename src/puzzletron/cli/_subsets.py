"""`puzzletron-data verify DIR` and `puzzletron-data inspect DIR [--json]`: check and describe a snapshot.

Both read the snapshot's format from its ``manifest.json`` and hand it to that format's verifier or
describer (`puzzletron.dataset.formats`: conversation subsets, text snapshots; the detection rule for
manifests written before formats were named is documented there). Exit 0 when everything matches, 1 on
any problem (`verify` prints every one; a directory `inspect` cannot read is a library error, which
`puzzletron.cli.main` prints and turns into exit 1).
"""

from __future__ import annotations

import argparse
import json

from puzzletron.dataset import formats

__all__ = ["register"]


def _verify(args: argparse.Namespace) -> int:
    report = formats.verify(args.dir)  # a damaged snapshot is a report, not an exception
    if report.ok:
        print(f"OK {report.path}: {formats.summary(report)}, all hashes match")
        return 0
    print(f"FAILED {report.path}: {len(report.problems)} problem(s)")
    for problem in report.problems:
        print(f"  - {problem}")
    return 1


def _inspect(args: argparse.Namespace) -> int:
    info = formats.describe(args.dir)  # no snapshot there: `SnapshotError`, exit 1 in `puzzletron.cli.main`
    print(json.dumps(info, indent=2, sort_keys=True) if args.json else "\n".join(formats.render(info)))
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

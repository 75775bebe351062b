"""`puzzletron-data verify DIR` and `puzzletron-data inspect DIR`: check and describe a snapshot or store.

Both read the folder's format from its ``manifest.json`` and hand it to that format's verifier or describer
(`puzzletron.dataset.formats`: conversation subsets, text snapshots, token stores, VLM stores; the detection
rule for manifests written before formats were named is documented there). A token store may be at an URL
(``s3://bucket/prefix``, ``docs/object-storage.md``): `verify` then streams every byte once. Exit 0 when
everything matches, 1 on any problem (`verify` prints every one; a folder `inspect` cannot read, or an URL
that cannot be reached, is a library error, which `puzzletron.cli.main` prints and turns into exit 1).
``--json``: one line (`puzzletron.cli._output`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from puzzletron.cli._output import add_json, counts_of, emit, folder_facts

__all__ = ["register"]

_WHAT = (
    "folder of a conversation subset, a Puzzle-KD text snapshot, a token store or a VLM store; a token store "
    "may be an URL (s3://bucket/prefix)"
)


def _verify(args: argparse.Namespace) -> int:
    from puzzletron.dataset import formats

    report = formats.verify(args.dir)  # a damaged snapshot is a report, not an exception
    if args.json:
        if report.ok:
            facts = folder_facts(args.dir)
        else:  # the keys of every failed line (`puzzletron.cli.main`), and the folder's problems
            error = f"{len(report.problems)} problem(s): {report.problems[0]}"
            facts = {"path": report.path, "format": report.format or None, "error": error, "exit_code": 1}
        emit("verify", "ok" if report.ok else "failed", **facts, problems=list(report.problems))
        return 0 if report.ok else 1
    if report.ok:
        print(f"OK {report.path}: {formats.summary(report)}, all hashes match")
        return 0
    print(f"FAILED {report.path}: {len(report.problems)} problem(s)")
    for problem in report.problems:
        print(f"  - {problem}")
    return 1


def _inspect(args: argparse.Namespace) -> int:
    from puzzletron.dataset import formats

    info = formats.describe(args.dir)  # no snapshot there: `SnapshotError`, exit 1 in `puzzletron.cli.main`
    if args.json:
        manifest = str(Path(info["path"]) / formats.MANIFEST)
        emit("inspect", "ok", **{**info, "manifest": manifest, **counts_of(info)})
    else:
        print("\n".join(formats.render(info)))
    return 0


# command -> (help, handler)
_COMMANDS = {
    "verify": (
        "check every count and SHA-256 of a snapshot, subset, token or VLM store (exit 1 on a mismatch)",
        _verify,
    ),
    "inspect": (
        "describe a snapshot, subset, token or VLM store (counts, sources, revisions, images, bytes)",
        _inspect,
    ),
}


def register(sub: argparse._SubParsersAction) -> None:
    """Add `verify` and `inspect` to the `puzzletron-data` parser."""
    for command, (help_text, handler) in _COMMANDS.items():
        parser = sub.add_parser(command, help=help_text)
        parser.add_argument("dir", help=_WHAT)
        add_json(parser)
        parser.set_defaults(handler=handler)

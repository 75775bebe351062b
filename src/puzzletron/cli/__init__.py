"""`puzzletron-data`: the command line of the data stage.

Each area registers its own subcommands (`register(subparsers)`) so this module stays a thin dispatcher.
Exit codes: 0 done (or reused), 1 a data error, 2 usage. A library error a subcommand does not handle
itself ends here as one line on stderr: `ConfigError` (a bad option or spec field) exits 2, any other
`PuzzletronDataError` or an `OSError` exits 1; nothing broader is caught.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from puzzletron.cli import _acquire, _demo, _pack_report, _subsets
from puzzletron.dataset.errors import ConfigError, PuzzletronDataError

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="puzzletron-data", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for area in (_demo, _pack_report, _subsets, _acquire):
        area.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    try:
        return int(args.handler(args) or 0)
    except ConfigError as exc:
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
        return 2
    except (PuzzletronDataError, OSError) as exc:
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

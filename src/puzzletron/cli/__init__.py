"""`puzzletron-data`: the command line of the data stage.

Each area registers its own subcommands (`register(subparsers)`) so this module stays a thin dispatcher.
Exit codes: 0 done (or reused), 1 a data error, 2 usage, 130 interrupted. A library error a subcommand does
not handle itself ends here as one line on stderr: `ConfigError` (a bad option or spec field) exits 2, any
other `PuzzletronDataError` or an `OSError` exits 1; Ctrl-C (`KeyboardInterrupt`) prints one line and exits
130 (a materialisation it interrupts publishes nothing); nothing broader is caught. Paths that are not
UTF-8 are printed with backslash escapes rather than failing the print. Every command takes ``--json``
and then prints exactly one JSON line on stdout, with the same keys for the same facts
(`puzzletron.cli._output`); ``--version`` prints the installed version.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence

from puzzletron.cli import _acquire, _demo, _pack_report, _subsets, _tokenize
from puzzletron.dataset.errors import ConfigError, PuzzletronDataError

__all__ = ["main"]


_EPILOG = """--json prints one line with the same keys for the same facts in every command: command,
status (done | reused | ok | failed | serving), path (the folder written or read), format, manifest,
row_count, sample_count, image_count, token_count, bytes_on_disk, plus the command's own (adapter,
identity_sha256, problems, endpoint, stages ...)."""


def _version() -> str:
    """The installed distribution's version; the source tree's when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("puzzletron-data")
    except PackageNotFoundError:
        return "0.1.0+source"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="puzzletron-data",
        description=__doc__.splitlines()[0],
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for area in (_demo, _pack_report, _subsets, _acquire, _tokenize):
        area.register(sub)
    return parser


def _escape_unprintable() -> None:
    """Print a path that is not UTF-8 (a lone surrogate from ``argv``) with backslash escapes."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(ValueError, OSError):
                reconfigure(errors="backslashreplace")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _escape_unprintable()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    try:
        return int(args.handler(args) or 0)
    except ConfigError as exc:
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
        return 2
    except (PuzzletronDataError, OSError) as exc:
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{parser.prog} {args.command}: interrupted; nothing partial was published", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

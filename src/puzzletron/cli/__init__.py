"""`puzzletron-data`: the command line of the data stage.

Each area registers its own subcommands (`register(subparsers)`) so this module stays a thin dispatcher.
Exit codes: 0 done (or reused), 1 a data error, 2 usage, 130 interrupted. A library error a subcommand does
not handle itself ends here as one line on stderr: `ConfigError` (a bad option or spec field) exits 2, any
other `PuzzletronDataError`, an `OSError` or a `CommandFailed` exits 1; Ctrl-C (`KeyboardInterrupt`) prints
one line and exits 130 (a materialisation it interrupts publishes nothing); nothing broader is caught. Paths
that are not UTF-8 are printed with backslash escapes rather than failing the print. Every command takes
``--json`` and then prints exactly one JSON line on stdout whatever happens, with the same keys for the same
facts (`puzzletron.cli._output`; a failure, a usage error included, is ``"status": "failed"`` with its
``error``); ``--version`` prints the installed version.

The parser is built and the arguments parsed before anything heavy is imported (the areas import the
library inside their handlers), so a usage error is said at once. ``-v`` goes before or after the
subcommand; options are never abbreviated (``--train-sample`` is an error, not ``--train-samples``); an
unknown option is reported with the usage of the subcommand it was given to.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from puzzletron.cli import _acquire, _demo, _pack_report, _subsets, _tokenize
from puzzletron.cli._output import CommandFailed, emit
from puzzletron.dataset.errors import ConfigError, PuzzletronDataError  # light: no library module

__all__ = ["build_parser", "main"]

PROG = "puzzletron-data"
_EPILOG = """--json prints one line with the same keys for the same facts in every command: command,
status (done | reused | ok | failed | serving), path (the folder written or read), format, manifest,
row_count, sample_count, image_count, token_count, bytes_on_disk, plus the command's own (adapter,
identity_sha256, problems, endpoint, stages ...); a failure: status failed and error (the message on
stderr)."""


class UsageError(SystemExit):
    """A usage error (exit 2) of the (sub)command whose parser raised it, after its usage was printed."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(2)
        self.prog, self.message = prog, message


class _Parser(argparse.ArgumentParser):
    """No abbreviated options; an unknown option is the usage error of the subcommand it was given to."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and self.prog != PROG:  # a subcommand: its own usage, not the top-level one
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise UsageError(self.prog, message)


def _version() -> str:
    """The installed distribution's version; the source tree's when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("puzzletron-data")
    except PackageNotFoundError:
        return "0.1.0+source"


def _leaves(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers of the commands that run (``materialize puzzle-kd``, ``verify`` ...)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [parser]
    return [leaf for child in dict.fromkeys(subs[0].choices.values()) for leaf in _leaves(child)]


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; building it imports nothing heavy."""
    parser = _Parser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for area in (_demo, _pack_report, _subsets, _acquire, _tokenize):
        area.register(sub)
    for leaf in _leaves(parser):  # -v after the subcommand as well (unset there: the top level's stays)
        leaf.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level"
        )
    return parser


def _escape_unprintable() -> None:
    """Print a path that is not UTF-8 (a lone surrogate from ``argv``) with backslash escapes."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(ValueError, OSError):
                reconfigure(errors="backslashreplace")


def _command(args: argparse.Namespace) -> str:
    """The command that ran: ``"materialize puzzle-kd"``, ``"hub serve"``, ``"verify"`` ..."""
    words = (args.command, getattr(args, "dataset", None), getattr(args, "hub_command", None))
    return " ".join(str(word) for word in words if word)


def _failed(args: argparse.Namespace, message: str, code: int) -> int:
    """Say a failure: one line on stderr and, with ``--json``, the command's one JSON line."""
    command = _command(args)
    print(f"{PROG} {command}: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        emit(command, "failed", error=message, exit_code=code)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    _escape_unprintable()
    try:
        args = parser.parse_args(words)
    except UsageError as exc:  # printed already; with --json the one line says it as well
        if "--json" in words:
            emit(exc.prog.removeprefix(PROG).strip(), "failed", error=exc.message, exit_code=2)
        raise
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    try:
        return int(args.handler(args) or 0)
    except ConfigError as exc:
        return _failed(args, str(exc), 2)
    except (PuzzletronDataError, OSError) as exc:
        return _failed(args, str(exc), 1)
    except CommandFailed as exc:
        return _failed(args, str(exc), exc.code)
    except KeyboardInterrupt:
        return _failed(args, "interrupted; nothing partial was published", 130)


if __name__ == "__main__":
    sys.exit(main())

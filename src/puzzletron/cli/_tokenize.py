"""`puzzletron-data tokenize SNAPSHOT --tokenizer DIR --output STORE`: build (or reuse) a token store.

Tokenises one split of a text snapshot with the tokenizer's chat template into a token store
(``docs/token-store-format.md``, `puzzletron.dataset.tokenize.store.build_token_store`), shows a progress bar
on stderr (only when stderr is a terminal and ``--quiet`` is not given) and prints one JSON line on
stdout::

    {"status": "done" | "reused", "format": "puzzletron-token-store", "output": STORE, "manifest": ...}

Exit codes: 0 done or reused, 1 a data error (a missing or damaged snapshot, a store of another identity
at STORE), 2 usage (bad flags or values; `ConfigError`, which `puzzletron.cli.main` turns into 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["register"]


def _positive(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


class _Bar:
    """A tqdm bar of rows on stderr, fed by `build_token_store`'s ``progress(done, total)``."""

    def __init__(self) -> None:
        self.bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, desc="tokenize", unit="row", file=sys.stderr, leave=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _tokenize(args: argparse.Namespace) -> int:
    from puzzletron.dataset.config import TokenizeOptions
    from puzzletron.dataset.formats import MANIFEST
    from puzzletron.dataset.formats.token_store import TOKEN_STORE_FORMAT
    from puzzletron.dataset.storage.atomic import publications
    from puzzletron.dataset.tokenize import build_token_store

    output = Path(args.output)
    published = publications(output)  # "done" only when this run publishes the store (not a waiter)
    bar = _Bar() if not args.quiet and sys.stderr.isatty() else None
    options = TokenizeOptions(messages_field=args.messages_field, id_field=args.id_field or None)
    if args.rows_per_shard is not None:
        options = dataclasses.replace(options, rows_per_shard=args.rows_per_shard)
    try:  # a library error or OSError goes to `puzzletron.cli.main`: ConfigError exits 2, others 1
        build_token_store(
            Path(args.snapshot),
            tokenizer=Path(args.tokenizer),
            output=output,
            split=args.split,
            num_proc=args.num_proc,
            options=options,
            progress=bar,
        )
    finally:
        if bar is not None:
            bar.close()
    line = {
        "status": "done" if publications(output) > published else "reused",
        "format": TOKEN_STORE_FORMAT,
        "output": str(output),
        "manifest": str(output / MANIFEST),
    }
    print(json.dumps(line), flush=True)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``tokenize`` to the `puzzletron-data` parser."""
    parser = sub.add_parser("tokenize", help="tokenise a text snapshot split into a token store")
    parser.add_argument("snapshot", help="text snapshot directory (puzzletron-data materialize puzzle-kd)")
    parser.add_argument("--tokenizer", required=True, help="local tokenizer directory (with a chat template)")
    parser.add_argument("--output", required=True, help="token store directory (created atomically)")
    parser.add_argument("--split", default="train", help="split to tokenise (default train)")
    parser.add_argument("--num-proc", type=_positive, default=1, help="worker processes (default 1)")
    parser.add_argument(
        "--rows-per-shard",
        type=_positive,
        default=None,
        help="rows of the split per shard (default 65536, build_token_store's; part of the identity)",
    )
    parser.add_argument("--messages-field", default="messages", help="column of the conversations")
    parser.add_argument("--id-field", default="uuid", help="column of the sample ids ('' for the row index)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(handler=_tokenize)

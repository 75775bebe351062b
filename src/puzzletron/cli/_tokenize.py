"""`puzzletron-data tokenize SOURCE --output STORE`: build (or reuse) a token store or a VLM store.

The command dispatches on the source's format:

- a text snapshot (``--tokenizer DIR``): one split tokenised with the tokenizer's chat template into a token
  store (``docs/token-store-format.md``, `puzzletron.dataset.tokenize.store.build_token_store`);
- a conversation subset (``--processor DIR``): every sample tokenised with the processor's chat template,
  image placeholders expanded, into a VLM store (``docs/vlm-store-format.md``,
  `puzzletron.dataset.tokenize.vlm_store.build_vlm_store`).

It shows a progress bar on stderr (only when stderr is a terminal and ``--quiet`` is not given) and prints
one JSON line on stdout::

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


def _is_subset(source: Path) -> bool:
    """Whether `source` holds a conversation subset (else it is read as a text snapshot)."""
    from puzzletron.dataset.errors import SnapshotError
    from puzzletron.dataset.formats import MANIFEST, detect
    from puzzletron.dataset.formats.subset import SUBSET_FORMAT

    try:
        return (source / MANIFEST).is_file() and detect(source) == SUBSET_FORMAT
    except SnapshotError:
        return False  # the text snapshot reader says what is wrong with it


def _build(args: argparse.Namespace, output: Path, bar: _Bar | None) -> str:
    """Build or reuse the store `args` ask for; its format name."""
    from puzzletron.dataset.config import TokenizeOptions
    from puzzletron.dataset.errors import ConfigError
    from puzzletron.dataset.formats.token_store import TOKEN_STORE_FORMAT
    from puzzletron.dataset.formats.vlm_store import VLM_STORE_FORMAT
    from puzzletron.dataset.tokenize import build_token_store, build_vlm_store

    source = Path(args.source)
    if _is_subset(source):
        if args.processor is None or args.tokenizer is not None:
            raise ConfigError(f"{source} is a conversation subset: give --processor DIR (not --tokenizer)")
        shards = {} if args.rows_per_shard is None else {"rows_per_shard": args.rows_per_shard}
        build_vlm_store(
            source,
            processor=Path(args.processor),
            output=output,
            num_proc=args.num_proc,
            progress=bar,
            **shards,
        )
        return VLM_STORE_FORMAT
    if args.tokenizer is None or args.processor is not None:
        raise ConfigError(f"{source} is not a conversation subset: give --tokenizer DIR for a text snapshot")
    options = TokenizeOptions(messages_field=args.messages_field, id_field=args.id_field or None)
    if args.rows_per_shard is not None:
        options = dataclasses.replace(options, rows_per_shard=args.rows_per_shard)
    build_token_store(
        source,
        tokenizer=Path(args.tokenizer),
        output=output,
        split=args.split,
        num_proc=args.num_proc,
        options=options,
        progress=bar,
    )
    return TOKEN_STORE_FORMAT


def _tokenize(args: argparse.Namespace) -> int:
    from puzzletron.dataset.formats import MANIFEST

    output = Path(args.output)
    existed = (output / MANIFEST).is_file()
    bar = _Bar() if not args.quiet and sys.stderr.isatty() else None
    try:  # a library error or OSError goes to `puzzletron.cli.main`: ConfigError exits 2, others 1
        fmt = _build(args, output, bar)
    finally:
        if bar is not None:
            bar.close()
    line = {
        "status": "reused" if existed else "done",
        "format": fmt,
        "output": str(output),
        "manifest": str(output / MANIFEST),
    }
    print(json.dumps(line), flush=True)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``tokenize`` to the `puzzletron-data` parser."""
    parser = sub.add_parser(
        "tokenize", help="tokenise a text snapshot split into a token store, or a subset into a VLM store"
    )
    parser.add_argument(
        "source",
        help="text snapshot (materialize puzzle-kd) or conversation subset (materialize nemotron-vlm)",
    )
    parser.add_argument("--tokenizer", help="text snapshot: local tokenizer directory (with a chat template)")
    parser.add_argument("--processor", help="subset: local processor directory (Qwen2-VL / 2.5-VL / 3-VL)")
    parser.add_argument("--output", required=True, help="store directory (created atomically)")
    parser.add_argument("--split", default="train", help="split to tokenise (default train)")
    parser.add_argument("--num-proc", type=_positive, default=1, help="worker processes (default 1)")
    parser.add_argument(
        "--rows-per-shard",
        type=_positive,
        default=None,
        help="rows per shard (default 65536 text, 8192 VLM; part of the identity)",
    )
    parser.add_argument("--messages-field", default="messages", help="column of the conversations")
    parser.add_argument("--id-field", default="uuid", help="column of the sample ids ('' for the row index)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(handler=_tokenize)

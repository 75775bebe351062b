"""`puzzletron-data tokenize SOURCE (--tokenizer DIR | --processor DIR) [--output STORE | --cache-dir DIR]`:
build or reuse a token store, or a VLM store.

The command dispatches on the source's format: a conversation subset with ``--processor`` (a Qwen2-VL-family
processor directory) becomes a VLM store (``docs/vlm-store-format.md``,
`puzzletron.dataset.tokenize.vlm_store.build_vlm_store`: every sample tokenised with the processor's chat
template, image placeholders expanded as the processor expands them); anything else is read as a text
snapshot with ``--tokenizer``, as follows (a text snapshot at an URL is read from its verified local copy in
the node's object cache, `puzzletron.dataset.formats.local_copy`).

Tokenises one split of a text snapshot with the tokenizer's chat template into a token store
(``docs/token-store-format.md``, `puzzletron.dataset.tokenize.store.build_token_store`). ``--output`` puts
it exactly there; ``--cache-dir`` reuses a store of the same identity anywhere under that folder (also one
an earlier ``--output`` put there), else builds one at ``DIR/<identity hash>`` (neither: the per-user
cache, `puzzletron.dataset.config.default_cache_dir`): the same lookup
`build_batches(..., cache_dir=DIR)` does, so the two never tokenise twice. Shows a progress bar of rows on
stderr (only when stderr is a terminal and ``--quiet`` is not given) and prints one JSON line on stdout
(with or without ``--json``; keys: `puzzletron.cli._output`)::

    {"command": "tokenize", "status": "done" | "reused", "path": STORE, "format": "puzzletron-token-store",
     "manifest": ..., "row_count": ..., "sample_count": ..., "token_count": ..., "identity_sha256": ...}

Exit codes: 0 done or reused, 1 a data error (a missing or damaged snapshot, a store of another identity
at STORE), 2 usage (bad flags or values; `ConfigError`, which `puzzletron.cli.main` turns into 2).

Under a launcher (``torchrun --nnodes N --nproc-per-node P -m puzzletron.cli tokenize ...``) the processes
form a gloo group from the launcher's environment and build cooperatively: rank ``r`` tokenises shards
``k % world == r``, rank 0 publishes, every rank prints its line (``"rank"`` says which). The bytes are the
same for any world size.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from puzzletron.cli._output import add_json, emit, folder_facts

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


def _existing(args: argparse.Namespace, options: Any) -> Path | None:
    """The complete store this run would reuse, if there is one (read before building)."""
    from puzzletron.dataset.formats import MANIFEST
    from puzzletron.dataset.formats.text_snapshot import open_split
    from puzzletron.dataset.storage.objects import is_url
    from puzzletron.dataset.tokenize import find_store, store_identity

    if args.output is not None and is_url(args.output):
        return args.output if _remote_manifest(args.output) else None
    if args.output is not None:
        return Path(args.output) if (Path(args.output) / MANIFEST).is_file() else None
    identity = store_identity(
        open_split(args.snapshot, args.split), tokenizer=args.tokenizer, options=options
    )
    return find_store(args.cache_dir, identity)


def _remote_manifest(url: str) -> bool:
    """Whether a manifest is published at the URL prefix."""
    from puzzletron.dataset.formats import MANIFEST
    from puzzletron.dataset.storage.objects import Objects

    return MANIFEST in Objects(url).list()


def _refuse_a_store(snapshot: Path) -> str | None:
    """A token or VLM store given as the snapshot: say what to do with it (the text reader would only say it
    is not a text snapshot); else the source's format (None: not one the registry knows)."""
    from puzzletron.dataset.errors import SnapshotError
    from puzzletron.dataset.formats import detect
    from puzzletron.dataset.formats.token_store import TOKEN_STORE_FORMAT
    from puzzletron.dataset.formats.vlm_store import VLM_STORE_FORMAT

    try:
        kind = detect(snapshot)
    except SnapshotError:
        return None  # no folder, no manifest: the snapshot reader says what is wrong
    if kind in (TOKEN_STORE_FORMAT, VLM_STORE_FORMAT):
        what = "a token store" if kind == TOKEN_STORE_FORMAT else "a VLM store"
        raise SnapshotError(
            f"{snapshot} is {what} already, not a text snapshot: the pipelines, pack-report and the "
            "AutoModel factories read it as it is (tokenize its snapshot to build another)"
        )
    return kind


def _tokenize_subset(args: argparse.Namespace) -> int:
    """A conversation subset -> its VLM store (``--processor``; cooperative under a launcher as well)."""
    from puzzletron.dataset.distributed.collectives import launched_group
    from puzzletron.dataset.errors import ConfigError
    from puzzletron.dataset.formats import MANIFEST
    from puzzletron.dataset.formats.vlm_store import VlmStore, read_complete_manifest
    from puzzletron.dataset.storage.objects import is_url
    from puzzletron.dataset.tokenize import build_vlm_store, find_store, vlm_store_identity
    from puzzletron.dataset.tokenize.vlm_store import DEFAULT_ROWS_PER_SHARD

    source = args.snapshot if is_url(args.snapshot) else Path(args.snapshot)  # a folder or an URL
    if args.processor is None or args.tokenizer is not None:
        raise ConfigError(f"{source} is a conversation subset: give --processor DIR (not --tokenizer)")
    per = args.rows_per_shard or DEFAULT_ROWS_PER_SHARD
    if args.output is not None and is_url(args.output):
        existed = _remote_manifest(args.output)
    elif args.output is not None:
        existed = (Path(args.output) / MANIFEST).is_file()
    else:
        identity = vlm_store_identity(source, processor=args.processor, rows_per_shard=per)
        existed = find_store(args.cache_dir, identity, complete=read_complete_manifest) is not None
    bar = _Bar() if not args.quiet and sys.stderr.isatty() else None
    try:
        with launched_group() as dist:
            rank = dist.get_rank() if dist is not None else None
            path = build_vlm_store(
                source, processor=Path(args.processor), output=args.output, cache_dir=args.cache_dir,
                rows_per_shard=per, num_proc=args.num_proc, progress=bar,
            )  # fmt: skip
    finally:
        if bar is not None:
            bar.close()
    digest = VlmStore(path).manifest["identity_sha256"]
    ranked = {"rank": rank} if rank is not None else {}
    emit("tokenize", "reused" if existed else "done", **folder_facts(path), identity_sha256=digest, **ranked)
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    from puzzletron.dataset.config import TokenizeOptions, default_cache_dir

    if args.output is None and args.cache_dir is None:  # the per-user cache (PUZZLETRON_CACHE_DIR)
        args.cache_dir = str(default_cache_dir())
    from puzzletron.dataset.distributed.collectives import launched_group
    from puzzletron.dataset.errors import ConfigError
    from puzzletron.dataset.formats.subset import SUBSET_FORMAT
    from puzzletron.dataset.formats.token_store import TokenStore
    from puzzletron.dataset.storage.atomic import total_publications
    from puzzletron.dataset.storage.objects import is_url
    from puzzletron.dataset.tokenize import build_token_store

    if _refuse_a_store(args.snapshot if is_url(args.snapshot) else Path(args.snapshot)) == SUBSET_FORMAT:
        return _tokenize_subset(args)
    if args.tokenizer is None or args.processor is not None:
        raise ConfigError(
            f"{args.snapshot} is not a conversation subset: give --tokenizer DIR for a text snapshot"
        )
    if is_url(args.snapshot):  # every rank: the node's verified copy (one download a node, under its lock)
        from puzzletron.dataset.formats.local_copy import local_text_snapshot

        args.snapshot = str(local_text_snapshot(args.snapshot))
    options = TokenizeOptions(messages_field=args.messages_field, id_field=args.id_field or None)
    if args.rows_per_shard is not None:
        options = dataclasses.replace(options, rows_per_shard=args.rows_per_shard)
    existed = _existing(args, options)
    published = total_publications()
    bar = _Bar() if not args.quiet and sys.stderr.isatty() else None
    try:  # a library error or OSError goes to `puzzletron.cli.main`: ConfigError exits 2, others 1
        with launched_group() as dist:
            rank = dist.get_rank() if dist is not None else None
            path = build_token_store(
                Path(args.snapshot),
                tokenizer=Path(args.tokenizer),
                output=args.output,
                cache_dir=args.cache_dir,
                split=args.split,
                num_proc=args.num_proc,
                options=options,
                progress=bar,
            )
    finally:
        if bar is not None:
            bar.close()
    # "done" only where this process published the store (or built it with its ranks): a run that waited
    # for a concurrent one's lock and found the store published says "reused"
    built = dist is not None or total_publications() > published
    status = "reused" if existed is not None or not built else "done"
    digest = TokenStore(path).manifest["identity_sha256"]
    ranked = {"rank": rank} if rank is not None else {}  # under a launcher every rank prints its line
    emit("tokenize", status, **folder_facts(path), identity_sha256=digest, **ranked)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``tokenize`` to the `puzzletron-data` parser."""
    parser = sub.add_parser(
        "tokenize",
        help="tokenise a text snapshot split into a token store, or a subset into a VLM store (once)",
    )
    parser.add_argument(
        "snapshot",
        metavar="SOURCE",
        help="text snapshot (materialize puzzle-kd) or conversation subset (materialize nemotron-vlm); a "
        "folder or an URL",
    )
    parser.add_argument(
        "--tokenizer", metavar="DIR", help="text snapshot: local tokenizer directory (with a chat template)"
    )
    parser.add_argument(
        "--processor",
        metavar="DIR",
        help="subset: local processor directory (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--output",
        default=None,
        metavar="DIR",
        help="token store directory (created atomically), or an URL (s3://bucket/prefix: object storage)",
    )
    where.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=None,
        help="reuse the store of this identity anywhere under DIR, else build DIR/<identity hash> "
        "(build_batches' cache_dir; an URL too; neither option: $PUZZLETRON_CACHE_DIR, default "
        "~/.cache/puzzletron/stores)",
    )
    parser.add_argument("--split", default="train", help="split to tokenise (default train)")
    parser.add_argument("--num-proc", type=_positive, default=1, help="worker processes (default 1)")
    parser.add_argument(
        "--rows-per-shard",
        type=_positive,
        default=None,
        help="rows per shard (default 65536 text, 8192 VLM; part of the identity)",
    )
    parser.add_argument(
        "--messages-field", default="messages", help="column of the conversations (default messages)"
    )
    parser.add_argument(
        "--id-field", default="uuid", help="column of the sample ids ('' for the row index; default uuid)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_json(parser, always=True)
    parser.set_defaults(handler=_tokenize)

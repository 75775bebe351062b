"""Build (or reuse) the token store of a text snapshot split: on one machine and on many.

    path = build_token_store("snapshots/puzzle-kd", tokenizer="tok/", cache_dir="stores", num_proc=8)
    store = TokenStore(path)          # puzzletron.dataset.formats.token_store

The store (``docs/token-store-format.md``) is content-addressed: `store_identity` covers the split's
files, the tokenizer, the options and the format version. With ``output`` it lives where asked (a store
of another identity there is an error naming what differs); with ``cache_dir`` a complete store of the
same identity anywhere under it is reused (`puzzletron.dataset.tokenize.cache`: also one a user put at
``cache_dir/puzzle-kd`` with ``output``), else one is built at ``cache_dir/<first 16 hex digits of its
SHA-256>``. A complete store of the same identity is reused without loading the tokenizer or reading a row.

Shards are fixed row ranges of the split (``rows_per_shard`` rows, part of the identity), so every byte
and the manifest are the same for any ``num_proc`` and any world size. Building: under the destination's
lock (`puzzletron.dataset.storage.atomic`), each shard is tokenised (`tokenize_rows`, ``batch_size`` rows
at a time: bounded memory) and written straight into a build directory
``<parent>/.<name>.build-<hash>`` under a temporary name, renamed when complete with its record; then the
index and manifest are written into a transaction directory (the shards hard-linked in) and published
with one rename. A build killed at any point publishes nothing; the rerun keeps the finished shards,
tokenises only the missing ones, and sweeps the debris (temporary shards, transactions, build
directories of other identities).

Within a node, ``num_proc`` worker processes take shards. Across nodes, when `torch.distributed` is
initialised every rank must call this (it is collective): rank 0 takes the lock, reuses or prepares the
build directory and broadcasts it; rank ``r`` builds shards ``k % world == r`` (that directory must be on a
file system every rank sees); after an all-gather of the ranks' errors rank 0 publishes, then every rank
returns the path. A failure on any rank raises on every rank, naming it; the finished shards are kept. The
process group's timeout must cover the waits (rank 0 waiting for the lock; ranks finishing at different
times).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset._checks import require_positive
from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.formats.text_snapshot import TextSplit, open_split
from puzzletron.dataset.formats.token_store import (
    ShardWriter,
    assemble_store,
    read_complete_manifest,
    read_shard_record,
)
from puzzletron.dataset.tokenize._builder import ShardedBuild, StoreFacts, run_build
from puzzletron.dataset.tokenize._workers import advance
from puzzletron.dataset.tokenize.cache import cache_path
from puzzletron.dataset.tokenize.conversations import load_tokenizer, pad_token_id, select_rows, tokenize_rows
from puzzletron.dataset.tokenize.identity import identity_sha256, store_identity

__all__ = ["build_token_store"]


@dataclass(frozen=True)
class _Build(ShardedBuild):
    """One token store build: what every shard task needs (picklable: the tokenizer travels as a path when
    it is one) and the identity, hashed once."""

    split: TextSplit
    dest: Path
    identity: dict[str, Any]
    digest: str  # identity_sha256(identity)
    tokenizer: Any
    options: TokenizeOptions
    batch_size: int
    what: str = "token store"

    def complete(self) -> dict[str, Any]:
        return read_complete_manifest(self.dest)

    @property
    def rows_per_shard(self) -> int:
        return self.options.rows_per_shard

    def prepare(self) -> StoreFacts:
        tok = load_tokenizer(self.tokenizer)
        return StoreFacts(rows=len(self.split.load()), vocab_size=len(tok), pad_token_id=pad_token_id(tok))

    def shard_record(self, directory: Path, rows: tuple[int, int]) -> dict[str, Any] | None:
        return read_shard_record(directory, rows)

    def write_shard(self, facts: StoreFacts, shard: int, directory: Path) -> dict[str, Any]:
        start, stop = self.shard_rows(facts)[shard]
        writer = ShardWriter(directory, facts.dtype)
        parts = tokenize_rows(
            self.split.load(), start, stop, tokenizer=self.tokenizer, options=self.options,
            batch_size=self.batch_size,
        )  # fmt: skip
        for part in parts:
            supervised = part.supervised
            (ids, mask), offsets = select_rows(
                (part.input_ids, part.mask), part.offsets, np.flatnonzero(supervised)
            )
            writer.add(ids, mask, np.diff(offsets), part.sample_ids, supervised=supervised)
            advance(len(part.offsets) - 1)  # rows, as each batch of the shard is written
        return writer.finish(rows=(start, stop))

    def assemble(
        self, tmp: Path, shard_dirs: list[Path], records: list[dict[str, Any]], fields: Mapping[str, Any]
    ) -> None:
        assemble_store(tmp, shard_dirs, records, fields=fields)


def build_token_store(
    snapshot: str | Path,
    *,
    tokenizer: str | Path | Any,
    output: str | Path | None = None,
    cache_dir: str | Path | None = None,
    split: str = "train",
    options: TokenizeOptions = TokenizeOptions(),
    num_proc: int = 1,
    batch_size: int = 1024,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Build or reuse the token store of `split` of `snapshot` (see the module docstring); its path.

    Exactly one of ``output`` (the store directory) and ``cache_dir`` (a store of this identity anywhere
    under it, else ``cache_dir/<identity hash>``). ``options``: the messages and id columns and
    ``rows_per_shard`` (all part of the identity). ``num_proc`` worker processes per rank; ``batch_size``
    rows rendered and encoded at a time. ``progress(done, total)`` is called (in this process) with the
    rows of this rank's shards written so far: once at the start (finished shards of an earlier run count
    as done), then as each batch of ``batch_size`` rows is written (from workers: within 0.25 s).
    """
    if (output is None) == (cache_dir is None):
        raise ConfigError("give exactly one of output (the store directory) and cache_dir")
    num_proc = require_positive(num_proc, "num_proc", error=ConfigError)
    batch_size = require_positive(batch_size, "batch_size", error=ConfigError)
    if not isinstance(options, TokenizeOptions):
        raise ConfigError(f"options must be TokenizeOptions, got {type(options).__name__}")
    text_split = open_split(snapshot, split)
    identity = store_identity(text_split, tokenizer=tokenizer, options=options)
    digest = identity_sha256(identity)
    dest = Path(os.path.abspath(output)) if output is not None else cache_path(cache_dir, identity)
    build = _Build(
        split=TextSplit(text_split.root.absolute(), split, text_split.folder.absolute(), text_split.manifest),
        dest=dest,
        identity=identity,
        digest=digest,
        tokenizer=str(tokenizer) if isinstance(tokenizer, str | Path) else tokenizer,
        options=options,
        batch_size=batch_size,
    )
    return run_build(build, num_proc=num_proc, progress=progress)

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
times). The lock, the shards in processes or ranks and the publication are `tokenize._builder`'s (shared with
the VLM store); at an URL, `_remote_store`'s steps replace the local ones.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset._checks import require_positive
from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.formats.local_copy import snapshot_folder
from puzzletron.dataset.formats.text_snapshot import TextSplit, open_split
from puzzletron.dataset.formats.token_store import (
    ShardWriter,
    assemble_store,
    read_complete_manifest,
    read_shard_record,
)
from puzzletron.dataset.storage.objects import is_url
from puzzletron.dataset.tokenize import _remote_store as _remote
from puzzletron.dataset.tokenize._builder import ShardedBuild, StoreFacts, run_build
from puzzletron.dataset.tokenize._workers import advance
from puzzletron.dataset.tokenize.cache import cache_path
from puzzletron.dataset.tokenize.conversations import (
    chat_tokenizer,
    check_columns,
    pad_token_id,
    select_rows,
    tokenize_rows,
)
from puzzletron.dataset.tokenize.identity import identity_sha256, store_identity

__all__ = ["build_token_store"]


@dataclass(frozen=True)
class _Build(ShardedBuild):
    """One token store build: what every shard task needs (picklable: the tokenizer travels as a path when
    it is one) and the identity, hashed once. At an URL, the `_remote_store` steps replace the local ones."""

    split: TextSplit
    dest: Path | str  # a directory, or an URL prefix (object storage: `_remote_store`)
    identity: dict[str, Any]
    digest: str  # identity_sha256(identity)
    tokenizer: Any
    options: TokenizeOptions
    batch_size: int
    what: str = "token store"
    token: str = field(default_factory=lambda: secrets.token_hex(6))  # this build's scratch and claim (URL)

    @property
    def rows_per_shard(self) -> int:
        return self.options.rows_per_shard

    @property
    def build_dir(self) -> Path:
        """``<parent>/.<name>.build-<16 hex of the identity>``; for a store on object storage, the node's
        local scratch folder (shards are uploaded as they finish)."""
        return _remote.scratch_dir(self.digest, self.token) if self.remote else super().build_dir

    def complete(self) -> dict[str, Any]:
        return read_complete_manifest(self.dest)

    def prepare(self) -> StoreFacts:
        """The split's bytes checked against the manifest its identity comes from, and the facts."""
        tok = chat_tokenizer(self.tokenizer)  # a usage error is said before anything is created
        rows = self.split.load()
        check_columns(rows, self.options)
        self.split.check_bytes()
        return StoreFacts(rows=len(rows), vocab_size=len(tok), pad_token_id=pad_token_id(tok))

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

    # object storage (`_remote_store`): upload, find, publish once
    def keep_shard(self, shard: int, tmp: Path, record: Mapping[str, Any]) -> None:
        if not isinstance(self.dest, str):
            return super().keep_shard(shard, tmp, record)
        _remote.upload_shard(self.dest, self.digest, shard, tmp, record)
        shutil.rmtree(tmp, ignore_errors=True)

    def claim(self) -> None:
        if isinstance(self.dest, str):
            _remote.claim(self.dest, self.digest, self.token)

    def release(self) -> None:
        if isinstance(self.dest, str):
            _remote.release(self.dest, self.digest, self.token)

    def finished_shards(self, facts: Any, shards: Sequence[int]) -> set[int]:
        if not isinstance(self.dest, str):
            return super().finished_shards(facts, shards)
        rows = self.shard_rows(facts)
        return set(_remote.finished_shards(self.dest, self.digest, {k: rows[k] for k in shards}))

    def existing_identity(self) -> dict[str, Any] | None:
        if not isinstance(self.dest, str):
            return super().existing_identity()
        published = _remote.published_manifest(self.dest)
        return None if published is None else published.get("identity")

    def publish(self, facts: StoreFacts) -> None:
        if not isinstance(self.dest, str):
            return super().publish(facts)
        fields = self.manifest_fields(facts)
        _remote.publish(self.dest, self.digest, self.shard_rows(facts), fields=fields, scratch=self.build_dir)


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
) -> Path | str:
    """Build or reuse the token store of `split` of `snapshot` (see the module docstring); its path.

    ``snapshot``: a text snapshot folder, or its URL (``s3://bucket/snapshots/pk``: the files its manifest
    lists are copied once a node into the object cache and verified before use,
    `formats.local_copy.local_text_snapshot`; the store's identity is the same as from any local copy).

    Exactly one of ``output`` (the store directory) and ``cache_dir`` (a store of this identity anywhere
    under it, else ``cache_dir/<identity hash>``); either may be an URL (``s3://bucket/stores``: the store
    is built on object storage without a shared file system or a lock, `_remote_store`, and its URL is
    returned). ``options``: the messages and id columns and
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
    text_split = open_split(snapshot_folder(snapshot), split)  # an URL: its verified local copy
    identity = store_identity(text_split, tokenizer=tokenizer, options=options)
    digest = identity_sha256(identity)
    if output is not None:
        dest: Path | str = output.rstrip("/") if is_url(output) else Path(os.path.abspath(output))
    else:
        dest = cache_path(cache_dir, identity)
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

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
import re
import secrets
import shutil
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset._checks import require_positive
from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.distributed.collectives import (
    all_gather,
    broadcast,
    describe,
    process_group,
    raise_first,
)
from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.formats.manifest import MANIFEST
from puzzletron.dataset.formats.text_snapshot import TextSplit, open_split
from puzzletron.dataset.formats.token_store import (
    ShardWriter,
    assemble_store,
    read_complete_manifest,
    read_shard_record,
    token_dtype,
)
from puzzletron.dataset.storage.atomic import fsync_path, fsync_tree, locked, sibling_prefix, staging_dir
from puzzletron.dataset.storage.objects import is_url
from puzzletron.dataset.tokenize import _remote_store as _remote
from puzzletron.dataset.tokenize._workers import advance, map_tasks
from puzzletron.dataset.tokenize.cache import cache_path
from puzzletron.dataset.tokenize.conversations import (
    chat_tokenizer,
    check_columns,
    pad_token_id,
    select_rows,
    tokenize_rows,
)
from puzzletron.dataset.tokenize.identity import identity_differences, identity_sha256, store_identity

__all__ = ["build_token_store"]


@dataclass(frozen=True)
class _Build:
    """One store build: what every shard task needs (picklable: the tokenizer travels as a path when it is
    one) and the identity, hashed once."""

    split: TextSplit
    dest: Path | str  # a directory, or an URL prefix (object storage: `_remote_store`)
    identity: dict[str, Any]
    digest: str  # identity_sha256(identity)
    tokenizer: Any
    options: TokenizeOptions
    batch_size: int

    @property
    def remote(self) -> bool:
        return isinstance(self.dest, str)

    @property
    def build_dir(self) -> Path:
        """``<parent>/.<name>.build-<16 hex of the identity>`` (the name a digest when too long); for a store
        on object storage, the node's local scratch folder (shards are uploaded as they finish)."""
        if isinstance(self.dest, str):
            return _remote.scratch_dir(self.digest)
        return self.dest.parent / f"{sibling_prefix(self.dest, 'build')}{self.digest[:16]}"


@dataclass(frozen=True)
class _Facts:
    """What rank 0 learns under the lock and every rank builds with."""

    rows: int
    vocab_size: int
    pad_token_id: int

    @property
    def dtype(self) -> str:
        return token_dtype(self.vocab_size)


def _shards(build: _Build, facts: _Facts) -> int:
    return -(-facts.rows // build.options.rows_per_shard)


def _rows_of(build: _Build, facts: _Facts, shard: int) -> tuple[int, int]:
    start = shard * build.options.rows_per_shard
    return start, min(start + build.options.rows_per_shard, facts.rows)


def _shard_dir(build: _Build, shard: int) -> Path:
    return build.build_dir / f"shard-{shard:06d}"


def _build_shard(context: tuple[_Build, _Facts], shard: int) -> dict[str, Any]:
    """Tokenise shard `shard` into a temporary directory, rename it complete; return its record."""
    build, facts = context
    start, stop = _rows_of(build, facts, shard)
    tmp = build.build_dir / f"tmp-{shard:06d}-{secrets.token_hex(8)}"
    tmp.mkdir(parents=build.remote)  # a remote build's scratch folder is this node's own
    try:
        writer = ShardWriter(tmp, facts.dtype)
        parts = tokenize_rows(
            build.split.load(), start, stop, tokenizer=build.tokenizer, options=build.options,
            batch_size=build.batch_size,
        )  # fmt: skip
        for part in parts:
            supervised = part.supervised
            (ids, mask), offsets = select_rows(
                (part.input_ids, part.mask), part.offsets, np.flatnonzero(supervised)
            )
            writer.add(ids, mask, np.diff(offsets), part.sample_ids, supervised=supervised)
            advance(len(part.offsets) - 1)  # rows, as each batch of the shard is written
        record = writer.finish(rows=(start, stop))
        if isinstance(build.dest, str):
            _remote.upload_shard(build.dest, build.digest, shard, tmp, record)
            shutil.rmtree(tmp, ignore_errors=True)
            return record
        fsync_tree(tmp)
        os.rename(tmp, _shard_dir(build, shard))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(build.build_dir, directory=True)
    return record


def _build_shards(
    build: _Build,
    facts: _Facts,
    shards: Sequence[int],
    *,
    num_proc: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Build the shards of `shards` that are not finished yet, `num_proc` processes at a time."""
    todo, done = [], 0
    uploaded = (
        _remote.finished_shards(build.dest, build.digest, {k: _rows_of(build, facts, k) for k in shards})
        if isinstance(build.dest, str)
        else None
    )
    for k in shards:
        rows = _rows_of(build, facts, k)
        if uploaded is not None:
            if k in uploaded:
                done += rows[1] - rows[0]
            else:
                todo.append(k)
        elif read_shard_record(_shard_dir(build, k), rows) is None:
            shutil.rmtree(_shard_dir(build, k), ignore_errors=True)  # a damaged finished shard: build again
            todo.append(k)
        else:
            done += rows[1] - rows[0]
    total = done + sum(_rows_of(build, facts, k)[1] - _rows_of(build, facts, k)[0] for k in todo)
    if progress is None:
        deque(map_tasks(_build_shard, (build, facts), todo, num_proc=num_proc), maxlen=0)
        return
    progress(done, total)

    def rows_done(n: int) -> None:
        nonlocal done
        done += n
        progress(done, total)

    deque(map_tasks(_build_shard, (build, facts), todo, num_proc=num_proc, progress=rows_done), maxlen=0)


def _build_dirs(dest: Path) -> list[Path]:
    """The build directories of `dest`: exactly ``.<name>.build-<16 hex>`` (a sibling output called
    ``<name>.build-x`` has its own ``.<name>.build-x.build-<hash>``, which is not one of them)."""
    if not dest.parent.is_dir():
        return []
    pattern = re.compile(re.escape(sibling_prefix(dest, "build")) + r"[0-9a-f]{16}")
    return sorted(p for p in dest.parent.iterdir() if pattern.fullmatch(p.name))


def _drop_if_empty(build: _Build) -> None:
    """Remove the build directory when it holds no finished shard (a failed run leaves no empty debris);
    finished shards are kept for the rerun (on object storage they are uploaded: the scratch folder goes)."""
    if build.build_dir.is_dir() and (build.remote or not any(build.build_dir.glob("shard-*"))):
        shutil.rmtree(build.build_dir, ignore_errors=True)


def _sweep(dest: Path, *, keep: Path | None = None) -> None:
    """Remove the build directories of `dest` but `keep` (hold `locked(dest)`), and `keep`'s temporary
    shards: only a lock holder creates either, so any found now is stale."""
    for directory in _build_dirs(dest):
        if directory != keep:
            shutil.rmtree(directory, ignore_errors=True)
    if keep is not None:
        for entry in keep.glob("tmp-*"):
            shutil.rmtree(entry, ignore_errors=True)


def _reusable(build: _Build) -> bool:
    """True when the destination holds a complete store of this identity; False when it holds nothing;
    else an error."""
    dest = build.dest
    if isinstance(dest, str):
        published = _remote.published_manifest(dest)
        if published is None:
            return False
        recorded = published.get("identity")
    elif not (dest / MANIFEST).is_file():
        if dest.is_dir() and any(dest.iterdir()):
            raise SnapshotError(f"{dest}: directory is not empty and holds no token store ({MANIFEST})")
        return False
    else:
        recorded = read_complete_manifest(dest).get("identity")
    if recorded != build.identity:
        differences = identity_differences(recorded, build.identity)
        raise SnapshotError(
            f"{dest}: the existing token store was built from another identity (existing vs requested: "
            f"{'; '.join(differences[:4])}{'; ...' if len(differences) > 4 else ''}); "
            "choose another output directory or delete this one"
        )
    return True


def _prepare(build: _Build) -> _Facts:
    """Under the lock: the split's bytes checked against the manifest its identity comes from, the build
    directory (created, swept) and the facts every rank builds with."""
    tok = chat_tokenizer(build.tokenizer)  # a usage error is said before anything is created
    rows = build.split.load()
    check_columns(rows, build.options)
    build.split.check_bytes()
    if not build.remote:
        _sweep(build.dest, keep=build.build_dir)  # type: ignore[arg-type]
    build.build_dir.mkdir(parents=build.remote, exist_ok=True)
    return _Facts(rows=len(rows), vocab_size=len(tok), pad_token_id=pad_token_id(tok))


def _publish(build: _Build, facts: _Facts) -> None:
    """Assemble the finished shards into a transaction directory and publish it (hold `locked(dest)`; on
    object storage: upload the index and write the manifest once, `_remote_store.publish`)."""
    shards = range(_shards(build, facts))
    if isinstance(build.dest, str):
        rows = [_rows_of(build, facts, k) for k in shards]
        _remote.publish(build.dest, build.digest, rows, fields=_fields(build, facts), scratch=build.build_dir)
        return
    records = [read_shard_record(_shard_dir(build, k), _rows_of(build, facts, k)) for k in shards]
    missing = [k for k, record in enumerate(records) if record is None]
    if missing:
        raise SnapshotError(
            f"{build.build_dir}: shards {missing[:8]} are missing after every rank built its own; is the "
            "build directory on a file system every rank shares?"
        )
    with staging_dir(build.dest) as tmp:
        assemble_store(tmp, [_shard_dir(build, k) for k in shards], records, fields=_fields(build, facts))
    shutil.rmtree(build.build_dir, ignore_errors=True)


def _fields(build: _Build, facts: _Facts) -> dict[str, Any]:
    """The manifest's identity and tokenizer facts."""
    import tokenizers
    import transformers

    return {
        "identity": build.identity,
        "identity_sha256": build.digest,
        "token_dtype": facts.dtype,
        "vocab_size": facts.vocab_size,
        "pad_token_id": facts.pad_token_id,
        "rows_per_shard": build.options.rows_per_shard,
        "built_with": {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__},
    }


def _build_here(build: _Build, num_proc: int, progress: Any) -> None:
    if build.remote:  # no lock on object storage: the manifest is written once (`_remote_store`)
        if _reusable(build):
            return
        try:
            facts = _prepare(build)
            _build_shards(build, facts, range(_shards(build, facts)), num_proc=num_proc, progress=progress)
            _publish(build, facts)
        finally:
            _drop_if_empty(build)
        return
    if _reusable(build) and not _build_dirs(build.dest):
        return
    with locked(build.dest):
        if _reusable(build):
            _sweep(build.dest)  # a run killed after publishing left its build directory
            return
        try:
            facts = _prepare(build)
            _build_shards(build, facts, range(_shards(build, facts)), num_proc=num_proc, progress=progress)
            _publish(build, facts)
        except BaseException:
            _drop_if_empty(build)
            raise


def _build_with_ranks(dist: Any, build: _Build, num_proc: int, progress: Any) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    digests = all_gather(dist, build.digest)
    if len(set(digests)) != 1:
        raise ConfigError(
            f"the ranks ask for different token stores (identity hashes {sorted(set(digests))})"
        )
    places = all_gather(dist, str(build.dest))
    if len(set(places)) != 1:
        raise SnapshotError(
            f"the ranks locate this token store at different paths ({sorted(set(places))}): is the cache "
            "directory one file system every rank sees?"
        )
    with ExitStack() as lock:
        own: BaseException | None = None
        facts: _Facts | None = None
        if rank == 0:
            try:
                if not build.remote:  # object storage needs no lock (`_remote_store`)
                    lock.enter_context(locked(build.dest))
                if _reusable(build):
                    if not build.remote:
                        _sweep(build.dest)  # type: ignore[arg-type]
                else:
                    facts = _prepare(build)
            except Exception as exc:
                own = exc
                _drop_if_empty(build)
        facts, failed = broadcast(dist, (facts, describe(own)))
        raise_first([failed], own, "preparing the token store", error=SnapshotError)
        if facts is not None:
            try:
                mine = [k for k in range(_shards(build, facts)) if k % world == rank]
                _build_shards(build, facts, mine, num_proc=num_proc, progress=progress)
            except Exception as exc:
                own = exc
            errors = all_gather(dist, describe(own))
            raise_first(errors, own, "building its shards", error=SnapshotError)
            if rank == 0:
                try:
                    _publish(build, facts)
                except Exception as exc:
                    own = exc
            published = broadcast(dist, describe(own))
            if build.remote:
                _drop_if_empty(build)
            raise_first([published], own, "publishing the token store", error=SnapshotError)
    try:
        read_complete_manifest(build.dest)
    except SnapshotError as exc:
        raise SnapshotError(
            f"rank {rank}: the token store rank 0 published is not visible here ({exc})"
        ) from exc


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
    text_split = open_split(snapshot, split)
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
    dist = process_group()
    if dist is None:
        _build_here(build, num_proc, progress)
    else:
        _build_with_ranks(dist, build, num_proc, progress)
    return dest

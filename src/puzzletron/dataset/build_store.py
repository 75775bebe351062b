"""Build (or reuse) the token store of a text snapshot split: on one machine and on many.

    path = build_token_store("snapshots/puzzle-kd", tokenizer="tok/", cache_dir="stores", num_proc=8)
    store = TokenStore(path)          # puzzletron.dataset.formats.token_store

The store (``docs/token-store-format.md``) is content-addressed: `store_identity` covers the split's
files, the tokenizer, the options and the format version; with ``cache_dir`` it lives at
``cache_dir/<first 16 hex digits of its SHA-256>``, with ``output`` where asked (a store of another
identity there is an error naming what differs). A complete store of the same identity is reused without
loading the tokenizer or reading a row.

Shards are fixed row ranges of the split (``rows_per_shard`` rows, part of the identity), so every byte
and the manifest are the same for any ``num_proc`` and any world size. Building: under the destination's
lock (`puzzletron.dataset._atomic`), each shard is tokenised (`tokenize.tokenize_rows`, ``batch_size``
rows at a time: bounded memory) and written straight into a build directory
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
import secrets
import shutil
import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset._atomic import fsync_path, fsync_tree, locked, staging_dir
from puzzletron.dataset._checks import require_positive
from puzzletron.dataset._store_identity import (
    identity_differences,
    identity_sha256,
    short_hash,
    split_dir,
    store_identity,
)
from puzzletron.dataset.errors import ConfigError, SubsetError
from puzzletron.dataset.formats._manifest import MANIFEST
from puzzletron.dataset.formats._token_store_layout import read_complete_manifest, token_dtype
from puzzletron.dataset.formats.token_store_writer import ShardWriter, assemble_store, read_shard_record
from puzzletron.dataset.tokenize import load_tokenizer, map_tasks, pad_token_id, select_rows, tokenize_rows

__all__ = ["DEFAULT_ROWS_PER_SHARD", "build_token_store", "identity_sha256", "short_hash", "store_identity"]

DEFAULT_ROWS_PER_SHARD = 65_536
_SPLITS: dict[str, Any] = {}  # per-process cache: split folder -> memory-mapped datasets.Dataset


@dataclass(frozen=True)
class _Plan:
    """What every shard task needs (picklable: the tokenizer travels as a path when it is one)."""

    split_dir: Path
    build_dir: Path
    tokenizer: Any
    messages_field: str
    id_field: str | None
    rows: int
    rows_per_shard: int
    batch_size: int
    dtype: str

    @property
    def shards(self) -> int:
        return -(-self.rows // self.rows_per_shard)

    def rows_of(self, shard: int) -> tuple[int, int]:
        start = shard * self.rows_per_shard
        return start, min(start + self.rows_per_shard, self.rows)

    def shard_dir(self, shard: int) -> Path:
        return self.build_dir / f"shard-{shard:06d}"


def _open_split(folder: Path) -> Any:
    key = str(folder.resolve())
    if key not in _SPLITS:
        import datasets

        _SPLITS[key] = datasets.load_from_disk(key)
    return _SPLITS[key]


def _build_shard(plan: _Plan, shard: int) -> dict[str, Any]:
    """Tokenise shard `shard` into a temporary directory, rename it complete; return its record."""
    start, stop = plan.rows_of(shard)
    tmp = plan.build_dir / f"tmp-{shard:06d}-{secrets.token_hex(8)}"
    tmp.mkdir()
    try:
        writer = ShardWriter(tmp, plan.dtype)
        parts = tokenize_rows(
            _open_split(plan.split_dir), start, stop, tokenizer=plan.tokenizer,
            messages_field=plan.messages_field, id_field=plan.id_field, batch_size=plan.batch_size,
        )  # fmt: skip
        for part in parts:
            supervised = part.supervised
            (ids, mask), offsets = select_rows(
                (part.input_ids, part.mask), part.offsets, np.flatnonzero(supervised)
            )
            writer.add(ids, mask, np.diff(offsets), part.sample_ids, supervised=supervised)
        record = writer.finish(rows=(start, stop))
        fsync_tree(tmp)
        os.rename(tmp, plan.shard_dir(shard))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(plan.build_dir, directory=True)
    return record


def _build_shards(
    plan: _Plan, shards: Sequence[int], *, num_proc: int, progress: Callable[[int, int], None] | None
) -> None:
    """Build the shards of `shards` that are not finished yet, `num_proc` processes at a time."""
    todo, done = [], 0
    for k in shards:
        if read_shard_record(plan.shard_dir(k), plan.rows_of(k)) is None:
            shutil.rmtree(plan.shard_dir(k), ignore_errors=True)  # a damaged finished shard: build again
            todo.append(k)
        else:
            done += plan.rows_of(k)[1] - plan.rows_of(k)[0]
    total = done + sum(plan.rows_of(k)[1] - plan.rows_of(k)[0] for k in todo)
    if progress is not None:
        progress(done, total)
    for k, _ in zip(todo, map_tasks(_build_shard, plan, todo, num_proc=num_proc), strict=True):
        done += plan.rows_of(k)[1] - plan.rows_of(k)[0]
        if progress is not None:
            progress(done, total)


def _build_dirs(dest: Path) -> list[Path]:
    return sorted(dest.parent.glob(f".{dest.name}.build-*")) if dest.parent.is_dir() else []


def _sweep(dest: Path, *, keep: Path | None = None) -> None:
    """Remove the build directories of `dest` but `keep` (hold `locked(dest)`), and `keep`'s temporary
    shards: only a lock holder creates either, so any found now is stale."""
    for directory in _build_dirs(dest):
        if directory != keep:
            shutil.rmtree(directory, ignore_errors=True)
    if keep is not None:
        for entry in keep.glob("tmp-*"):
            shutil.rmtree(entry, ignore_errors=True)


def _reusable(dest: Path, identity: dict[str, Any]) -> bool:
    """True when `dest` holds a complete store of `identity`; False when it holds nothing; else an error."""
    if not (dest / MANIFEST).is_file():
        if dest.is_dir() and any(dest.iterdir()):
            raise SubsetError(f"{dest}: directory is not empty and holds no token store ({MANIFEST})")
        return False
    recorded = read_complete_manifest(dest).get("identity")
    if recorded != identity:
        differences = identity_differences(recorded, identity)
        raise SubsetError(
            f"{dest}: the existing token store was built from another identity (existing vs requested: "
            f"{'; '.join(differences[:4])}{'; ...' if len(differences) > 4 else ''}); "
            "choose another output directory or delete this one"
        )
    return True


def _prepare(dest: Path, digest: str, options: dict[str, Any]) -> dict[str, Any]:
    """Under the lock: the build directory (created, swept) and the facts every rank builds with."""
    build_dir = dest.parent / f".{dest.name}.build-{digest[:16]}"
    _sweep(dest, keep=build_dir)
    build_dir.mkdir(exist_ok=True)
    tok = load_tokenizer(options["tokenizer"])
    vocab = len(tok)
    rows = len(_open_split(options["split_dir"]))
    return {"build_dir": str(build_dir), "rows": rows, "vocab_size": vocab, "pad_token_id": pad_token_id(tok)}


def _plan(options: dict[str, Any], facts: dict[str, Any]) -> _Plan:
    return _Plan(
        split_dir=options["split_dir"],
        build_dir=Path(facts["build_dir"]),
        tokenizer=options["tokenizer"],
        messages_field=options["messages_field"],
        id_field=options["id_field"],
        rows=facts["rows"],
        rows_per_shard=options["rows_per_shard"],
        batch_size=options["batch_size"],
        dtype=token_dtype(facts["vocab_size"]),
    )


def _publish(dest: Path, plan: _Plan, identity: dict[str, Any], facts: dict[str, Any]) -> None:
    """Assemble the finished shards into a transaction directory and publish it (hold `locked(dest)`)."""
    records = [read_shard_record(plan.shard_dir(k), plan.rows_of(k)) for k in range(plan.shards)]
    missing = [k for k, record in enumerate(records) if record is None]
    if missing:
        raise SubsetError(
            f"{plan.build_dir}: shards {missing[:8]} are missing after every rank built its own; is the "
            "build directory on a file system every rank shares?"
        )
    import tokenizers
    import transformers

    fields = {
        "identity": identity,
        "identity_sha256": identity_sha256(identity),
        "token_dtype": plan.dtype,
        "vocab_size": facts["vocab_size"],
        "pad_token_id": facts["pad_token_id"],
        "rows_per_shard": plan.rows_per_shard,
        "built_with": {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__},
    }
    with staging_dir(dest) as tmp:
        assemble_store(tmp, [plan.shard_dir(k) for k in range(plan.shards)], records, fields=fields)
    shutil.rmtree(plan.build_dir, ignore_errors=True)


def _process_group() -> Any:
    """`torch.distributed` when a process group is initialised (torch already imported), else None."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _build_here(
    dest: Path, identity: dict[str, Any], options: dict[str, Any], num_proc: int, progress: Any
) -> None:
    if _reusable(dest, identity) and not _build_dirs(dest):
        return
    with locked(dest):
        if _reusable(dest, identity):
            _sweep(dest)  # a run killed after publishing left its build directory
            return
        facts = _prepare(dest, identity_sha256(identity), options)
        plan = _plan(options, facts)
        _build_shards(plan, range(plan.shards), num_proc=num_proc, progress=progress)
        _publish(dest, plan, identity, facts)


def _collect(dist: Any, value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _raise_first(errors: list[Any], own: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank failed: its own error where it failed, else one naming the rank."""
    if own is not None:
        raise own
    for rank, error in enumerate(errors):
        if error is not None:
            raise SubsetError(f"rank {rank} failed {what}: {error}")


def _build_with_ranks(
    dist: Any, dest: Path, identity: dict[str, Any], options: dict[str, Any], num_proc: int, progress: Any
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    digest = identity_sha256(identity)
    digests = _collect(dist, digest)
    if len(set(digests)) != 1:
        raise ConfigError(
            f"the ranks ask for different token stores (identity hashes {sorted(set(digests))})"
        )
    with ExitStack() as lock:
        own: BaseException | None = None
        facts: dict[str, Any] | None = None
        if rank == 0:
            try:
                lock.enter_context(locked(dest))
                if _reusable(dest, identity):
                    _sweep(dest)
                else:
                    facts = _prepare(dest, digest, options)
            except Exception as exc:
                own = exc
        decision = [facts, None if own is None else f"{type(own).__name__}: {own}"]
        dist.broadcast_object_list(decision, src=0)
        _raise_first([decision[1]], own, "preparing the token store")
        facts = decision[0]
        if facts is not None:
            plan = _plan(options, facts)
            try:
                mine = [k for k in range(plan.shards) if k % world == rank]
                _build_shards(plan, mine, num_proc=num_proc, progress=progress)
            except Exception as exc:
                own = exc
            errors = _collect(dist, None if own is None else f"{type(own).__name__}: {own}")
            _raise_first(errors, own, "building its shards")
            if rank == 0:
                try:
                    _publish(dest, plan, identity, facts)
                except Exception as exc:
                    own = exc
            published = [None if own is None else f"{type(own).__name__}: {own}"]
            dist.broadcast_object_list(published, src=0)
            _raise_first(published, own, "publishing the token store")
    try:
        read_complete_manifest(dest)
    except SubsetError as exc:
        raise SubsetError(
            f"rank {rank}: the token store rank 0 published is not visible here ({exc})"
        ) from exc


def build_token_store(
    snapshot: str | Path,
    *,
    tokenizer: str | Path | Any,
    output: str | Path | None = None,
    cache_dir: str | Path | None = None,
    split: str = "train",
    num_proc: int = 1,
    messages_field: str = "messages",
    id_field: str | None = "uuid",
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    batch_size: int = 1024,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Build or reuse the token store of `split` of `snapshot` (see the module docstring); its path.

    Exactly one of ``output`` (the store directory) and ``cache_dir`` (the store goes to
    ``cache_dir/<identity hash>``). ``num_proc`` worker processes per rank; ``rows_per_shard`` rows per
    shard (part of the identity); ``batch_size`` rows rendered and encoded at a time. ``progress(done,
    total)`` is called with rows of this rank's shards as they finish (in this process).
    """
    if (output is None) == (cache_dir is None):
        raise ConfigError("give exactly one of output (the store directory) and cache_dir")
    num_proc = require_positive(num_proc, "num_proc", error=ConfigError)
    rows_per_shard = require_positive(rows_per_shard, "rows_per_shard", error=ConfigError)
    batch_size = require_positive(batch_size, "batch_size", error=ConfigError)
    identity = store_identity(
        snapshot, tokenizer=tokenizer, split=split, messages_field=messages_field, id_field=id_field,
        rows_per_shard=rows_per_shard,
    )  # fmt: skip
    dest = Path(os.path.abspath(output if output is not None else Path(cache_dir) / short_hash(identity)))
    options = {
        "split_dir": split_dir(snapshot, split).absolute(),
        "tokenizer": str(tokenizer) if isinstance(tokenizer, str | Path) else tokenizer,
        "messages_field": messages_field,
        "id_field": id_field,
        "rows_per_shard": rows_per_shard,
        "batch_size": batch_size,
    }
    dist = _process_group()
    if dist is None:
        _build_here(dest, identity, options, num_proc, progress)
    else:
        _build_with_ranks(dist, dest, identity, options, num_proc, progress)
    return dest

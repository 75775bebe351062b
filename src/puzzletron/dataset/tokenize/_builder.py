"""The one sharded-store builder: lock, build directory, shards in processes or on every rank, atomic
publication, reuse. The token store (`store`) and the VLM store (`vlm_store`) are two `ShardedBuild`s.

A `ShardedBuild` says what is format-specific: the facts rank 0 learns (`prepare`, before anything is
created), how many shards and which rows each covers, how one shard is written into an empty directory
(`write_shard`), how a finished shard's record is read back (`shard_record`), how the finished shards become
a store in a transaction directory (`assemble`), and what a complete store is (`complete`). Everything else
is here, once::

    dest/..  .<name>.lock                 flock: one builder per destination
             .<name>.build-<hash>/        shard-<k>/ (finished), tmp-<k>-<random>/ (being written)
             .<name>.txn-...              the transaction `publish` fills and renames to <name>

A build killed at any point publishes nothing; the rerun keeps the finished shards of its identity that are
exactly as they were written (each is sealed when finished, `storage.seals`: every file's size and xxh3_128;
a shard damaged since is built again), builds only the missing ones and sweeps the debris (a failed run
leaves no empty build directory). With
`torch.distributed` initialised the call is collective: rank 0 takes the lock and prepares, rank ``r``
builds shards ``k % world == r``, rank 0 publishes; a failure on any rank raises on every rank, naming it.

A store at an URL (``dest`` a string; the token store only) has no lock and no shared build directory: the
build overrides `build_dir` (a scratch folder of this process's own, held by `storage.scratch` while the
build runs), `claim` (the prefix claimed for the identity before anything is written), `keep_shard`
(upload), `finished_shards`, `existing_identity` and `publish` (`tokenize._remote_store`: the manifest
written once).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from puzzletron.dataset.distributed.collectives import (
    all_gather,
    broadcast,
    describe,
    process_group,
    raise_first,
)
from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.formats.manifest import MANIFEST
from puzzletron.dataset.formats.token_store import token_dtype
from puzzletron.dataset.storage.atomic import fsync_path, fsync_tree, locked, sibling_prefix, staging_dir
from puzzletron.dataset.storage.scratch import private_scratch
from puzzletron.dataset.storage.seals import seal_problem, write_seal
from puzzletron.dataset.tokenize._workers import map_tasks
from puzzletron.dataset.tokenize.identity import identity_differences

__all__ = ["ShardedBuild", "StoreFacts", "run_build"]

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreFacts:
    """What rank 0 learns under the lock and every rank builds with: the source's rows and the tokenizer's
    vocabulary size (the token dtype follows) and pad id."""

    rows: int
    vocab_size: int
    pad_token_id: int

    @property
    def dtype(self) -> str:
        return token_dtype(self.vocab_size)


class ShardedBuild(ABC):
    """One store build (picklable: worker processes receive it). Subclasses set ``dest`` (a directory, or
    an URL string where the format supports one), ``identity``, ``digest`` (its SHA-256), ``what``
    (``"token store"``) and ``rows_per_shard``, and implement the format's steps."""

    dest: Path | str
    identity: dict[str, Any]
    digest: str
    what: str
    rows_per_shard: int

    @property
    def remote(self) -> bool:
        return isinstance(self.dest, str)

    @property
    def build_dir(self) -> Path:
        """``<parent>/.<name>.build-<16 hex of the identity>`` (the name a digest when too long)."""
        dest = self.local_dest
        return dest.parent / f"{sibling_prefix(dest, 'build')}{self.digest[:16]}"

    @property
    def local_dest(self) -> Path:
        if isinstance(self.dest, str):
            raise ConfigError(f"a {self.what} is built in a local directory, not at {self.dest}")
        return self.dest

    def shard_dir(self, shard: int) -> Path:
        return self.build_dir / f"shard-{shard:06d}"

    @abstractmethod
    def complete(self) -> dict[str, Any]:
        """The manifest of the complete store at ``dest``; `SnapshotError` otherwise."""

    @abstractmethod
    def prepare(self) -> StoreFacts:
        """Under the lock, before anything is created (a usage error is said first): the facts every rank
        builds with."""

    def shard_rows(self, facts: StoreFacts) -> list[tuple[int, int]]:
        """The row range of every shard: fixed ranges of ``rows_per_shard`` (the last one may be short)."""
        per = self.rows_per_shard
        return [(a, min(a + per, facts.rows)) for a in range(0, facts.rows, per)]

    @abstractmethod
    def write_shard(self, facts: Any, shard: int, directory: Path) -> dict[str, Any]:
        """Write shard ``shard`` into the empty ``directory``; its record (written last)."""

    @abstractmethod
    def shard_record(self, directory: Path, rows: tuple[int, int]) -> dict[str, Any] | None:
        """The record of a finished shard covering ``rows``, or None (then it is built again)."""

    @abstractmethod
    def assemble(
        self, tmp: Path, shard_dirs: list[Path], records: list[dict[str, Any]], fields: Mapping[str, Any]
    ) -> None:
        """Write the store into the empty transaction directory ``tmp`` from the finished shards; ``fields``
        go into its manifest (`manifest_fields`)."""

    def manifest_fields(self, facts: StoreFacts) -> dict[str, Any]:
        """The manifest fields every sharded store has, plus the format's (override and extend)."""
        import tokenizers
        import transformers

        return {
            "identity": self.identity,
            "identity_sha256": self.digest,
            "token_dtype": facts.dtype,
            "vocab_size": facts.vocab_size,
            "pad_token_id": facts.pad_token_id,
            "rows_per_shard": self.rows_per_shard,
            "built_with": {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__},
        }

    def existing_identity(self) -> dict[str, Any] | None:
        """The identity of the complete store at ``dest``; None when nothing is there; `SnapshotError` for
        anything else there."""
        dest = self.local_dest
        if not (dest / MANIFEST).is_file():
            if dest.is_dir() and any(dest.iterdir()):
                raise SnapshotError(f"{dest}: directory is not empty and holds no {self.what} ({MANIFEST})")
            return None
        return self.complete().get("identity")

    def finished_shards(self, facts: Any, shards: Sequence[int]) -> set[int]:
        """Those of `shards` an earlier run finished, exactly as sealed (a shard damaged since, or one
        without its record, is removed: built again)."""
        rows, done = self.shard_rows(facts), set()
        for k in shards:
            directory = self.shard_dir(k)
            if not directory.is_dir():
                continue
            problem = seal_problem(directory)
            if problem is None and self.shard_record(directory, rows[k]) is None:
                problem = f"{directory}: no record of rows {rows[k]}"
            if problem is None:
                done.add(k)
                continue
            _LOG.warning("shard %d of %s is not reused, it is built again: %s", k, self.dest, problem)
            shutil.rmtree(directory, ignore_errors=True)
        return done

    def claim(self) -> None:
        """Claim ``dest`` for this identity before anything is written (object storage: a claim object,
        `storage.claims`); a local destination's lock does that already."""
        return None

    def release(self) -> None:
        """Release what `claim` took, after a clean failure."""
        return None

    def keep_shard(self, shard: int, tmp: Path, record: Mapping[str, Any]) -> None:
        """Make the shard written in `tmp` finished: synced, renamed ``shard-<k>``."""
        fsync_tree(tmp)
        os.rename(tmp, self.shard_dir(shard))
        fsync_path(self.build_dir, directory=True)

    def publish(self, facts: StoreFacts) -> None:
        """Assemble the finished shards in a transaction directory and publish it (hold the lock); then
        remove the build directory."""
        records = self.finished_records(facts)
        fields = self.manifest_fields(facts)
        with staging_dir(self.local_dest) as tmp:
            self.assemble(tmp, [self.shard_dir(k) for k in range(len(records))], records, fields)
        shutil.rmtree(self.build_dir, ignore_errors=True)

    def finished_records(self, facts: Any) -> list[dict[str, Any]]:
        """Every shard's record, in order; `SnapshotError` naming the missing ones."""
        rows = self.shard_rows(facts)
        records = [self.shard_record(self.shard_dir(k), r) for k, r in enumerate(rows)]
        missing = [k for k, record in enumerate(records) if record is None]
        if missing:
            raise SnapshotError(
                f"{self.build_dir}: shards {missing[:8]} are missing after every rank built its own; is the "
                "build directory on a file system every rank shares?"
            )
        return records  # type: ignore[return-value]


def _build_shard(context: tuple[ShardedBuild, Any], shard: int) -> dict[str, Any]:
    """Write shard `shard` into a temporary directory, keep it finished; return its record."""
    build, facts = context
    tmp = build.build_dir / f"tmp-{shard:06d}-{secrets.token_hex(8)}"
    tmp.mkdir(parents=build.remote)  # a remote build's scratch folder is this node's own
    try:
        record = build.write_shard(facts, shard, tmp)
        write_seal(tmp)  # what a rerun checks before it reuses the shard
        build.keep_shard(shard, tmp, record)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _build_shards(
    build: ShardedBuild,
    facts: Any,
    shards: Sequence[int],
    *,
    num_proc: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Build the shards of `shards` that are not finished yet, `num_proc` processes at a time."""
    rows = build.shard_rows(facts)
    finished = build.finished_shards(facts, shards)
    todo = [k for k in shards if k not in finished]
    done = sum(rows[k][1] - rows[k][0] for k in finished)
    total = done + sum(rows[k][1] - rows[k][0] for k in todo)
    if progress is None:
        deque(map_tasks(_build_shard, (build, facts), todo, num_proc=num_proc), maxlen=0)
        return
    progress(done, total)

    def rows_done(n: int) -> None:  # the shard writers report rows with `advance` as they write them
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


def _drop_if_empty(build: ShardedBuild) -> None:
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


def _reusable(build: ShardedBuild) -> bool:
    """True when the destination holds a complete store of this identity; False when it holds nothing;
    else an error."""
    recorded = build.existing_identity()
    if recorded is None:
        return False
    if recorded != build.identity:
        differences = identity_differences(recorded, build.identity)
        raise SnapshotError(
            f"{build.dest}: the existing {build.what} was built from another identity (existing vs "
            f"requested: {'; '.join(differences[:4])}{'; ...' if len(differences) > 4 else ''}); "
            "choose another output directory or delete this one"
        )
    return True


def _prepare(build: ShardedBuild) -> Any:
    """The facts to build with, None when a store of this identity was published meanwhile (object
    storage: another build of it finished while this one claimed the prefix)."""
    facts = build.prepare()  # a usage error is said before anything is created
    if build.remote:
        build.claim()
        if _reusable(build):
            return None
    else:
        _sweep(build.local_dest, keep=build.build_dir)
    build.build_dir.mkdir(parents=build.remote, exist_ok=True)
    return facts


def _build_all(build: ShardedBuild, num_proc: int, progress: Any) -> None:
    facts = _prepare(build)
    if facts is None:
        return
    _build_shards(build, facts, range(len(build.shard_rows(facts))), num_proc=num_proc, progress=progress)
    build.publish(facts)


def _released(build: ShardedBuild) -> None:
    """After a clean failure on object storage: the claim released (best effort), the scratch removed."""
    try:
        build.release()
    except Exception as exc:  # the failure being raised is what the caller must see
        _LOG.warning("could not release the claim on %s: %s", build.dest, exc)
    _drop_if_empty(build)


def _build_here(build: ShardedBuild, num_proc: int, progress: Any) -> None:
    if build.remote:  # no lock on object storage: a claim object, the manifest written once
        if _reusable(build):
            return
        try:
            _build_all(build, num_proc, progress)
        except Exception:
            _released(build)
            raise
        finally:
            _drop_if_empty(build)
        return
    dest = build.local_dest
    if _reusable(build) and not _build_dirs(dest):
        return
    with locked(dest):
        if _reusable(build):
            _sweep(dest)  # a run killed after publishing left its build directory
            return
        try:
            _build_all(build, num_proc, progress)
        except BaseException:
            _drop_if_empty(build)
            raise


def _build_with_ranks(dist: Any, build: ShardedBuild, num_proc: int, progress: Any) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    digests = all_gather(dist, build.digest)
    if len(set(digests)) != 1:
        raise ConfigError(
            f"the ranks ask for different {build.what}s (identity hashes {sorted(set(digests))})"
        )
    places = all_gather(dist, str(build.dest))
    if len(set(places)) != 1:
        raise SnapshotError(
            f"the ranks locate this {build.what} at different paths ({sorted(set(places))}): is the cache "
            "directory one file system every rank sees?"
        )
    with ExitStack() as lock:
        own: BaseException | None = None
        facts: Any = None
        if rank == 0:
            try:
                if not build.remote:  # object storage: a claim object instead (`_prepare`)
                    lock.enter_context(locked(build.local_dest))
                if not _reusable(build):
                    facts = _prepare(build)
                elif not build.remote:
                    _sweep(build.local_dest)
            except Exception as exc:
                own = exc
                if build.remote:
                    _released(build)
                _drop_if_empty(build)
        facts, failed = broadcast(dist, (facts, describe(own)))
        raise_first([failed], own, f"preparing the {build.what}", error=SnapshotError)
        if facts is not None:
            try:
                mine = [k for k in range(len(build.shard_rows(facts))) if k % world == rank]
                _build_shards(build, facts, mine, num_proc=num_proc, progress=progress)
            except Exception as exc:
                own = exc
            errors = all_gather(dist, describe(own))
            if rank == 0 and build.remote and any(errors):
                _released(build)
            raise_first(errors, own, "building its shards", error=SnapshotError)
            if rank == 0:
                try:
                    build.publish(facts)
                except Exception as exc:
                    own = exc
                    if build.remote:
                        _released(build)
            published = broadcast(dist, describe(own))
            if build.remote:
                _drop_if_empty(build)
            raise_first([published], own, f"publishing the {build.what}", error=SnapshotError)
    try:
        build.complete()
    except SnapshotError as exc:
        raise SnapshotError(
            f"rank {rank}: the {build.what} rank 0 published is not visible here ({exc})"
        ) from exc


def run_build(
    build: ShardedBuild, *, num_proc: int, progress: Callable[[int, int], None] | None
) -> Path | str:
    """Build or reuse ``build.dest`` (collective when a process group is initialised); its path (or URL)."""
    dist = process_group()
    with private_scratch(build.build_dir) if build.remote else nullcontext():
        if dist is None:
            _build_here(build, num_proc, progress)
        else:
            _build_with_ranks(dist, build, num_proc, progress)
    return build.dest

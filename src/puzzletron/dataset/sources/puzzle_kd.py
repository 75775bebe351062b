"""Puzzle-KD: a bounded, seeded, pinned text snapshot of the ``train`` and ``validation`` splits.

Rows come from the parquet shards of each split (``docs/sources.md``), whole shards in a seeded order,
row groups in a seeded order, rows shuffled within each; only the shards needed are downloaded. The
snapshot is written by `formats.text_snapshot` (``docs/text-snapshot-format.md``).
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from puzzletron.dataset.conversation import ROLES
from puzzletron.dataset.errors import AcquisitionError, ConversationError, SnapshotError
from puzzletron.dataset.formats.manifest import MANIFEST
from puzzletron.dataset.formats.text_snapshot import read_text_snapshot, write_text_snapshot
from puzzletron.dataset.sources import hub as _hub
from puzzletron.dataset.sources._common import check_reusable, nonempty, parquet_shards, progress
from puzzletron.dataset.sources.specs import TextAcquisitionSpec
from puzzletron.dataset.storage.atomic import locked, staging_dir, tidy

__all__ = ["materialize_puzzle_kd_dataset"]

logger = logging.getLogger(__name__)


def _shortfall(source: str, revision: str, split: str, have: int, count: int, where: str) -> AcquisitionError:
    return AcquisitionError(
        f"{source}@{revision} split {split!r}: only {have}/{count} rows{where}; ask for fewer samples"
    )


def _concat(parts: list[pa.Table], source: str, revision: str, split: str) -> pa.Table:
    try:
        return pa.concat_tables(parts).combine_chunks()
    except pa.ArrowException as exc:
        raise AcquisitionError(
            f"{source}@{revision} split {split!r}: the shards do not share one schema ({exc})"
        ) from exc


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _first(mask: pa.Array) -> int | None:
    """The first index where the boolean `mask` is true (nulls count as false), or None."""
    hits = pc.indices_nonzero(pc.fill_null(mask, False))
    return int(hits[0].as_py()) if len(hits) else None


def _check_messages(table: pa.Table, where: str) -> None:
    """Refuse rows without the Puzzle-KD ``messages`` structure (``docs/sources.md``): a column of non-empty
    lists of ``{role, content}`` strings, roles ``system``/``user``/``assistant``. Said here, naming the row,
    rather than at tokenisation; a source is Hub data, not trusted (``docs/trust-model.md``)."""
    if "messages" not in table.column_names:
        raise ConversationError(
            f"{where}: no 'messages' column (columns {table.column_names}); not the Puzzle-KD schema"
        )
    kind = table.schema.field("messages").type
    item = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) else None
    names = {f.name: f.type for f in item} if item is not None and pa.types.is_struct(item) else {}
    if not all(name in names and _is_text(names[name]) for name in ("role", "content")):
        raise ConversationError(
            f"{where}: column 'messages' is {kind}; expected list<struct<role: string, content: string>>"
        )
    messages = table.column("messages").combine_chunks()
    row = _first(pc.or_kleene(pc.is_null(messages), pc.equal(pc.list_value_length(messages), 0)))
    problem = "has no messages"
    if row is None:
        turns = pc.list_flatten(messages)
        owner = pc.list_parent_indices(messages)
        roles, contents = pc.struct_field(turns, "role"), pc.struct_field(turns, "content")
        for mask, what in (
            (
                pc.invert(pc.fill_null(pc.is_in(roles, value_set=pa.array(ROLES)), False)),
                "a turn whose role is not one of system, user, assistant",
            ),
            (pc.is_null(contents), "a turn without content"),
        ):
            turn = _first(mask)
            if turn is not None:
                row, problem = int(owner[turn].as_py()), f"has {what}"
                break
    if row is not None:
        uuid = table.column("uuid")[row].as_py() if "uuid" in table.column_names else None
        raise ConversationError(f"{where}: row {row} (uuid {uuid!r}) {problem}; not the Puzzle-KD schema")


def _hub_split_table(source: str, split: str, revision: str, seed: int, count: int) -> pa.Table:
    """`count` rows of `split`, shuffled with `seed`: shards in a seeded order, row groups in a seeded
    order, rows shuffled within each; only the shards needed are downloaded."""
    rng = random.Random(seed)
    shards = parquet_shards(source, revision, split)
    rng.shuffle(shards)
    parts, have = [], 0
    for shard in shards:
        path = _hub.download(source, shard, revision)
        for table in _hub.iter_parquet_tables(path, rng=rng):
            take = min(table.num_rows, count - have)
            parts.append(table.slice(0, take))
            have += take
            progress(split, take, count)
            if have == count:
                return _concat(parts, source, revision, split)
    raise _shortfall(source, revision, split, have, count, f" in {len(shards)} shard(s)")


def _loader_table(
    loader: Callable[..., Iterable[Mapping[str, Any]]],
    source: str,
    split: str,
    revision: str,
    seed: int,
    count: int,
) -> pa.Table:
    rows = [
        dict(r)
        for r in itertools.islice(iter(loader(source, split=split, revision=revision, seed=seed)), count)
    ]
    if len(rows) < count:
        raise _shortfall(source, revision, split, len(rows), count, "")
    try:
        return pa.Table.from_pylist(rows)
    except pa.ArrowException as exc:
        raise AcquisitionError(
            f"{source}@{revision} split {split!r}: the loader's rows have different shapes ({exc})"
        ) from exc


def materialize_puzzle_kd_dataset(
    spec: TextAcquisitionSpec,
    *,
    dataset_loader: Callable[..., Iterable[Mapping[str, Any]]] | None = None,
    revision_resolver: Callable[[str, str | None], str] = _hub.resolve_revision,
) -> dict[str, Any]:
    """Materialize bounded Puzzle-KD train/validation splits for offline tokenization.

    Writes a text snapshot (``docs/text-snapshot-format.md``): ``output_dir/{train,validation}/``
    (``datasets.load_from_disk`` reads it back as a ``DatasetDict``) and ``output_dir/manifest.json``;
    returns the manifest. A complete snapshot of the same identity is reused (its listed files there with
    their sizes); `formats.text_snapshot.verify_text_snapshot` checks every SHA-256. ``train`` is shuffled
    with ``seed``, ``validation`` with ``seed + 1``. `dataset_loader(source, *, split, revision, seed)` may
    replace the Hub reader; it yields row mappings already in the order to keep.
    """
    out = Path(spec.output_dir)
    if (out / MANIFEST).is_file():  # a published snapshot is complete: read without a lock (read-only mounts)
        manifest = read_text_snapshot(out)
        check_reusable(manifest.get("acquisition", {}), spec, revision_resolver, out)
        logger.info("reusing Puzzle-KD snapshot at %s", out)
        tidy(out)
        return manifest
    if nonempty(out):
        raise SnapshotError(
            f"{out}: directory is not empty and holds no complete Puzzle-KD snapshot ({MANIFEST})"
        )
    revision = revision_resolver(spec.source, spec.revision)
    identity = spec.identity(revision=revision)
    with locked(out):
        if (out / MANIFEST).is_file():  # another process published it while we resolved
            return materialize_puzzle_kd_dataset(
                spec, dataset_loader=dataset_loader, revision_resolver=revision_resolver
            )
        with staging_dir(out) as tmp:
            tables = {}
            for split, count, seed in (
                ("train", spec.train_samples, spec.seed),
                ("validation", spec.validation_samples, spec.seed + 1),
            ):
                if dataset_loader is None:
                    tables[split] = _hub_split_table(spec.source, split, revision, seed, count)
                else:
                    tables[split] = _loader_table(dataset_loader, spec.source, split, revision, seed, count)
                _check_messages(tables[split], f"{spec.source}@{revision} split {split!r}")
            manifest = write_text_snapshot(tmp, tables, acquisition=identity)
    logger.info("published Puzzle-KD snapshot %s@%s at %s", spec.source, revision, out)
    return manifest

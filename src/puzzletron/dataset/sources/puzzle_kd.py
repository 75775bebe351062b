"""Puzzle-KD: a bounded, seeded, pinned text snapshot of the ``train`` and ``validation`` splits.

Rows come from the parquet shards of each split (``docs/sources.md``), whole shards in a seeded order,
row groups in a seeded order, rows shuffled within each; only the shards needed are downloaded. The
snapshot is written by `formats.text_snapshot` (``docs/text-snapshot-format.md``).

A row is Hub data (``docs/trust-model.md``): one whose text is not valid UTF-8, or with a turn longer than
``spec.max_turn_bytes`` or more text than ``spec.max_row_bytes``, is rejected alone (`_screen`), recorded in
the manifest's ``diagnostics.rejected_rows`` and replaced by the next row, so what is published always
decodes. A split whose schema is not Puzzle-KD's fails whole (`_check_messages`).
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
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


def _text_sizes(table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(bytes of each turn's content, the row of each turn, row offsets into the turns)`` of a
    ``messages`` column of ``{role, content}`` strings; None for another shape (`_check_messages` says)."""
    if "messages" not in table.column_names:
        return None
    kind = table.schema.field("messages").type
    item = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) else None
    if item is None or not pa.types.is_struct(item) or item.get_field_index("content") < 0:
        return None
    if not _is_text(item.field("content").type):
        return None
    messages = table.column("messages").combine_chunks()
    turns = pc.list_flatten(messages)
    sizes = pc.fill_null(pc.binary_length(pc.struct_field(turns, "content")), 0).to_numpy().astype(np.int64)
    owner = pc.list_parent_indices(messages).to_numpy().astype(np.int64)
    offsets = np.asarray(messages.offsets, dtype=np.int64) - int(messages.offsets[0].as_py())
    return sizes, owner, offsets


def _row_id(table: pa.Table, row: int) -> Any:
    if "uuid" not in table.column_names:
        return None
    try:
        return table.column("uuid")[row].as_py()
    except (UnicodeDecodeError, pa.ArrowException):
        return None


def _screen(
    table: pa.Table, spec: TextAcquisitionSpec, split: str, shard: str, rejected: list[dict[str, Any]]
) -> pa.Table:
    """`table` without its rows that are not valid UTF-8 or exceed the spec's size bounds; each rejected
    row recorded in `rejected` (``{split, shard, uuid, reason}``)."""
    reasons: dict[int, str] = {}
    try:
        table.validate(full=True)
    except pa.ArrowInvalid:  # rare: find the rows, one at a time (a slice validates its parents' buffers)
        for row in range(table.num_rows):
            try:
                table.slice(row, 1).to_pylist()
            except UnicodeDecodeError:
                reasons[row] = "its text is not valid UTF-8"
    found = _text_sizes(table)
    if found is not None:
        sizes, owner, offsets = found
        for turn in np.flatnonzero(sizes > spec.max_turn_bytes).tolist():
            row = int(owner[turn])
            reasons.setdefault(
                row,
                f"turn {turn - int(offsets[row])} has {int(sizes[turn])} bytes of text; the bound is "
                f"{spec.max_turn_bytes} (max_turn_bytes)",
            )
        totals = np.bincount(owner, weights=sizes, minlength=table.num_rows).astype(np.int64)
        for row in np.flatnonzero(totals > spec.max_row_bytes).tolist():
            reasons.setdefault(
                row,
                f"the row has {int(totals[row])} bytes of text; the bound is {spec.max_row_bytes} "
                "(max_row_bytes)",
            )
    if not reasons:
        return table
    for row, reason in sorted(reasons.items()):
        rejected.append({"split": split, "shard": shard, "uuid": _row_id(table, row), "reason": reason})
        logger.info("rejected %s row %d of %s: %s", split, row, shard, reason)
    keep = np.setdiff1d(np.arange(table.num_rows), np.fromiter(reasons, np.int64, len(reasons)))
    return table.take(pa.array(keep, type=pa.int64()))


@dataclass(frozen=True)
class _Want:
    """What one split of a snapshot asks for: `count` rows of `split` at `revision`, shuffled with `seed`."""

    spec: TextAcquisitionSpec
    split: str
    revision: str
    seed: int
    count: int


def _hub_split_table(want: _Want, rejected: list[dict[str, Any]]) -> pa.Table:
    """`count` rows of `split`, shuffled with `seed`: shards in a seeded order, row groups in a seeded
    order, rows shuffled within each, rows that fail `_screen` left out; only the shards needed are
    downloaded."""
    spec, split, revision, seed, count = want.spec, want.split, want.revision, want.seed, want.count
    source = spec.source
    rng = random.Random(seed)
    shards = parquet_shards(source, revision, split)
    rng.shuffle(shards)
    parts, have = [], 0
    for shard in shards:
        path = _hub.download(source, shard, revision)
        for table in _hub.iter_parquet_tables(path, rng=rng):
            table = _screen(table, spec, split, shard, rejected)
            take = min(table.num_rows, count - have)
            parts.append(table.slice(0, take))
            have += take
            progress(split, take, count)
            if have == count:
                return _concat(parts, source, revision, split)
    raise _shortfall(source, revision, split, have, count, f" in {len(shards)} shard(s)")


def _loader_table(
    loader: Callable[..., Iterable[Mapping[str, Any]]], want: _Want, rejected: list[dict[str, Any]]
) -> pa.Table:
    """`count` rows from the injected loader, rows that fail `_screen` left out (more are taken)."""
    spec, split, revision, seed, count = want.spec, want.split, want.revision, want.seed, want.count
    source = spec.source
    rows_in = iter(loader(source, split=split, revision=revision, seed=seed))
    parts, have = [], 0
    while have < count:
        rows = [dict(r) for r in itertools.islice(rows_in, count - have)]
        if not rows:
            raise _shortfall(source, revision, split, have, count, "")
        try:
            table = pa.Table.from_pylist(rows)
        except pa.ArrowException as exc:
            raise AcquisitionError(
                f"{source}@{revision} split {split!r}: the loader's rows have different shapes ({exc})"
            ) from exc
        table = _screen(table, spec, split, "dataset_loader", rejected)
        parts.append(table)
        have += table.num_rows
    return _concat(parts, source, revision, split)


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
            tables, rejected = {}, []
            for split, count, seed in (
                ("train", spec.train_samples, spec.seed),
                ("validation", spec.validation_samples, spec.seed + 1),
            ):
                want = _Want(spec, split, revision, seed, count)
                if dataset_loader is None:
                    tables[split] = _hub_split_table(want, rejected)
                else:
                    tables[split] = _loader_table(dataset_loader, want, rejected)
                _check_messages(tables[split], f"{spec.source}@{revision} split {split!r}")
            diagnostics = {"rejected_rows": rejected} if rejected else None
            manifest = write_text_snapshot(tmp, tables, acquisition=identity, diagnostics=diagnostics)
    logger.info("published Puzzle-KD snapshot %s@%s at %s", spec.source, revision, out)
    return manifest

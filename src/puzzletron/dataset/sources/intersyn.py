"""InterSyn: the pinned 8+8 acceptance set of single-turn and multi-turn image conversations.

Rows come from the parquet shards in file order, their ``Image`` structs ``{bytes, path}`` read as stored
(``docs/sources.md``); the first `rows_per_source` rows of each source that normalise and whose images
decode are kept. The snapshot is a conversation subset (``docs/subset-format.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from puzzletron.dataset._checks import require_int
from puzzletron.dataset.conversation import INTERSYN_MULTI_DATASET as INTERSYN_MULTI_SOURCE
from puzzletron.dataset.conversation import (
    INTERSYN_MULTI_REVISION,
    INTERSYN_SINGLE_REVISION,
    normalize_intersyn_multi,
    normalize_intersyn_single,
)
from puzzletron.dataset.conversation import INTERSYN_SINGLE_DATASET as INTERSYN_SINGLE_SOURCE
from puzzletron.dataset.errors import AcquisitionError, ConfigError
from puzzletron.dataset.formats.subset.writer import materialize_normalized_conversation_samples
from puzzletron.dataset.sources import hub as _hub
from puzzletron.dataset.sources._common import RejectedRow, parquet_shards, progress, screen
from puzzletron.dataset.sources.specs import output_path

__all__ = ["INTERSYN_ADAPTER", "intersyn_acquisition", "materialize_intersyn_subset"]

INTERSYN_ADAPTER = "intersyn_v1"

_Source = tuple[str, str, str, Callable[[Mapping[str, Any]], dict[str, Any]]]


def _hub_parquet_rows(source: str, *, split: str, revision: str) -> Iterator[dict[str, Any]]:
    """Rows of `split` in file order (shards sorted, row groups in order); one shard downloaded at a time."""
    for shard in parquet_shards(source, revision, split):
        path = _hub.download(source, shard, revision)
        for table in _hub.iter_parquet_tables(path):
            yield from table.to_pylist()


def _from(
    source: str, revision: str, normalize: Callable[[Mapping[str, Any]], dict[str, Any]]
) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """`normalize`, with the sample's source set to what was read (so image errors name it too)."""

    def normalized(row: Mapping[str, Any]) -> dict[str, Any]:
        sample = normalize(row)
        sample["source"]["dataset"] = source
        sample["source"]["revision"] = revision
        return sample

    return normalized


def _intersyn_samples(
    sources: Sequence[_Source],
    rows_per_source: int,
    loader: Callable[..., Iterable[Mapping[str, Any] | RejectedRow]],
    diagnostics: dict[str, Any],
) -> Iterator[dict[str, Any]]:
    for source, split, revision, normalize in sources:
        kept = 0
        for row in loader(source, split=split, revision=revision):
            sample, row_id, reason = screen(row, _from(source, revision, normalize))
            if sample is None:
                diagnostics["rejected_rows"].append({"dataset": source, "row_id": row_id, "reason": reason})
                continue
            kept += 1
            diagnostics["materialized_rows"][source] = kept
            progress("samples", 1, 2 * rows_per_source)
            yield sample
            if kept == rows_per_source:
                break
        if kept < rows_per_source:
            raise AcquisitionError(
                f"{source}@{revision} split {split!r}: only {kept}/{rows_per_source} valid rows "
                f"({sum(r['dataset'] == source for r in diagnostics['rejected_rows'])} rejected); "
                "ask for fewer rows_per_source"
            )


def intersyn_acquisition(
    *,
    rows_per_source: int = 8,
    single_turn_source: str = INTERSYN_SINGLE_SOURCE,
    single_turn_revision: str = INTERSYN_SINGLE_REVISION,
    multi_turn_source: str = INTERSYN_MULTI_SOURCE,
    multi_turn_revision: str = INTERSYN_MULTI_REVISION,
) -> dict[str, Any]:
    """The ``acquisition`` an InterSyn subset of these arguments records (what its reuse compares whole)."""
    rows_per_source = require_int(
        rows_per_source, "materialize_intersyn_subset.rows_per_source", minimum=1, error=ConfigError
    )
    return {
        "adapter": INTERSYN_ADAPTER,
        "rows_per_source": rows_per_source,
        "sources": [
            {"dataset": single_turn_source, "split": "train", "revision": single_turn_revision},
            {"dataset": multi_turn_source, "split": "multi", "revision": multi_turn_revision},
        ],
    }


def materialize_intersyn_subset(
    output_dir: str | Path,
    *,
    rows_per_source: int = 8,
    dataset_loader: Callable[..., Iterable[Mapping[str, Any] | RejectedRow]] | None = None,
    single_turn_source: str = INTERSYN_SINGLE_SOURCE,
    single_turn_revision: str = INTERSYN_SINGLE_REVISION,
    multi_turn_source: str = INTERSYN_MULTI_SOURCE,
    multi_turn_revision: str = INTERSYN_MULTI_REVISION,
    media: str = "files",
) -> dict[str, Any]:
    """Download once, validate, and cache the pinned 8+8 InterSyn acceptance set.

    Keeps the first `rows_per_source` rows of ``single_turn`` (split ``train``) and then of
    ``multi-turn`` (split ``multi``) that normalise and whose images decode; rejected rows (and
    `RejectedRow`s a loader yields) go to the manifest's ``diagnostics``. A subset built with another
    `rows_per_source` (or other sources or revisions) is never returned: that is a `SnapshotError` (a
    ``ValueError``), raised before any request. `dataset_loader(source, *, split, revision)` may replace
    the Hub reader. ``media="shards"`` writes the images into media shards (``docs/media-shard-format.md``).
    """
    acquisition = intersyn_acquisition(
        rows_per_source=rows_per_source, single_turn_source=single_turn_source,
        single_turn_revision=single_turn_revision, multi_turn_source=multi_turn_source,
        multi_turn_revision=multi_turn_revision,
    )  # fmt: skip
    rows_per_source = acquisition["rows_per_source"]  # checked there
    output_dir = output_path(output_dir, "materialize_intersyn_subset.output_dir")
    normalizers = (normalize_intersyn_single, normalize_intersyn_multi)
    sources: list[_Source] = [
        (s["dataset"], s["split"], s["revision"], normalize)
        for s, normalize in zip(acquisition["sources"], normalizers, strict=True)
    ]
    diagnostics: dict[str, Any] = {
        "rejected_rows": [],
        "materialized_rows": {s: 0 for s, *_ in sources},
    }
    # Lazy: the subset writer compares `acquisition` with a snapshot already there before pulling a row.
    samples = _intersyn_samples(sources, rows_per_source, dataset_loader or _hub_parquet_rows, diagnostics)
    return materialize_normalized_conversation_samples(
        samples,
        output_dir,
        acquisition=acquisition,
        diagnostics=diagnostics,
        expected_count=2 * rows_per_source,
        media=media,
    )

"""What the three sources share: progress records, parquet shard listing, the reuse check, rows a loader
rejects (`RejectedRow`) and the screening of a raw row into a validated sample.

The Hub layouts these rely on: ``docs/sources.md``.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from puzzletron.dataset.config import MAX_ROW_BYTES, MAX_TURN_BYTES
from puzzletron.dataset.conversation.images import encode_image
from puzzletron.dataset.errors import AcquisitionError, ConversationError
from puzzletron.dataset.formats.manifest import acquisition_mismatch, differing_keys
from puzzletron.dataset.sources import hub as _hub

__all__ = [
    "PROGRESS_LOGGER",
    "RejectedRow",
    "check_reusable",
    "nonempty",
    "parquet_shards",
    "progress",
    "screen",
]

PROGRESS_LOGGER = "puzzletron.dataset.sources.progress"  # the CLI turns its records into tqdm bars
_progress_logger = logging.getLogger(PROGRESS_LOGGER)


@dataclass(frozen=True)
class RejectedRow:
    """A source row a loader could not turn into a usable row, yielded in its place: the materialiser
    records ``row_id`` and ``reason`` in ``diagnostics.rejected_rows`` and goes on."""

    row_id: Any
    reason: str


def progress(stage: str, advance: int, total: int) -> None:
    """A DEBUG record a progress display may follow (``extra={"progress": (stage, advance, total)}``)."""
    _progress_logger.debug(
        "%s: +%d of %d", stage, advance, total, extra={"progress": (stage, advance, total)}
    )


def nonempty(path: Path) -> bool:
    """Whether `path` is a directory with anything in it."""
    return path.is_dir() and any(path.iterdir())


def _glob(path: str, pattern: str) -> bool:
    """Whether the parquet file `path` is named by a ``data_files`` entry (a glob or a folder).

    >>> _glob("data/train-00000.parquet", "data/train-*"), _glob("data/x/a.parquet", "data/x")
    (True, True)
    """
    if not path.endswith(".parquet"):
        return False
    return fnmatch.fnmatchcase(path, pattern) or path.startswith(pattern.rstrip("/") + "/")


def parquet_shards(source: str, revision: str, split: str) -> list[str]:
    """The parquet files of `split` at `revision`, sorted: those the README ``configs:`` block names for
    it, else ``data/<split>-*.parquet`` (``docs/sources.md``)."""
    patterns = _hub.split_patterns(source, revision).get(split) or [f"data/{split}-*.parquet"]
    files = _hub.list_files(source, revision)
    shards = sorted({f for f in files for p in patterns if _glob(f, p)})
    if not shards:
        raise AcquisitionError(
            f"{source}@{revision} on {_hub.endpoint()}: no parquet files for split {split!r} "
            f"(patterns {patterns}); check the source and revision"
        )
    return shards


def check_reusable(
    recorded: Any, spec: Any, revision_resolver: Callable[[str, str | None], str], where: Path | str
) -> None:
    """Raise unless the snapshot at `where`, recorded with the acquisition `recorded`, is what `spec` asks
    for. With ``spec.revision`` None the pinned revision is kept (no network); otherwise it is resolved
    and must be the pinned one."""
    pinned = recorded.get("revision") if isinstance(recorded, Mapping) else None
    wanted = spec.identity(revision=str(pinned))
    differs = differing_keys(recorded, wanted, ignore=("revision",))
    if not differs and spec.revision is not None:
        revision = revision_resolver(spec.source, spec.revision)
        if revision != pinned:
            differs, wanted = ["revision"], spec.identity(revision=revision)
    if differs:
        raise acquisition_mismatch(where, recorded, wanted, differs)


def _reason(exc: BaseException) -> str:
    """An error message fit for a manifest: no memory addresses (they would break byte-identical reruns).

    >>> _reason(ValueError("cannot identify image file <_io.BytesIO object at 0x7f3a2c>"))
    'cannot identify image file <_io.BytesIO object>'
    """
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(exc))


def _check_images(sample: dict[str, Any]) -> None:
    """Decode every image of `sample` fully, replacing each item's value with its `EncodedImage` (the
    materialiser stores that as it is, without decoding the image a second time); raise `ImageError` (a
    `ConversationError`) naming the row and image on the first defect.

    The row came from a Hub repository: its image must be bytes it carried or joined from the files
    downloaded with it; a path (or a struct with only a path) is refused with the one uniform
    `HUB_REFERENCE_REASON`, without looking at the local file system (``docs/trust-model.md``)."""
    where = f"{sample['source']['dataset']} row {sample['source'].get('row_id')!r}"
    index = 0
    for turn in sample["conversation"]:
        for item in turn["content"]:
            if item.get("type") == "image":
                item["image"] = encode_image(item["image"], where=f"{where} image {index}", local_paths=False)
                index += 1


def _recordable(row_id: Any) -> Any:
    """A row id fit for ``diagnostics.rejected_rows``: a string, an int or None as it is, anything else
    (bytes, a float, a structure from a hostile row) as a short ``repr``.

    >>> _recordable("r1"), _recordable(7), _recordable(b"x"), _recordable(True)
    ('r1', 7, "b'x'", 'True')
    """
    if (
        row_id is None
        or isinstance(row_id, str)
        or (isinstance(row_id, int) and not isinstance(row_id, bool))
    ):
        return row_id
    return repr(row_id)[:80]


def _check_text(sample: dict[str, Any], max_turn_bytes: int, max_row_bytes: int) -> None:
    """Refuse (`ConversationError`) text that is not text (a lone surrogate from a ``\\ud800`` escape) or
    a turn or row over the size bounds (UTF-8 bytes of its text items)."""
    total = 0
    for t, turn in enumerate(sample["conversation"]):
        size = 0
        for item in turn["content"]:
            text = item.get("text") if item.get("type") == "text" else None
            if isinstance(text, str):
                try:
                    size += len(text.encode("utf-8"))
                except UnicodeEncodeError as exc:
                    raise ConversationError(
                        f"turn {t} holds {text[exc.start : exc.end]!r}, a lone surrogate, which is not text"
                    ) from None
        if size > max_turn_bytes:
            raise ConversationError(
                f"turn {t} has {size} bytes of text; the bound is {max_turn_bytes} (max_turn_bytes)"
            )
        total += size
    if total > max_row_bytes:
        raise ConversationError(
            f"the row has {total} bytes of text; the bound is {max_row_bytes} (max_row_bytes)"
        )


def screen(
    row: Any,
    normalize: Callable[[Any], dict[str, Any]],
    *,
    max_turn_bytes: int = MAX_TURN_BYTES,
    max_row_bytes: int = MAX_ROW_BYTES,
) -> tuple[dict[str, Any] | None, Any, str | None]:
    """``(sample, row_id, None)`` for a row that normalises, whose text is text within the size bounds and
    whose images decode, else ``(None, row_id, reason)``; a `RejectedRow` keeps the loader's reason. Every
    row is Hub data (whichever loader produced it): no local file is read for it."""
    if isinstance(row, RejectedRow):
        return None, _recordable(row.row_id), row.reason
    row_id = _recordable(row.get("id") if isinstance(row, Mapping) else None)
    try:
        sample = normalize(row)
        _check_text(sample, max_turn_bytes, max_row_bytes)
        _check_images(sample)
    except ConversationError as exc:
        return None, row_id, _reason(exc)
    except RecursionError:  # a row from an injected loader nested deeper than Python can copy
        return None, row_id, "the row nests values too deep to be read"
    return sample, row_id, None

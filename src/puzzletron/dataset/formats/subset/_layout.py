"""The names, constants and small helpers the conversation subset's writer, reader and verifier share.

Layout (``docs/subset-format.md``)::

    <dir>/manifest.json      counts, sources, one record per image, file sizes and SHA-256s
    <dir>/samples.jsonl      one normalised sample per line (sorted keys), image items hold relative paths
    <dir>/samples.idx        binary: header, N+1 little-endian u64 line offsets, N u32 source-group ids
    <dir>/images/<sample:06d>_<image:02d>.<ext>   the image bytes as they came (or PNG when they had none)

or, version 3 (``media="shards"``), the same images in media shards (``docs/media-shard-format.md``) under
``<dir>/media/``, each image item and record keeping that name (``images/000000_00.jpg``) as its name in
the subset, not a file.
"""

from __future__ import annotations

import array
import json
import struct
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from puzzletron.dataset.errors import SnapshotError

__all__ = [
    "IDX_HEADER",
    "IDX_MAGIC",
    "IMAGES",
    "INDEX",
    "LEGACY_SAMPLES",
    "SAMPLES",
    "SUBSET_FORMAT",
    "SUBSET_FORMAT_VERSION",
    "SUBSET_SHARDED_VERSION",
    "canonical",
    "dumps_line",
    "image_items",
    "is_original_layout",
    "is_sharded",
    "label",
    "little_endian",
]

SUBSET_FORMAT = "puzzletron-conversation-subset"
SUBSET_FORMAT_VERSION = 2  # one file per image
SUBSET_SHARDED_VERSION = 3  # the images in media shards
SAMPLES = "samples.jsonl"
INDEX = "samples.idx"
IMAGES = "images"
LEGACY_SAMPLES = "samples.json"  # the original layout (read only)

# samples.idx: magic, sample_count, group_count; then (N+1) u64 offsets; then N u32 group ids.
IDX_MAGIC = b"PZSUBIX2"
IDX_HEADER = struct.Struct("<8sQQ")


def dumps_line(obj: Any) -> str:
    """`obj` as one canonical JSON line: sorted keys, UTF-8, no blanks, no NaN."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def canonical(value: Any, what: str) -> Any:
    """A JSON round-trip of `value` (tuples become lists, keys sorted), or `SnapshotError` naming `what`.

    >>> canonical({"b": (1, 2), "a": None}, "acquisition")
    {'a': None, 'b': [1, 2]}
    """
    if value is None:
        return None
    try:
        return json.loads(dumps_line(value))
    except (TypeError, ValueError) as exc:
        raise SnapshotError(f"{what} must be JSON-serialisable: {exc}") from exc


def is_original_layout(manifest: Mapping[str, Any]) -> bool:
    """A subset manifest without ``format``: the original layout (``samples.json``, version 1)."""
    return "format" not in manifest


def is_sharded(manifest: Mapping[str, Any]) -> bool:
    """A subset whose images are in media shards (version 3)."""
    return manifest.get("version") == SUBSET_SHARDED_VERSION and not is_original_layout(manifest)


def image_items(sample: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The ``(field, item)`` image items of `sample`; parts that are not shaped like a conversation are
    skipped (a sample read from disk may be damaged: verify reports that, nothing here may crash on it)."""
    turns = sample.get("conversation") if isinstance(sample, Mapping) else None
    if not isinstance(turns, list):
        return
    for t, turn in enumerate(turns):
        content = turn.get("content") if isinstance(turn, Mapping) else None
        for c, item in enumerate(content if isinstance(content, list) else ()):
            if isinstance(item, dict) and item.get("type") == "image":
                yield f"conversation[{t}].content[{c}].image", item


def label(index: int, sample: Mapping[str, Any]) -> str:
    """``sample 3 (dataset row 'id')`` for messages.

    >>> label(3, {"source": {"dataset": "d", "row_id": "r"}})
    "sample 3 (d row 'r')"
    """
    source = sample.get("source") if isinstance(sample, Mapping) else None
    if isinstance(source, Mapping):
        return f"sample {index} ({source.get('dataset')} row {source.get('row_id')!r})"
    return f"sample {index}"


def little_endian(values: array.array) -> array.array:
    """`values` in little-endian byte order (a copy on big-endian hosts; the index is little-endian)."""
    if sys.byteorder == "big":
        values = array.array(values.typecode, values)
        values.byteswap()
    return values

"""The media shards' names, constants and checks, shared by their writer, reader and verifier.

The format: ``docs/media-shard-format.md``. Inside a conversation subset (version 3), under ``media/``:

    media/shards/000000.bin   images back to back, each exactly its encoded bytes
    media/index.bin           one 56-byte entry per image: shard u32, 0 u32, offset u64, length u64, SHA-256
    media/images.i64          int64 [samples + 1]: sample i's images are entries images[i] .. images[i + 1]
    media/blocks.u64          xxh3_64 of every 64 KiB block of the other media files, in path order

The subset manifest's ``media`` record names the format and version, the block checksums, the target
shard size, the counts and every media file's size and SHA-256 (`check_record`). Entries tile the shards
in order (`check_entries`): the first image of a shard at offset 0, each next one where the previous
ends, the last one at the shard's end, shards numbered 0, 1, ... without a gap; so no entry points
outside its shard and none overlaps another.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.formats.manifest import check_block_checksums, check_file_records

__all__ = [
    "BLOCKS",
    "DEFAULT_SHARD_BYTES",
    "ENTRY",
    "IMAGES",
    "INDEX",
    "MAX_SHARD_BYTES",
    "MEDIA_FORMAT",
    "MEDIA_VERSION",
    "MIN_SHARD_BYTES",
    "block_files",
    "check_entries",
    "check_record",
    "shard_name",
]

MEDIA_FORMAT = "puzzletron-media-shards"
MEDIA_VERSION = 1
INDEX = "media/index.bin"
IMAGES = "media/images.i64"
BLOCKS = "media/blocks.u64"
DEFAULT_SHARD_BYTES = 128 << 20  # a shard is closed once the next image would take it past this
MIN_SHARD_BYTES, MAX_SHARD_BYTES = 1 << 10, 1 << 34  # what a record may name (tests write small shards)
ENTRY = np.dtype(
    [("shard", "<u4"), ("reserved", "<u4"), ("offset", "<u8"), ("length", "<u8"), ("sha256", "u1", (32,))]
)
_KEYS = {"format", "version", "block_checksums", "shard_bytes", "shards", "images", "samples", "files"}
_CHUNK = 1 << 20  # entries checked at a time


def shard_name(k: int) -> str:
    """``media/shards/000007.bin``: the path of shard `k` inside the subset."""
    return f"media/shards/{k:06d}.bin"


def _count(record: Mapping[str, Any], key: str, where: str, low: int = 0, high: int = 2**62) -> int:
    value = record.get(key)
    if type(value) is not int or not low <= value <= high:
        raise SnapshotError(f"{where}: media.{key} is {value!r:.40}; expected an integer {low}..{high}")
    return value


def check_record(record: Any, where: str, *, images: int, samples: int) -> dict[str, Any]:
    """The subset manifest's ``media`` record, every field checked against this format and the subset's
    `images` and `samples` counts: `SnapshotError` naming `where` and the first field that is wrong. The
    files must be exactly this layout's (sorted by path), their sizes those the counts imply."""
    if not isinstance(record, Mapping) or set(record) != _KEYS:
        raise SnapshotError(f"{where}: media is {record!r:.120}; expected the keys {sorted(_KEYS)}")
    if record["format"] != MEDIA_FORMAT or type(record["version"]) is not int:
        raise SnapshotError(f"{where}: media format {record['format']!r:.40} is not {MEDIA_FORMAT!r}")
    if record["version"] != MEDIA_VERSION:
        raise SnapshotError(f"{where}: media shards version {record['version']} is not supported (this "
                            f"code reads {MEDIA_VERSION})")  # fmt: skip
    check_block_checksums(record["block_checksums"], where)
    _count(record, "shard_bytes", where, MIN_SHARD_BYTES, MAX_SHARD_BYTES)
    shards = _count(record, "shards", where)
    if _count(record, "images", where) != images or _count(record, "samples", where) != samples:
        raise SnapshotError(f"{where}: media counts {record['images']} images of {record['samples']} "
                            f"samples; the subset has {images} of {samples}")  # fmt: skip
    check_file_records(record["files"], where)
    sizes = {r["path"]: r["bytes"] for r in record["files"]}
    wanted = sorted([BLOCKS, IMAGES, INDEX, *(shard_name(k) for k in range(shards))])
    if [r["path"] for r in record["files"]] != wanted:
        raise SnapshotError(f"{where}: media files are not this layout's {shards} shards, index, "
                            "images and block checksums (or out of order)")  # fmt: skip
    implied = {IMAGES: 8 * (samples + 1), INDEX: ENTRY.itemsize * images}
    implied[BLOCKS] = 8 * sum(_blocks.block_count(sizes[rel]) for rel in wanted if rel != BLOCKS)
    for rel, size in implied.items():
        if sizes[rel] != size:
            raise SnapshotError(
                f"{where}: {rel} is recorded with {sizes[rel]} bytes; its counts imply {size}"
            )
    if any(sizes[shard_name(k)] == 0 for k in range(shards)):
        raise SnapshotError(f"{where}: an empty media shard is recorded (shards hold at least one image)")
    return dict(record)


def block_files(record: Mapping[str, Any]) -> list[tuple[str, int]]:
    """``(path, bytes)`` of the media files the block checksums cover, in path order."""
    return [(r["path"], r["bytes"]) for r in record["files"] if r["path"] != BLOCKS]


def check_entries(entries: np.ndarray, shard_sizes: np.ndarray, where: str) -> None:
    """`SnapshotError` naming `where` and the first bad entry unless the index entries (`ENTRY`, in image
    order) tile the shards of `shard_sizes` (bytes each) in order: no entry outside its shard, no overlap,
    no gap, no empty image. Vectorised, in chunks of 2^20 entries (a memory map is read once)."""
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    shard, end = -1, 0  # the previous entry's shard and end
    for start in range(0, max(len(entries), 1), _CHUNK):
        chunk = np.asarray(entries[start : start + _CHUNK])
        if not chunk.size:
            break
        k = chunk["shard"].astype(np.int64)
        offset, length = chunk["offset"].astype(np.int64), chunk["length"].astype(np.int64)
        prev_k = np.concatenate([[shard], k[:-1]])
        prev_end = np.concatenate([[end], (offset + length)[:-1]])
        new = k != prev_k
        bad = (
            (k >= len(sizes))
            | (chunk["reserved"] != 0)
            | (length <= 0)
            | (new & ((k != prev_k + 1) | (offset != 0)))
            | (~new & (offset != prev_end))
            | (offset + length > sizes[np.minimum(k, len(sizes) - 1)] if len(sizes) else True)
        )
        closing = np.concatenate([new[1:], [False]])  # the last entry of a shard that ends in the chunk
        bad |= closing & (offset + length != sizes[np.minimum(k, len(sizes) - 1)])
        if new[0] and shard >= 0 and end != sizes[shard]:
            bad[0] = True  # the previous chunk's last shard ended short
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise SnapshotError(
                f"{where}: {INDEX}: entry {start + i} (shard {int(k[i])}, bytes {int(offset[i])}.."
                f"{int(offset[i] + length[i])}) does not follow the previous image in its shard or lies "
                "outside it; the index is damaged (run `puzzletron-data verify`)"
            )
        shard, end = int(k[-1]), int(offset[-1] + length[-1])
    if (shard + 1 != len(sizes)) or (shard >= 0 and end != sizes[shard]):
        raise SnapshotError(f"{where}: {INDEX}: the entries do not fill the {len(sizes)} shards")

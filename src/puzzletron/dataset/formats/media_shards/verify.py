"""Verify media shards byte for byte: every file's size, SHA-256 and block checksums, the index tiling the
shards, every image's own SHA-256 (as the index and the subset manifest record it) and the images of each
sample. Never raises for damaged media: every problem is appended."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.formats.media_shards import _layout as layout

__all__ = ["verify_media"]

_CHUNK = 8 << 20


def _stream(
    source: Any, rel: str, size: int, cuts: Sequence[int] = ()
) -> tuple[str, np.ndarray, list[bytes]]:
    """SHA-256 hex and block checksums of `rel` read through `source`, and the SHA-256 digests of its byte
    ranges between consecutive `cuts` (offsets from 0 to `size`, ascending; none: no ranges)."""
    digest, blocks = hashlib.sha256(), _blocks.BlockHasher()
    pieces, part = [], hashlib.sha256()
    edges, e = list(cuts)[1:], 0
    for start in range(0, size, _CHUNK):
        chunk = np.empty(min(_CHUNK, size - start), np.uint8)
        source.read_into(rel, start, chunk)
        view = memoryview(chunk)
        digest.update(view)
        blocks.update(view)
        at = start
        while e < len(edges) and edges[e] <= start + len(view):
            part.update(view[at - start : edges[e] - start])
            pieces.append(part.digest())
            part, at, e = hashlib.sha256(), edges[e], e + 1
        part.update(view[at - start :])
    return digest.hexdigest(), blocks.finish(), pieces


def verify_media(
    source: Any,
    record: Mapping[str, Any],
    images: Sequence[Mapping[str, Any]],
    where: str,
    problems: list[str],
) -> None:
    """Check the media shards of a subset read through `source` against `record` (the manifest's checked
    ``media`` record) and `images` (its image records, in image order); problems appended to `problems`."""
    files = {r["path"]: r for r in record["files"]}
    for rel, r in files.items():
        try:
            source.pin(rel)
            size = source.size(rel)
        except SnapshotError as exc:
            problems.append(str(exc))
            continue
        if size != r["bytes"]:
            problems.append(f"{where}: {rel} has {size} bytes, the manifest records {r['bytes']}")
    if problems:
        return
    sums: dict[str, np.ndarray] = {}
    for rel in (layout.INDEX, layout.IMAGES, layout.BLOCKS):
        sha, sums[rel], _ = _stream(source, rel, files[rel]["bytes"])
        if sha != files[rel]["sha256"]:
            problems.append(f"{where}: {rel}: SHA-256 differs from the manifest")
    if problems:
        return
    entries = np.frombuffer(source.read_bytes(layout.INDEX), layout.ENTRY)
    shards = int(record["shards"])
    try:
        layout.check_entries(entries, [files[layout.shard_name(k)]["bytes"] for k in range(shards)], where)
    except SnapshotError as exc:
        problems.append(str(exc))
        return
    found: list[bytes] = []
    for k in range(shards):
        rel = layout.shard_name(k)
        mine = entries[entries["shard"] == k]
        cuts = [*mine["offset"].tolist(), files[rel]["bytes"]]
        sha, sums[rel], pieces = _stream(source, rel, files[rel]["bytes"], cuts)
        found += pieces
        if sha != files[rel]["sha256"]:
            problems.append(f"{where}: {rel}: SHA-256 differs from the manifest")
    stored = np.frombuffer(source.read_bytes(layout.BLOCKS), "<u8")
    wanted = np.concatenate([np.zeros(0, np.uint64), *(sums[rel] for rel, _ in layout.block_files(record))])
    if stored.shape != wanted.shape or not np.array_equal(stored, wanted):
        problems.append(f"{where}: {layout.BLOCKS} does not hold the block checksums of the media files")
    _check_images(source, entries, found, images, int(record["samples"]), where, problems)


def _check_images(
    source: Any, entries: np.ndarray, found: Sequence[bytes], images: Sequence[Mapping[str, Any]],
    samples: int, where: str, problems: list[str],
) -> None:  # fmt: skip
    """Each image's bytes against the index and the manifest's record; the samples' image ranges."""
    for i, (entry, digest, rec) in enumerate(zip(entries, found, images, strict=False)):
        name = f"{where}: image {i} (sample {rec.get('sample_index')}, {rec.get('path')!r})"
        if digest != bytes(entry["sha256"]):
            problems.append(f"{name}: its bytes do not match the index's SHA-256")
        if bytes(entry["sha256"]).hex() != rec.get("sha256") or int(entry["length"]) != rec.get("bytes"):
            problems.append(f"{name}: the index entry's SHA-256 or length differs from the manifest's")
    counts = np.bincount([int(r.get("sample_index", -1)) + 1 for r in images], minlength=samples + 1)[1:]
    bounds = np.frombuffer(source.read_bytes(layout.IMAGES), "<i8")
    if len(counts) != samples or not np.array_equal(np.diff(bounds), counts) or bounds[0] != 0:
        problems.append(f"{where}: {layout.IMAGES} does not give each sample its images of the manifest")

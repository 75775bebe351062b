"""Read images from media shards by (offset, length), each checked against its SHA-256 before it is served.

    media = MediaShards(source, manifest["media"], where="subsets/vlm")   # source: the subset's ByteSource
    first = media.sample_images()[i]                                     # sample i's first image
    data, = media.read(np.array([first]))                                # its bytes, SHA-256 checked

Opening pins every media file (a local file's identity, an object's ETag: a shard replaced under a running
reader is refused), checks each one's size against the record (a truncated shard is refused before a byte
is served) and ``media/blocks.u64`` against its SHA-256. The index and ``images.i64`` are verified whole
(their block checksums, the entries tiling the shards: `_layout.check_entries`) the first time they are
used, once per process. An image is read as its own range (`ByteSource.read_into`; through the node's
cache for an URL) and its SHA-256 compared with the index's: a changed byte is a `SnapshotError` naming the
image, and nothing of it is served. Picklable (DataLoader workers): a copy carries the pins and checksums.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.formats.media_shards import _layout as layout

__all__ = ["MediaShards"]


class MediaShards:
    """The media shards of one subset, read through `source` (a `storage.sources.ByteSource` rooted at the
    subset); `record` is the manifest's ``media`` record, already checked (`_layout.check_record`)."""

    def __init__(self, source: Any, record: Mapping[str, Any], *, where: str) -> None:
        self.source, self.where, self.record = source, where, dict(record)
        self.count, self.samples = int(record["images"]), int(record["samples"])
        sizes = {r["path"]: r["bytes"] for r in record["files"]}
        for rel, size in sizes.items():
            source.pin(rel)
            if source.size(rel) != size:
                raise SnapshotError(f"{where}: {rel} has {source.size(rel)} bytes, the manifest records "
                                    f"{size} (truncated or replaced)")  # fmt: skip
        self._shard_sizes = np.asarray(
            [sizes[layout.shard_name(k)] for k in range(int(record["shards"]))], np.int64
        )
        raw = source.read_bytes(layout.BLOCKS)
        recorded = next(r["sha256"] for r in record["files"] if r["path"] == layout.BLOCKS)
        if hashlib.sha256(raw).hexdigest() != recorded:
            raise SnapshotError(f"{where}: {layout.BLOCKS} differs from the SHA-256 the manifest records")
        self._checks = _blocks.BlockChecks(
            source, layout.block_files(record), np.frombuffer(raw, "<u8"), where=where
        )
        self._entries: np.ndarray | None = None
        self._images: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_entries": None, "_images": None}

    def entries(self) -> np.ndarray:
        """``[images]`` `_layout.ENTRY` records, read-only, verified (blocks and tiling) on first use."""
        if self._entries is None:
            self._checks.ensure_file(layout.INDEX)
            entries = self.source.map(layout.INDEX, layout.ENTRY, self.count)
            layout.check_entries(entries, self._shard_sizes, self.where)
            self._entries = entries
        return self._entries

    def sample_images(self) -> np.ndarray:
        """``[samples + 1]`` int64, read-only, verified: sample ``i``'s images are entries
        ``[i] .. [i + 1]``."""
        if self._images is None:
            self._checks.ensure_file(layout.IMAGES)
            images = self.source.map(layout.IMAGES, "<i8", self.samples + 1)
            if images[0] != 0 or images[-1] != self.count or (np.diff(images) < 0).any():
                raise SnapshotError(f"{self.where}: {layout.IMAGES} does not run from 0 to {self.count}")
            self._images = images
        return self._images

    def spans(self, ordinals: np.ndarray) -> list[tuple[str, int, int]]:
        """``(shard path, start, stop)`` of images `ordinals` (what `read` reads; a prefetch may ask)."""
        idx = np.asarray(ordinals, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.count):
            raise SnapshotError(f"{self.where}: media images {idx.min()}..{idx.max()} asked of {self.count}")
        chosen = self.entries()[idx]
        return [
            (layout.shard_name(int(k)), int(a), int(a) + int(n))
            for k, a, n in zip(chosen["shard"], chosen["offset"], chosen["length"], strict=True)
        ]

    def read(self, ordinals: np.ndarray) -> list[bytes]:
        """The encoded bytes of images `ordinals` (indices in the subset's image order), each checked
        against its SHA-256; `SnapshotError` naming the first that differs (nothing is returned then)."""
        idx = np.asarray(ordinals, dtype=np.int64).reshape(-1)
        spans = self.spans(idx)
        prefetch = getattr(self.source, "prefetch", None)
        if prefetch is not None and len(spans) > 1:
            prefetch(spans)  # an object store: every missing range fetched at once
        digests = self.entries()["sha256"][idx]
        out = []
        for i, (rel, start, stop), digest in zip(idx.tolist(), spans, digests, strict=True):
            data = np.empty(stop - start, np.uint8)
            self.source.read_into(rel, start, data)
            blob = data.tobytes()
            if hashlib.sha256(blob).digest() != bytes(digest):
                raise SnapshotError(
                    f"{self.where}: media image {i} ({rel} bytes {start}..{stop}) does not match its "
                    "SHA-256: the shard is damaged or was replaced; nothing of it was served"
                )
            out.append(blob)
        return out

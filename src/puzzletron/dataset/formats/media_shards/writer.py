"""Write media shards while a subset streams: images appended to the current shard, one index entry each.

`MediaShardWriter(tmp)` writes under ``tmp/media/`` (the subset's transaction directory: published with
it, or not at all); every file is hashed as it is written (`formats.binary.HashingFile`: SHA-256 and block
checksums), so `finish` writes the block checksums and returns the manifest's ``media`` record without
reading anything back. Memory: one image at a time and a few bytes a shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.formats.binary import HashingFile
from puzzletron.dataset.formats.media_shards import _layout as layout

__all__ = ["MediaShardWriter"]


class MediaShardWriter:
    """Images appended in the subset's image order (`add`), samples closed in order (`end_sample`)."""

    def __init__(self, tmp: Path, shard_bytes: int = layout.DEFAULT_SHARD_BYTES) -> None:
        self.tmp, self.shard_bytes = Path(tmp), int(shard_bytes)
        (self.tmp / "media" / "shards").mkdir(parents=True)
        self._index = HashingFile(self.tmp / layout.INDEX)
        self._images = HashingFile(self.tmp / layout.IMAGES)
        self._images.write(np.zeros(1, "<i8"))
        self._closed: list[tuple[str, HashingFile]] = []
        self._shard: HashingFile | None = None
        self.count = 0
        self.samples = 0
        self._entry = np.zeros(1, layout.ENTRY)

    def add(self, data: bytes, sha256: str) -> None:
        """Append one image's encoded bytes (its SHA-256 hex, already computed by the caller)."""
        if self._shard is not None and self._shard.bytes and self._shard.bytes + len(data) > self.shard_bytes:
            self._close_shard()
        if self._shard is None:
            self._shard = HashingFile(self.tmp / layout.shard_name(len(self._closed)))
        entry = self._entry[0]
        entry["shard"], entry["offset"], entry["length"] = len(self._closed), self._shard.bytes, len(data)
        entry["sha256"] = np.frombuffer(bytes.fromhex(sha256), np.uint8)
        self._shard.write(data)
        self._index.write(self._entry)
        self.count += 1

    def end_sample(self) -> None:
        """The images added since the last call are the next sample's."""
        self._images.write(np.asarray([self.count], "<i8"))
        self.samples += 1

    def _close_shard(self) -> None:
        assert self._shard is not None
        self._closed.append((layout.shard_name(len(self._closed)), self._shard))
        self._shard = None

    def finish(self) -> dict[str, Any]:
        """Close every file, write the block checksums; the ``media`` record of the subset's manifest."""
        if self._shard is not None:
            self._close_shard()
        files = {layout.INDEX: self._index, layout.IMAGES: self._images, **dict(self._closed)}
        records = {rel: {"path": rel, **writer.close()} for rel, writer in files.items()}
        blocks = HashingFile(self.tmp / layout.BLOCKS)
        for rel in sorted(files):
            blocks.write(np.asarray(files[rel].block_sums, dtype="<u8"))
        records[layout.BLOCKS] = {"path": layout.BLOCKS, **blocks.close()}
        return {
            "format": layout.MEDIA_FORMAT,
            "version": layout.MEDIA_VERSION,
            "block_checksums": {"algorithm": _blocks.ALGORITHM, "block_size": _blocks.BLOCK_SIZE},
            "shard_bytes": self.shard_bytes,
            "shards": len(self._closed),
            "images": self.count,
            "samples": self.samples,
            "files": [records[rel] for rel in sorted(records)],
        }

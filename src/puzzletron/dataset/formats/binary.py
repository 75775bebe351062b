"""The binary pieces the sharded formats (token store, VLM store) share: a file hashed (SHA-256 and block
checksums) as it is written, strings stored as UTF-8 bytes cut by int64 offsets, ragged ranges.

All integers are little-endian. A strings file pair is ``<name>.bin`` (UTF-8, concatenated) and
``<name>.i64`` (int64 ``[m + 1]`` byte offsets from 0)::

    >>> data, offsets = encode_strings(["ab", "", "cde"])
    >>> data, offsets.tolist()
    (b'abcde', [0, 2, 2, 5])
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.storage.atomic import with_path

__all__ = ["HashingFile", "encode_strings", "ragged_arange"]


class HashingFile:
    """A binary file written once, front to back, hashed (SHA-256 and block checksums, `formats.blocks`)
    and counted as it is written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = open(path, "wb")  # noqa: SIM115 (closed by `close`)
        self._digest = hashlib.sha256()
        self._blocks = _blocks.BlockHasher()
        self.bytes = 0
        self.block_sums = np.zeros(0, np.uint64)

    def write(self, data: bytes | np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data).cast("B")
        try:
            self._fh.write(view)
        except OSError as exc:  # a full disk: say which file
            raise with_path(exc, self.path) from exc
        self._digest.update(view)
        self._blocks.update(view)
        self.bytes += len(view)

    def close(self) -> dict[str, Any]:
        """Close (the caller fsyncs the directory before renaming it); the file's ``{bytes, sha256}``; its
        block checksums are then `block_sums`."""
        try:
            self._fh.close()
        except OSError as exc:
            raise with_path(exc, self.path) from exc
        self.block_sums = self._blocks.finish()
        return {"bytes": self.bytes, "sha256": self._digest.hexdigest()}


def encode_strings(strings: Sequence[str]) -> tuple[bytes, np.ndarray]:
    """UTF-8 bytes of `strings` concatenated, and their int64 offsets ``[m + 1]`` from 0."""
    encoded = [s.encode("utf-8") for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype="<i8")
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return b"".join(encoded), offsets


def ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concat(arange(s, s + n) for s, n in zip(starts, lengths))``, vectorised.

    >>> ragged_arange(np.array([5, 0]), np.array([2, 3])).tolist()
    [5, 6, 0, 1, 2]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    return np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lengths), lengths) + np.arange(
        total, dtype=np.int64
    )

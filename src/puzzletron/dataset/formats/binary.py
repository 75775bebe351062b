"""The binary pieces the sharded formats (token store, VLM store) share: a file hashed as it is written,
strings stored as UTF-8 bytes cut by int64 offsets, positional reads, read-only memory maps, ragged ranges.

All integers are little-endian. A strings file pair is ``<name>.bin`` (UTF-8, concatenated) and
``<name>.i64`` (int64 ``[m + 1]`` byte offsets from 0)::

    >>> data, offsets = encode_strings(["ab", "", "cde"])
    >>> data, offsets.tolist()
    (b'abcde', [0, 2, 2, 5])
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import SnapshotError

__all__ = [
    "HashingFile",
    "encode_strings",
    "memmap_array",
    "pread_into",
    "ragged_arange",
    "read_strings",
]


class HashingFile:
    """A binary file written once, front to back, hashed (SHA-256) and counted as it is written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = open(path, "wb")  # noqa: SIM115 (closed by `close`)
        self._digest = hashlib.sha256()
        self.bytes = 0

    def write(self, data: bytes | np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data).cast("B")
        self._fh.write(view)
        self._digest.update(view)
        self.bytes += len(view)

    def close(self) -> dict[str, Any]:
        """Close (the caller fsyncs the directory before renaming it); the file's ``{bytes, sha256}``."""
        self._fh.close()
        return {"bytes": self.bytes, "sha256": self._digest.hexdigest()}


def encode_strings(strings: Sequence[str]) -> tuple[bytes, np.ndarray]:
    """UTF-8 bytes of `strings` concatenated, and their int64 offsets ``[m + 1]`` from 0."""
    encoded = [s.encode("utf-8") for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype="<i8")
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return b"".join(encoded), offsets


def pread_into(fd: int, out: np.ndarray, offset: int, where: str) -> None:
    """Fill the contiguous array `out` from byte `offset` of `fd`; `SnapshotError` on a short file."""
    view, done = memoryview(out).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise SnapshotError(f"{where}: ends at byte {offset + done}; {len(view) - done} more expected")
        done += got


def read_strings(path: Path, offsets: np.ndarray, indices: np.ndarray) -> list[str]:
    """Strings `indices` of a strings file (UTF-8 bytes cut by int64 `offsets` ``[m + 1]``)."""
    if not len(indices):
        return []
    begin, end = offsets[indices], offsets[np.asarray(indices) + 1]
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        out = []
        for a, b in zip(begin.tolist(), end.tolist(), strict=True):  # one read a string
            buf = np.empty(b - a, np.uint8)
            pread_into(fd, buf, a, str(path))
            out.append(buf.tobytes().decode("utf-8"))
        return out
    finally:
        os.close(fd)


def memmap_array(path: Path, dtype: str, count: int) -> np.ndarray:
    """A read-only ``[count]`` view of the file (a memmap; numpy cannot map an empty file)."""
    if count == 0:
        empty = np.zeros(0, dtype)
        empty.setflags(write=False)
        return empty
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


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

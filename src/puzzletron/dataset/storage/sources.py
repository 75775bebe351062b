"""Where a format reader gets its bytes: the `ByteSource` protocol and `open_source`.

Every byte a format reader serves comes through a `ByteSource` (``docs/architecture.md``: formats reach
storage only through this package), so the readers do not know the medium. Today there is one
implementation, `puzzletron.dataset.storage.local.LocalFiles` (local and shared POSIX file systems);
another medium (object storage by URL scheme) is one more implementation and one more branch of
`open_source`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from puzzletron.dataset.storage.local import LocalFiles

__all__ = ["ByteSource", "open_source"]


@runtime_checkable
class ByteSource(Protocol):
    """Read-only bytes of the files under one directory, named by relative POSIX paths (``shards/0.tokens``).

    ``pin(rel)``: fix which file `rel` is from now on (raise `SnapshotError` if it is missing); ``size(rel)``:
    its byte size; ``read_into(rel, offset, out)``: fill the contiguous array `out` from byte `offset`
    (`SnapshotError` when the file ends first); ``read_bytes(rel)``: the whole file; ``map(rel, dtype,
    count)``: a read-only ``[count]`` array of the file's first items (a memory map locally; another medium
    may read it whole); ``close()``: release what is open (reads reopen).
    """

    def pin(self, rel: str) -> None: ...

    def size(self, rel: str) -> int: ...

    def read_into(self, rel: str, offset: int, out: np.ndarray) -> None: ...

    def read_bytes(self, rel: str) -> bytes: ...

    def map(self, rel: str, dtype: Any, count: int) -> np.ndarray: ...

    def close(self) -> None: ...


def open_source(location: str | Path) -> ByteSource:
    """The `ByteSource` of the directory at `location` (a local path: `LocalFiles`)."""
    return LocalFiles(location)

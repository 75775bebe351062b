"""Where a format reader gets its bytes: the `ByteSource` protocol and `open_source`.

Every byte a format reader serves comes through a `ByteSource` (``docs/architecture.md``: formats reach
storage only through this package), so the readers do not know the medium. Two implementations:
`puzzletron.dataset.storage.local.LocalFiles` (local and shared POSIX file systems) and
`puzzletron.dataset.storage.remote.RemoteFiles` (object storage by URL: ``s3://bucket/prefix`` and any
fsspec scheme with a backend installed); `open_source` picks one by the location's form.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from puzzletron.dataset.storage.local import LocalFiles
from puzzletron.dataset.storage.objects import is_url

__all__ = ["ByteSource", "location_name", "open_source"]


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


def open_source(location: str | Path, **remote: Any) -> ByteSource:
    """The `ByteSource` of the directory or URL prefix at `location`: `LocalFiles` for a path,
    `RemoteFiles` (with the keyword arguments `remote`: ``cache``, ``chunk_size``) for an URL."""
    if is_url(location):
        from puzzletron.dataset.storage.remote import RemoteFiles

        return RemoteFiles(str(location), **remote)
    if isinstance(location, str) and location.startswith("file://"):
        location = location[len("file://") :]
    return LocalFiles(location)


def location_name(location: str | Path) -> str:
    """The last component of a path or URL (what a store is called in messages and cache names)."""
    return str(location).rstrip("/").rsplit("/", 1)[-1] if is_url(location) else Path(location).name

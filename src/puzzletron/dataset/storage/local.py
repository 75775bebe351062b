"""Reading the files of one directory on a local (or shared POSIX) file system: the local
`puzzletron.dataset.storage.sources.ByteSource`.

`LocalFiles` reads with positional reads (``os.preadv``) straight into the caller's buffer, maps a
file read-only when asked, and *pins* files: `pin` records a file's identity (device, inode, size,
modification time) when a reader opens its directory, and every later open of that file must find the same
one, so a directory replaced under a running reader (a store rebuilt and republished at the same path) is
an error, never a mix of old and new files. Open descriptors are kept (least recently used closed first,
`MAX_OPEN` at most) and reopened lazily; a pickled `LocalFiles` carries its pins, not its descriptors.

    files = LocalFiles("stores/puzzle-kd")
    files.pin("shards/000000.tokens")                       # at open: what later reads must find
    out = np.empty(4096, np.uint8)
    files.read_into("shards/000000.tokens", 8192, out)      # bytes 8192..12288, one pread
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import SnapshotError

__all__ = ["MAX_OPEN", "FileIdentity", "LocalFiles", "hash_file", "pread_into"]

MAX_OPEN = 128  # descriptors a LocalFiles keeps open


def hash_file(path: str | os.PathLike[str], digest: Any) -> str:
    """The hex digest of the file at `path` by the hashlib-style `digest` (``hashlib.sha256()``,
    ``xxhash.xxh3_128()``), read in 8 MiB chunks."""
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class FileIdentity:
    """What makes a file the same file: device, inode, size and modification time (ns)."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def pread_into(fd: int, out: np.ndarray, offset: int, where: str) -> None:
    """Fill the contiguous array `out` from byte `offset` of `fd`; `SnapshotError` naming `where` when the
    file ends first."""
    view, done = memoryview(out).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise SnapshotError(f"{where}: ends at byte {offset + done}; {len(view) - done} more expected")
        done += got


class LocalFiles:
    """The local ``ByteSource`` of the directory `root` (see the module docstring). Not thread-safe."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()
        self._pins: dict[str, FileIdentity] = {}
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._maps: dict[str, tuple[mmap.mmap, memoryview]] = {}

    def __repr__(self) -> str:
        return f"LocalFiles({str(self.root)!r}, pinned={len(self._pins)})"

    def _where(self, rel: str) -> str:
        return str(self.root / rel)

    def pin(self, rel: str) -> None:
        try:
            st = os.stat(self.root / rel)
        except OSError as exc:
            raise SnapshotError(f"{self._where(rel)}: cannot be read ({exc.strerror or exc})") from exc
        self._pins.setdefault(rel, FileIdentity.of(st))

    def _check(self, rel: str, st: os.stat_result) -> None:
        pinned = self._pins.get(rel)
        if pinned is not None and FileIdentity.of(st) != pinned:
            raise SnapshotError(
                f"{self._where(rel)}: the file was replaced or changed since this reader opened "
                f"{self.root} (pinned {pinned}, found {FileIdentity.of(st)}); open it again to read the "
                "new one"
            )

    def _fd(self, rel: str) -> int:
        fd = self._fds.get(rel)
        if fd is not None:
            self._fds.move_to_end(rel)
            return fd
        try:
            fd = os.open(self.root / rel, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise SnapshotError(f"{self._where(rel)}: cannot be read ({exc.strerror or exc})") from exc
        try:
            self._check(rel, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        self._fds[rel] = fd
        if len(self._fds) > MAX_OPEN:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def size(self, rel: str) -> int:
        pinned = self._pins.get(rel)
        return pinned.size if pinned is not None else os.fstat(self._fd(rel)).st_size

    def read_into(self, rel: str, offset: int, out: np.ndarray) -> None:
        pread_into(self._fd(rel), out, offset, self._where(rel))

    def read_bytes(self, rel: str) -> bytes:
        out = np.empty(self.size(rel), np.uint8)
        self.read_into(rel, 0, out)
        return out.tobytes()

    def map(self, rel: str, dtype: Any, count: int) -> np.ndarray:
        if count == 0:  # numpy cannot map an empty file
            empty = np.zeros(0, dtype)
            empty.setflags(write=False)
            return empty
        fd = self._fd(rel)  # checks the pin; the map keeps that inode for as long as it lives
        with open(os.dup(fd), "rb") as fh:
            return np.memmap(fh, dtype=dtype, mode="r", shape=(count,))

    def view(self, rel: str) -> memoryview:
        """The whole file `rel` as a read-only memoryview of a shared mapping (checked against its pin;
        `MAX_OPEN` mappings at most, the oldest unmapped first). A reader copies out of it with no system
        call; `release` drops the pages it touched from this process's memory (not from the page cache),
        so a walk through a large file keeps a flat resident size."""
        mapped = self._maps.get(rel)
        if mapped is not None:
            return mapped[1]
        if self.size(rel) == 0:
            return memoryview(b"")
        handle = mmap.mmap(self._fd(rel), 0, access=mmap.ACCESS_READ)
        mapped = self._maps[rel] = (handle, memoryview(handle))
        if len(self._maps) > MAX_OPEN:
            self._unmap(next(iter(self._maps)))
        return mapped[1]

    def _unmap(self, rel: str) -> None:
        handle, view = self._maps.pop(rel)
        view.release()
        with contextlib.suppress(BufferError):  # an array still looks at it: it lives until that array goes
            handle.close()

    def release(self) -> None:
        """Drop the pages of every mapping from this process's resident memory (they stay cached)."""
        for handle, _ in self._maps.values():
            handle.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        while self._maps:
            self._unmap(next(iter(self._maps)))
        while self._fds:
            os.close(self._fds.popitem()[1])

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "_pins": dict(self._pins)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fds = OrderedDict()
        self._maps = {}

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:
        # At interpreter exit this module's globals may already be None (os, contextlib): use only what the
        # default argument and the builtins hold.
        fds = self.__dict__.get("_fds") or {}
        while fds:
            try:  # noqa: SIM105 (contextlib may be None by now)
                _close(fds.popitem()[1])
            except OSError:
                pass

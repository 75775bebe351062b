"""A bounded local cache of object bytes, shared by every rank and process of one node.

    cache = ObjectCache.default()   # PUZZLETRON_OBJECT_CACHE (~/.cache/puzzletron/objects), ..._BYTES
    fd = cache.open_entry("chunks", name, size) or cache.put_chunk(name, fetch())   # once per node
    fd = cache.whole(name, size, download)       # a whole object (an index) for a map, one download a node

Entries are immutable files named by a key that includes the object's ETag (`entry_key`), so an object
replaced on the server never matches bytes cached for the old one. An entry is written to a temporary file
in its folder and renamed into place (a reader sees a whole entry or none); a whole object is downloaded by
one process of the node while the others wait on its lock file (``flock``), then all map the same file.

Size: every write adds its bytes to a counter (``usage``, under ``flock(<root>/.lock)``); when it passes
``max_bytes`` the writer scans the entries and unlinks the least recently used (oldest modification time:
a hit refreshes it, at most once a minute per entry and process) until the total is under 90% of the bound.
The counter is state on disk like any other, so it is not trusted: a value that is not a plain
non-negative byte count (``-1e18``, text, more than 2^62) is replaced by a scan of the entries, and every
`_RESCAN_EVERY` writes of a process scan anyway, so no counter can switch the bound off.

Every entry is handed out as an open descriptor (`open_entry`, `put_chunk`, `whole`), taken before the
entry can be evicted: a process keeps reading an inode after it is unlinked, so the bytes being served are
never lost to an eviction, the writer's own (a bound near one chunk) or another process's, and never
fetched again in a loop. The bound can be passed briefly by what the processes are writing at that moment.
Temporary files older than an hour (a killed writer's) are removed by the scan. A write that fails (a full
disk) is an `OSError` naming the entry and the bound.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.storage.atomic import with_path
from puzzletron.dataset.storage.settings import object_settings, parse_size

__all__ = ["DEFAULT_MAX_BYTES", "ObjectCache", "entry_key", "parse_size"]

DEFAULT_MAX_BYTES = 64 << 30
_TOUCH_S = 60.0  # a hit refreshes an entry's LRU time at most this often (per process)
_STALE_TMP_S = 3600.0
_LOW_WATER = 0.9
_RESCAN_EVERY = 256  # writes of one process between scans that recompute the usage counter
_MAX_USAGE = 1 << 62
_USAGE = re.compile(r"[0-9]{1,19}")
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.EACCES, errno.ENOENT}


def entry_key(url: str, etag: str | None, size: int) -> str:
    """The cache key of one object version: 40 hex digits of SHA-256 over its URL, ETag and size."""
    return hashlib.sha256(f"{url}\0{etag or ''}\0{size}".encode()).hexdigest()[:40]


class ObjectCache:
    """The cache under `root`, holding at most about `max_bytes` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if type(max_bytes) is not int or max_bytes < 1:
            raise ConfigError(f"cache size must be a whole number of bytes, at least 1; got {max_bytes!r}")
        self.root = Path(os.path.abspath(root))
        self.max_bytes = max_bytes
        self._touched: dict[str, float] = {}
        self._writes = 0

    @classmethod
    def default(cls) -> ObjectCache:
        """The cache ``PUZZLETRON_OBJECT_CACHE`` names (default ``~/.cache/puzzletron/objects``), bounded by
        ``PUZZLETRON_OBJECT_CACHE_BYTES`` (default 64G): `storage.settings` reads and checks both."""
        settings = object_settings()
        return cls(settings.cache, max_bytes=settings.cache_bytes)

    def __repr__(self) -> str:
        return f"ObjectCache({str(self.root)!r}, max_bytes={self.max_bytes})"

    def __getstate__(self) -> dict[str, object]:
        return {"root": self.root, "max_bytes": self.max_bytes, "_touched": {}, "_writes": 0}

    def _entry(self, kind: str, name: str) -> Path:
        return self.root / kind / name[:2] / name

    def _touch(self, path: Path, fd: int | None = None) -> None:
        """Refresh the entry's LRU time (at most once a `_TOUCH_S` per entry and process)."""
        now = time.monotonic()
        if now - self._touched.get(str(path), -_TOUCH_S) >= _TOUCH_S:
            with contextlib.suppress(FileNotFoundError):
                os.utime(fd if fd is not None else path)
            if len(self._touched) > 1 << 16:
                self._touched.clear()
            self._touched[str(path)] = now

    def lookup(self, kind: str, name: str, size: int) -> Path | None:
        """The entry's path when it is there whole (`size` bytes), its LRU time refreshed; else None. (A
        path may be evicted before it is opened: readers use `open_entry`.)"""
        path = self._entry(kind, name)
        try:
            found = os.stat(path).st_size
        except FileNotFoundError:
            return None
        if found != size:  # never written short by us: another writer's damage; fetch again
            return None
        self._touch(path)
        return path

    def open_entry(self, kind: str, name: str, size: int) -> int | None:
        """A read-only descriptor of the entry when it is there whole (`size` bytes), its LRU time
        refreshed; else None. The caller closes it; an eviction after this never takes its bytes."""
        path = self._entry(kind, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        if os.fstat(fd).st_size != size:  # never written short by us: another writer's damage
            os.close(fd)
            return None
        self._touch(path, fd)
        return fd

    def _write(self, path: Path, fill: Callable[[BinaryIO], None]) -> tuple[int, int]:
        """Write an entry through a temporary file and a rename; its size and a read-only descriptor of it
        (opened before the rename, so no eviction can take it from the caller)."""
        tmp = path.parent / f".tmp-{os.getpid()}-{secrets.token_hex(6)}"
        fd = -1
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                fill(fh)
                size = fh.tell()
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            os.replace(tmp, path)
        except BaseException as exc:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:  # not a network error of `fill`
                raise self._disk_error(exc, path) from exc
            raise
        self._touched[str(path)] = time.monotonic()
        return size, fd

    def _disk_error(self, exc: OSError, path: Path) -> OSError:
        """`exc` naming the entry; a full disk also names the bound (the disk is smaller than it)."""
        if exc.errno == errno.ENOSPC:
            return type(exc)(
                exc.errno,
                f"{exc.strerror or exc} (the object cache at {self.root}; its bound, "
                f"PUZZLETRON_OBJECT_CACHE_BYTES, is {self.max_bytes} bytes: lower it or free space)",
                str(path),
            )
        return with_path(exc, path)

    def put_chunk(self, name: str, data: bytes) -> int:
        """Write the entry `name` (``chunks/``) holding `data`; a read-only descriptor of it (the caller
        closes it)."""
        path = self._entry("chunks", name)
        size, fd = self._write(path, lambda fh: fh.write(data))
        try:
            self._account(size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def whole(self, name: str, size: int, download: Callable[[BinaryIO], None]) -> int:
        """A read-only descriptor of the entry `name` (``files/``) of `size` bytes: cached, else downloaded
        by exactly one process of the node (the others wait on its lock, then use it)."""
        found = self.open_entry("files", name, size)
        if found is not None:
            return found
        path = self._entry("files", name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._disk_error(exc, path.parent) from exc
        with self._locked(path.parent / f".{name}.lock"):
            found = self.open_entry("files", name, size)
            if found is not None:
                return found
            written, fd = self._write(path, download)
        if written != size:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise OSError(f"{path}: downloaded {written} bytes, expected {size}")
        try:
            self._account(written)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def _locked(self, lock: Path) -> Iterator[None]:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise self._disk_error(exc, lock) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read_usage(self) -> int | None:
        """The usage counter when it is a plain byte count in range; None when missing or not trusted."""
        try:
            text = (self.root / "usage").read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError):
            return None
        if not _USAGE.fullmatch(text) or int(text) > _MAX_USAGE:
            return None
        return int(text)

    def _account(self, added: int) -> None:
        """Add `added` bytes to the node's usage counter (recomputed by a scan when it is missing, not a
        byte count, or every `_RESCAN_EVERY` writes); evict when it passes the bound."""
        with self._locked(self.root / ".lock"):
            self._writes += 1
            total = None if self._writes % _RESCAN_EVERY == 0 else self._read_usage()
            total = self._scan_and_evict(None) if total is None else total + added
            if total > self.max_bytes:
                total = self._scan_and_evict(int(self.max_bytes * _LOW_WATER))
            usage = self.root / "usage"
            try:
                tmp = usage.with_name(f".usage-{os.getpid()}")
                tmp.write_text(str(total), encoding="ascii")
                os.replace(tmp, usage)
            except OSError as exc:
                raise self._disk_error(exc, usage) from exc

    def _scan_and_evict(self, target: int | None) -> int:
        """The bytes of every entry; with `target`, least recently used entries unlinked until the total is
        at most `target` (hold the root lock)."""
        entries, now = [], time.time()
        for kind in ("chunks", "files"):
            for folder in sorted(p for p in (self.root / kind).glob("*") if p.is_dir()):
                with os.scandir(folder) as it:
                    for entry in it:
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if entry.name.startswith("."):  # a killed writer's file; a download lock
                            stale = now - st.st_mtime > _STALE_TMP_S
                            orphan = entry.name.endswith(".lock") and not os.path.exists(
                                os.path.join(folder, entry.name[1 : -len(".lock")])
                            )
                            if (entry.name.startswith(".tmp-") and stale) or orphan:
                                with contextlib.suppress(FileNotFoundError):
                                    os.unlink(entry.path)
                            continue
                        entries.append((st.st_mtime_ns, st.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        if target is not None:
            for _, size, path in sorted(entries):
                if total <= target:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    total -= size
        return total

    def usage(self) -> int:
        """The bytes the cache holds now (a scan)."""
        with self._locked(self.root / ".lock"):
            return self._scan_and_evict(None)

"""A bounded local cache of object bytes, shared by every rank and process of one node.

    cache = ObjectCache.default()   # PUZZLETRON_OBJECT_CACHE (~/.cache/puzzletron/objects), ..._BYTES
    path = cache.lookup("chunks", name, size) or cache.put_chunk(name, fetch())   # once per node
    path = cache.whole(name, size, download)     # a whole object (an index) for a map, one download a node

Entries are immutable files named by a key that includes the object's ETag (`entry_key`), so an object
replaced on the server never matches bytes cached for the old one. An entry is written to a temporary file
in its folder and renamed into place (a reader sees a whole entry or none); a whole object is downloaded by
one process of the node while the others wait on its lock file (``flock``), then all map the same file.

Size: every write adds its bytes to a counter (``usage``, under ``flock(<root>/.lock)``); when it passes
``max_bytes`` the writer scans the entries and unlinks the least recently used (oldest modification time:
a hit refreshes it, at most once a minute per entry and process) until the total is under 90% of the bound.
A process holding an entry open keeps reading its inode after it is unlinked; the bound can be passed
briefly by what the processes are writing at that moment. Temporary files older than an hour (a killed
writer's) are removed by the scan.
"""

from __future__ import annotations

import contextlib
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

__all__ = ["DEFAULT_MAX_BYTES", "ObjectCache", "entry_key", "parse_size"]

DEFAULT_MAX_BYTES = 64 << 30
_TOUCH_S = 60.0  # a hit refreshes an entry's LRU time at most this often (per process)
_STALE_TMP_S = 3600.0
_LOW_WATER = 0.9
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes of ``"64G"``, ``"512MiB"``, ``"1048576"`` (binary multiples).

    >>> parse_size("64G") == 64 << 30, parse_size("1.5M"), parse_size("100")
    (True, 1572864, 100)
    """
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"cache size {text!r}: expected bytes, or a number with K, M, G or T")
    power = " KMGT".index(match[2].upper() or " ")
    return int(float(match[1]) * (1 << (10 * power)))


def entry_key(url: str, etag: str | None, size: int) -> str:
    """The cache key of one object version: 40 hex digits of SHA-256 over its URL, ETag and size."""
    return hashlib.sha256(f"{url}\0{etag or ''}\0{size}".encode()).hexdigest()[:40]


class ObjectCache:
    """The cache under `root`, holding at most about `max_bytes` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1:
            raise ConfigError(f"cache size must be at least 1 byte, got {max_bytes}")
        self.root = Path(os.path.abspath(root))
        self.max_bytes = int(max_bytes)
        self._touched: dict[str, float] = {}

    @classmethod
    def default(cls) -> ObjectCache:
        """The cache ``PUZZLETRON_OBJECT_CACHE`` names (default ``~/.cache/puzzletron/objects``), bounded by
        ``PUZZLETRON_OBJECT_CACHE_BYTES`` (default 64G)."""
        root = os.environ.get("PUZZLETRON_OBJECT_CACHE") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "puzzletron", "objects"
        )
        size = os.environ.get("PUZZLETRON_OBJECT_CACHE_BYTES")
        return cls(root, max_bytes=parse_size(size) if size else DEFAULT_MAX_BYTES)

    def __repr__(self) -> str:
        return f"ObjectCache({str(self.root)!r}, max_bytes={self.max_bytes})"

    def __getstate__(self) -> dict[str, object]:
        return {"root": self.root, "max_bytes": self.max_bytes, "_touched": {}}

    def _entry(self, kind: str, name: str) -> Path:
        return self.root / kind / name[:2] / name

    def lookup(self, kind: str, name: str, size: int) -> Path | None:
        """The entry's path when it is there whole (`size` bytes), its LRU time refreshed; else None."""
        path = self._entry(kind, name)
        try:
            found = os.stat(path).st_size
        except FileNotFoundError:
            return None
        if found != size:  # never written short by us: another writer's damage; fetch again
            return None
        now = time.monotonic()
        if now - self._touched.get(str(path), -_TOUCH_S) >= _TOUCH_S:
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)
            if len(self._touched) > 1 << 16:
                self._touched.clear()
            self._touched[str(path)] = now
        return path

    def _write(self, path: Path, fill: Callable[[BinaryIO], None]) -> int:
        """Write an entry through a temporary file and a rename; its size."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".tmp-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            with open(tmp, "wb") as fh:
                fill(fh)
                size = fh.tell()
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self._touched[str(path)] = time.monotonic()
        return size

    def put_chunk(self, name: str, data: bytes) -> Path:
        """Write the entry `name` (``chunks/``) holding `data`."""
        path = self._entry("chunks", name)
        self._account(self._write(path, lambda fh: fh.write(data)))
        return path

    def whole(self, name: str, size: int, download: Callable[[BinaryIO], None]) -> Path:
        """The entry `name` (``files/``) of `size` bytes: cached, else downloaded by exactly one process of
        the node (the others wait on its lock, then use it)."""
        found = self.lookup("files", name, size)
        if found is not None:
            return found
        path = self._entry("files", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked(path.parent / f".{name}.lock"):
            found = self.lookup("files", name, size)
            if found is not None:
                return found
            written = self._write(path, download)
        if written != size:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise OSError(f"{path}: downloaded {written} bytes, expected {size}")
        self._account(written)
        return path

    @contextlib.contextmanager
    def _locked(self, lock: Path) -> Iterator[None]:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _account(self, added: int) -> None:
        """Add `added` bytes to the node's usage counter; evict when it passes the bound."""
        self.root.mkdir(parents=True, exist_ok=True)
        with self._locked(self.root / ".lock"):
            usage = self.root / "usage"
            try:
                total = int(usage.read_text() or 0) + added
            except (FileNotFoundError, ValueError):
                total = self._scan_and_evict(None)
            if total > self.max_bytes:
                total = self._scan_and_evict(int(self.max_bytes * _LOW_WATER))
            usage.write_text(str(total))

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

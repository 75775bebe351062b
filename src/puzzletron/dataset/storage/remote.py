"""Reading the files under an URL prefix: the object-storage `puzzletron.dataset.storage.sources.ByteSource`.

`RemoteFiles` lists the prefix once when the first file is pinned (one request per 1,000 objects) and pins
each file's size and ETag from that listing; every later read of a file asks for that version (S3:
``If-Match``), so an object replaced under a running reader is an error (`objects.ObjectChanged`), never a
mix of versions. Reads go through the node's `object_cache.ObjectCache` in aligned chunks of
`CHUNK_SIZE` bytes, fetched concurrently when a read spans several, kept as local files and read with
``os.preadv``; `map` fetches a file whole into the cache (one process of the node downloads it) and
memory-maps it, as Megatron-Core does with its ``.idx`` files. Without a cache (``cache=None``: `verify`
streaming a whole store) every read is a ranged request.

    files = RemoteFiles("s3://bucket/stores/puzzle-kd")
    files.pin("shards/000000.tokens")                      # size and ETag from the listing
    files.read_into("shards/000000.tokens", 8192, out)     # from the cache, else one ranged GET a chunk
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.storage.local import pread_into
from puzzletron.dataset.storage.object_cache import ObjectCache, entry_key
from puzzletron.dataset.storage.objects import ObjectInfo, ObjectOptions, Objects, join_url

__all__ = ["CHUNK_SIZE", "MAX_OPEN_CHUNKS", "RemoteFiles"]

CHUNK_SIZE = 4 << 20  # bytes fetched and cached at a time: a multiple of the 1 MiB block-check group
MAX_OPEN_CHUNKS = 256
_DEFAULT: Any = object()


class RemoteFiles:
    """The ``ByteSource`` of the objects under `url` (see the module docstring). Not thread-safe.

    ``cache``: an `ObjectCache` (default: `ObjectCache.default()`), or None to read every range from the
    server. ``chunk_size``: bytes per cached chunk. Picklable: a copy carries the pins, not open files or
    the client (created again in the process that reads).
    """

    def __init__(
        self,
        url: str,
        *,
        cache: ObjectCache | None = _DEFAULT,
        chunk_size: int = CHUNK_SIZE,
        options: ObjectOptions | None = None,
    ) -> None:
        self.objects = Objects(url, options=options)
        self.url = self.objects.url
        self.root = self.url  # what errors name, like LocalFiles.root
        self.cache = ObjectCache.default() if cache is _DEFAULT else cache
        self.chunk_size = int(chunk_size)
        if self.cache is not None and self.cache.max_bytes < self.chunk_size:
            raise ConfigError(
                f"the object cache's bound (PUZZLETRON_OBJECT_CACHE_BYTES) is {self.cache.max_bytes} bytes, "
                f"below one chunk ({self.chunk_size} bytes): every read would evict what it fetched; "
                f"give it at least {self.chunk_size} bytes (many chunks: it is the node's read cache)"
            )
        self._listing: dict[str, ObjectInfo] | None = None
        self._pins: dict[str, ObjectInfo] = {}
        self._fds: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._whole: dict[str, int] = {}  # rel -> fd of its whole local copy (after `map`)

    def __repr__(self) -> str:
        return f"RemoteFiles({self.url!r}, pinned={len(self._pins)})"

    def _where(self, rel: str) -> str:
        return join_url(self.url, rel)

    def listing(self) -> dict[str, ObjectInfo]:
        """Every object under the prefix (listed once)."""
        if self._listing is None:
            self._listing = self.objects.list()
        return self._listing

    def _info(self, rel: str) -> ObjectInfo:
        info = self._pins.get(rel) or self.listing().get(rel)
        if info is None:
            raise SnapshotError(f"{self._where(rel)}: no such object")
        return info

    def pin(self, rel: str) -> None:
        self._pins.setdefault(rel, self._info(rel))

    def size(self, rel: str) -> int:
        return self._info(rel).size

    def _key(self, rel: str, info: ObjectInfo) -> str:
        return entry_key(self._where(rel), info.etag, info.size)

    def read_into(self, rel: str, offset: int, out: np.ndarray) -> None:
        info = self._info(rel)
        view = memoryview(out).cast("B")
        stop = offset + len(view)
        if stop > info.size:
            raise SnapshotError(
                f"{self._where(rel)}: ends at byte {info.size}; bytes {offset}..{stop} were asked for"
            )
        if not view:
            return
        fd = self._whole.get(rel)
        if fd is not None:
            pread_into(fd, out, offset, self._where(rel))
            return
        if self.cache is None:
            view[:] = self.objects.get_range(rel, offset, stop, etag=info.etag)
            return
        size = self.chunk_size
        first, last = offset // size, (stop - 1) // size
        self._fetch_missing(rel, info, range(first, last + 1))
        done = 0
        for k in range(first, last + 1):
            a = max(offset, k * size)
            b = min(stop, (k + 1) * size)
            pread_into(
                self._chunk_fd(rel, info, k), view[done : done + b - a], a - k * size, self._where(rel)
            )
            done += b - a

    def prefetch(self, spans: Any) -> None:
        """Fetch at once (concurrently, per object) the chunks of the byte ranges ``spans`` (``(rel, start,
        stop)``: a batch's images) that neither this process nor the cache holds yet; later reads of them
        are local. Without a cache: nothing to do."""
        if self.cache is None:
            return
        chunks: dict[str, set[int]] = {}
        for rel, start, stop in spans:
            if stop > start and rel not in self._whole:
                chunks.setdefault(rel, set()).update(
                    range(start // self.chunk_size, (stop - 1) // self.chunk_size + 1)
                )
        for rel, wanted in chunks.items():
            self._fetch_missing(rel, self._info(rel), sorted(wanted))

    def _chunk_name(self, rel: str, info: ObjectInfo, k: int) -> str:
        return f"{self._key(rel, info)}-{self.chunk_size >> 10}k-{k}"

    def _chunk_len(self, info: ObjectInfo, k: int) -> int:
        return min(info.size, (k + 1) * self.chunk_size) - k * self.chunk_size

    def _fetch_missing(self, rel: str, info: ObjectInfo, chunks: Any) -> None:
        """Hold a descriptor of every chunk of `chunks`: this process's, the node's cache's, else fetched
        (concurrently) and written there. A descriptor is taken before anything can evict its entry, so
        what a read needs is never fetched twice, whatever the bound or the other processes do."""
        assert self.cache is not None
        missing = []
        for k in chunks:
            if (rel, k) in self._fds:
                self._fds.move_to_end((rel, k))
                continue
            fd = self.cache.open_entry("chunks", self._chunk_name(rel, info, k), self._chunk_len(info, k))
            if fd is None:
                missing.append(k)
            else:
                self._hold(rel, k, fd)
        if not missing:
            return
        spans = [(k * self.chunk_size, k * self.chunk_size + self._chunk_len(info, k)) for k in missing]
        for k, data in zip(missing, self.objects.get_ranges(rel, spans, etag=info.etag), strict=True):
            self._hold(rel, k, self.cache.put_chunk(self._chunk_name(rel, info, k), data))

    def _hold(self, rel: str, k: int, fd: int) -> None:
        self._fds[(rel, k)] = fd
        if len(self._fds) > MAX_OPEN_CHUNKS:
            os.close(self._fds.popitem(last=False)[1])

    def _chunk_fd(self, rel: str, info: ObjectInfo, k: int) -> int:
        fd = self._fds.get((rel, k))
        if fd is None:  # let go of since `_fetch_missing` (a read spanning more than MAX_OPEN_CHUNKS)
            self._fetch_missing(rel, info, range(k, k + 1))
            fd = self._fds[(rel, k)]
        return fd

    def read_bytes(self, rel: str) -> bytes:
        out = np.empty(self.size(rel), np.uint8)
        self.read_into(rel, 0, out)
        return out.tobytes()

    def _download(self, rel: str, info: ObjectInfo) -> Callable[[Any], None]:
        def fill(fh: Any) -> None:
            step = 8 * self.chunk_size  # ranges of one file fetched 8 chunks at a time
            for start in range(0, info.size, step):
                stop = min(info.size, start + step)
                pieces = [(a, min(stop, a + self.chunk_size)) for a in range(start, stop, self.chunk_size)]
                for data in self.objects.get_ranges(rel, pieces, etag=info.etag):
                    fh.write(data)

        return fill

    def _whole_fd(self, rel: str) -> int:
        """A descriptor of the whole file `rel` on local disk (the node's cache, else an unlinked temporary
        file)."""
        fd = self._whole.get(rel)
        if fd is not None:
            return fd
        info = self._info(rel)
        if self.cache is not None:
            fd = self.cache.whole(self._key(rel, info), info.size, self._download(rel, info))
        else:
            with tempfile.TemporaryFile() as fh:
                self._download(rel, info)(fh)
                fh.flush()
                fd = os.dup(fh.fileno())
        self._whole[rel] = fd
        return fd

    def map(self, rel: str, dtype: Any, count: int) -> np.ndarray:
        if count == 0:
            empty = np.zeros(0, dtype)
            empty.setflags(write=False)
            return empty
        fd = self._whole_fd(rel)
        with open(os.dup(fd), "rb") as fh:
            return np.memmap(fh, dtype=dtype, mode="r", shape=(count,))

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])
        while self._whole:
            os.close(self._whole.popitem()[1])

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_fds", "_whole")}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fds, self._whole = OrderedDict(), {}

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:
        for name in ("_fds", "_whole"):
            fds = self.__dict__.get(name) or {}
            while fds:
                try:  # noqa: SIM105 (contextlib may be None at interpreter exit)
                    _close(fds.popitem()[1])
                except OSError:
                    pass

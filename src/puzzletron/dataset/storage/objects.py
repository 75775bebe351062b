"""Objects under an URL prefix (``s3://bucket/prefix``, any fsspec scheme with a backend installed): list,
ranged reads that are retried and bounded in time, uploads, and the create-once write publication ends with.

    objects = Objects("s3://bucket/stores/puzzle-kd")
    listing = objects.list()                                  # {rel: ObjectInfo(size, etag)}, one LIST a 1000
    data = objects.get_range("shards/000000.tokens", 0, 4096, etag=listing[...].etag)
    objects.put_file("shards/000000.tokens", local_path)      # overwrites (before publication)
    objects.create_once("manifest.json", data)                # False when the object exists already

Configuration is the backend's own: credentials, region and endpoint come from its environment and
profiles (``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL`` ...; fsspec's ``FSSPEC_S3_*``
variables), never from an argument this package records or prints. What this module adds to S3 are bounds
(`ObjectOptions`, from ``PUZZLETRON_OBJECT_*`` variables): a connect and a per-read timeout and a number of
retries of our own (botocore's own retries are switched off, so a stalled server costs at most
``(retries + 1) x read_timeout``); a ranged GET sends ``If-Match`` with the ETag the reader pinned, so an
object replaced after that is `ObjectChanged` on the very request that would have served other bytes; the
create-once write sends ``If-None-Match: *``. A dropped connection is retried; a body shorter than asked is
an error, never short data.

The filesystem is created lazily in each process (fsspec's S3 client is not fork-safe), so an `Objects`
pickles as its URL and options.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.storage.settings import check_retries, check_seconds, object_settings

__all__ = [
    "ObjectChanged",
    "ObjectInfo",
    "ObjectOptions",
    "Objects",
    "is_url",
    "join_url",
    "url_name",
    "url_parent",
]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_FS: dict[tuple[Any, ...], Any] = {}  # (protocol, options, pid, environment) -> this process's filesystem
_FS_GUARD = threading.Lock()
_BACKOFF_S = (0.1, 0.3, 1.0, 3.0, 10.0)
_MIN_RATE = float(1 << 20)  # bytes a second a whole-object transfer is allowed on top of the deadline


def is_url(location: Any) -> bool:
    """Whether `location` is an URL with a scheme (``s3://b/p``) rather than a local path (``file://`` is
    a local path too, so it is not one).

    >>> is_url("s3://bucket/store"), is_url("stores/puzzle-kd"), is_url("file:///data/x")
    (True, False, False)
    """
    return isinstance(location, str) and bool(_URL.match(location)) and not location.startswith("file://")


def join_url(url: str, *parts: str) -> str:
    """`url` with the relative POSIX `parts` appended (``join_url("s3://b/p", "a/x") == "s3://b/p/a/x"``)."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts if p)])


def url_name(url: str) -> str:
    """The last component of `url` (``url_name("s3://b/stores/pk") == "pk"``)."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def url_parent(url: str) -> str:
    """`url` without its last component (``url_parent("s3://b/stores/pk") == "s3://b/stores"``)."""
    return url.rstrip("/").rsplit("/", 1)[0]


class ObjectChanged(SnapshotError):
    """An object is not the one pinned: replaced or deleted after the reader (or publisher) saw it."""


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing says of one object: its byte size and ETag (None where the backend has none)."""

    size: int
    etag: str | None


def _setting(name: str) -> Any:
    return lambda: getattr(object_settings(), name)


@dataclass(frozen=True)
class ObjectOptions:
    """Bounds of every request: seconds to connect, seconds a read may wait for the next bytes, retries
    after the first attempt, and seconds one whole request may take (a server trickling a body still ends
    within it; a whole-object upload or download gets one more second a MiB). Defaults from
    ``PUZZLETRON_OBJECT_CONNECT_TIMEOUT_S`` (10), ``..._READ_TIMEOUT_S`` (60), ``..._RETRIES`` (4) and
    ``..._REQUEST_TIMEOUT_S`` (300), read and checked by `storage.settings`; values given here are checked
    the same way (finite seconds above 0, a whole number of retries)."""

    connect_timeout_s: float = field(default_factory=_setting("connect_timeout_s"))
    read_timeout_s: float = field(default_factory=_setting("read_timeout_s"))
    retries: int = field(default_factory=_setting("retries"))
    request_timeout_s: float = field(default_factory=_setting("request_timeout_s"))

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "read_timeout_s", "request_timeout_s"):
            object.__setattr__(self, name, check_seconds(getattr(self, name), name))
        check_retries(self.retries, "retries")

    def deadline(self, size: int = 0) -> float:
        """Seconds one request moving `size` bytes (a whole-object transfer) may take."""
        return self.request_timeout_s + size / _MIN_RATE


def _retryable() -> tuple[type[BaseException], ...]:
    """The errors a new attempt may cure: dropped, reset, stalled or refused connections."""
    kinds: list[type[BaseException]] = [OSError, asyncio.TimeoutError, EOFError, _ShortBody, _Deadline]
    try:
        import aiohttp
        from botocore import exceptions as bx

        kinds += [aiohttp.ClientError, bx.HTTPClientError, bx.ConnectionError, bx.ResponseStreamingError]
    except ImportError:  # not the S3 backend: plain OSErrors and timeouts
        pass
    return tuple(kinds)


class _ShortBody(Exception):
    """A body shorter than the range asked for (the connection ended early)."""


class _Deadline(Exception):
    """A request that took longer than its deadline (`ObjectOptions.deadline`): cancelled, tried again."""


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return str((response or {}).get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


class Objects:
    """The objects under the URL prefix `url` (see the module docstring). Thread-safe for reads."""

    def __init__(self, url: str, *, options: ObjectOptions | None = None) -> None:
        if not is_url(url):
            raise ConfigError(f"{url!r} is not an URL (scheme://...)")
        self.url = url.rstrip("/")
        self.options = options or ObjectOptions()
        self.protocol, _, self._root = self.url.partition("://")
        if not self._root or self._root.startswith("/"):
            raise ConfigError(f"{url}: name a bucket (and a prefix inside it)")

    def __repr__(self) -> str:
        return f"Objects({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "options": self.options, "protocol": self.protocol, "_root": self._root}

    @property
    def is_s3(self) -> bool:
        return self.protocol in ("s3", "s3a")

    @property
    def fs(self) -> Any:
        """This process's filesystem for the scheme (created on first use, again after a fork)."""
        env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("AWS_", "FSSPEC_"))))
        key = (self.protocol, self.options, os.getpid(), env)  # the backend reads its environment
        with _FS_GUARD:
            fs = _FS.get(key)
            if fs is None:
                fs = _FS[key] = self._make_fs()
        return fs

    def _make_fs(self) -> Any:
        import fsspec

        # no listings cache: an object written since a listing (a claim, a manifest) must be seen
        kwargs: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
        if self.is_s3:
            kwargs["config_kwargs"] = {
                "connect_timeout": self.options.connect_timeout_s,
                "read_timeout": self.options.read_timeout_s,
                "retries": {"total_max_attempts": 1},  # ours below, not nested in botocore's
            }
        try:
            fs = fsspec.filesystem(self.protocol, **kwargs)
        except (ImportError, ValueError) as exc:
            extra = " (pip install 'puzzletron-data[s3]')" if self.is_s3 else ""
            raise ConfigError(f"{self.url}: no filesystem for {self.protocol}://{extra}: {exc}") from None
        if self.is_s3:
            fs.retries = 1  # s3fs nests its own retry loops; each request here is one attempt
        return fs

    def path(self, rel: str = "") -> str:
        """The backend path (no scheme) of `rel` under the prefix."""
        return f"{self._root}/{rel}" if rel else self._root

    def url_of(self, rel: str) -> str:
        return join_url(self.url, rel)

    # ------------------------------------------------------------------------------------------- reading

    def list(self, rel: str = "") -> dict[str, ObjectInfo]:
        """Every object under the prefix (or its sub-prefix `rel`), by path relative to the prefix."""
        base = self.path(rel).rstrip("/") + "/"
        found = self._retry(f"listing {self.url_of(rel)}", "find", base, detail=True)
        out = {}
        for name, info in sorted(found.items()):
            if info.get("type", "file") != "file" or not name.startswith(base):
                continue
            out[name[len(self._root) + 1 :]] = ObjectInfo(int(info["size"]), _etag(info))
        return out

    def info(self, rel: str) -> ObjectInfo | None:
        """The size and ETag of the object `rel` (one HEAD), or None when there is none."""
        try:
            info = self._retry(f"looking up {self.url_of(rel)}", "info", self.path(rel))
        except FileNotFoundError:
            return None
        return ObjectInfo(int(info["size"]), _etag(info)) if info.get("type", "file") == "file" else None

    def get(self, rel: str) -> bytes | None:
        """The whole object `rel`, or None when there is none (a caller bounds its size from a listing)."""
        try:
            return self._retry(f"reading {self.url_of(rel)}", "cat_file", self.path(rel))
        except FileNotFoundError:
            return None

    def get_range(self, rel: str, start: int, stop: int, *, etag: str | None = None) -> bytes:
        """Bytes ``[start, stop)`` of `rel`, exactly that many; with `etag` (S3), `ObjectChanged` when the
        object is no longer that one."""
        return self.get_ranges(rel, [(start, stop)], etag=etag)[0]

    def get_ranges(
        self, rel: str, spans: Iterable[tuple[int, int]], *, etag: str | None = None
    ) -> list[bytes]:
        """Several ranges of `rel`, fetched concurrently (S3) or one after the other."""
        spans = list(spans)
        if not spans:
            return []
        if self.is_s3:
            import fsspec.asyn

            fs = self.fs
            return fsspec.asyn.sync(fs.loop, self._s3_ranges, fs, rel, spans, etag)
        where = f"reading {self.url_of(rel)}"
        return [self._checked(self._retry(where, "cat_file", self.path(rel), start=a, end=b), a, b)
                if b > a else b"" for a, b in spans]  # fmt: skip

    @staticmethod
    def _checked(data: bytes, start: int, stop: int) -> bytes:
        if len(data) != stop - start:
            raise _ShortBody(f"{len(data)} of {stop - start} bytes")
        return data

    async def _s3_ranges(
        self, fs: Any, rel: str, spans: list[tuple[int, int]], etag: str | None
    ) -> list[bytes]:
        await fs.set_session()
        bucket, _, key = self.path(rel).partition("/")
        client = await fs.get_s3(bucket)
        gate = asyncio.Semaphore(16)

        async def one(start: int, stop: int) -> bytes:
            async with gate:
                return await self._s3_range(client, bucket, key, start, stop, etag, rel)

        return list(await asyncio.gather(*(one(a, b) for a, b in spans)))

    async def _s3_body(self, client: Any, kwargs: dict[str, Any]) -> bytes:
        response = await client.get_object(**kwargs)
        body = response["Body"]
        try:
            return await body.read()
        finally:
            body.close()

    async def _s3_range(
        self, client: Any, bucket: str, key: str, start: int, stop: int, etag: str | None, rel: str
    ) -> bytes:
        if stop <= start:
            return b""
        kwargs = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{stop - 1}"}
        if etag is not None:
            kwargs["IfMatch"] = etag
        retryable, last = _retryable(), None
        for attempt in range(self.options.retries + 1):
            if attempt:
                await asyncio.sleep(_backoff(attempt))
            try:
                return self._checked(await self._within_deadline(self._s3_body(client, kwargs)), start, stop)
            except Exception as exc:
                code = _error_code(exc)
                if code in ("PreconditionFailed", "412"):
                    raise ObjectChanged(
                        f"{self.url_of(rel)}: the object changed after it was pinned (ETag {etag}): the "
                        "store was overwritten after publication; open it again, or rebuild it"
                    ) from None
                if code in ("NoSuchKey", "404", "NoSuchBucket"):
                    raise ObjectChanged(f"{self.url_of(rel)}: the object is gone ({code})") from None
                if not (code in _TRANSIENT or (not code and isinstance(exc, retryable))):
                    raise
                last = exc
        raise OSError(
            f"{self.url_of(rel)}: bytes {start}..{stop} could not be read in {self.options.retries + 1} "
            f"attempts ({type(last).__name__}: {last})"
        )

    async def _within_deadline(self, call: Any, size: int = 0) -> Any:
        """`await call`, cancelled after `ObjectOptions.deadline` (`_Deadline`: a new attempt follows)."""
        task = asyncio.ensure_future(call)
        deadline = self.options.deadline(size)
        done, _ = await asyncio.wait({task}, timeout=deadline)
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise _Deadline(_deadline_text(deadline))
        return task.result()

    def _call(self, name: str, *args: Any, size: int = 0, **kwargs: Any) -> Any:
        """One attempt of the filesystem call `name`, cancelled after its deadline where the backend is
        asynchronous (s3fs, gcsfs, adlfs); a blocking backend has only its own timeouts."""
        fs = self.fs
        if not getattr(fs, "async_impl", False):
            return getattr(fs, name)(*args, **kwargs)
        import fsspec.asyn

        method = getattr(fs, f"_{name}")
        return fsspec.asyn.sync(fs.loop, self._within_deadline, method(*args, **kwargs), size)

    def _retry(self, what: str, name: str, *args: Any, size: int = 0, **kwargs: Any) -> Any:
        """`_call` with our retries on connection errors and timeouts (not on missing objects); `size`:
        the bytes the call moves (a whole-object transfer's deadline grows with them)."""
        retryable, last = _retryable(), None
        for attempt in range(self.options.retries + 1):
            if attempt:
                time.sleep(_backoff(attempt))
            try:
                return self._call(name, *args, size=size, **kwargs)
            except (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError):
                raise
            except Exception as exc:
                if not isinstance(exc, retryable) and "timeout" not in type(exc).__name__.lower():
                    raise
                last = exc
        raise OSError(f"{what} failed in {self.options.retries + 1} attempts ({type(last).__name__}: {last})")

    # ------------------------------------------------------------------------------------------- writing

    def put_file(self, rel: str, local: str | os.PathLike[str]) -> None:
        """Upload the local file as `rel` (overwriting: only before publication)."""
        local = os.fspath(local)
        self._retry(f"uploading {self.url_of(rel)}", "put_file", local, self.path(rel),
                    size=os.path.getsize(local))  # fmt: skip

    def put_bytes(self, rel: str, data: bytes) -> None:
        self._retry(f"writing {self.url_of(rel)}", "pipe_file", self.path(rel), data, size=len(data))

    def create_once(self, rel: str, data: bytes) -> bool:
        """Write `rel` only if no object has that name (S3: ``If-None-Match: *``, one atomic request); False
        when one exists already (the earlier writer won; its object is unchanged)."""
        try:
            self._retry(f"writing {self.url_of(rel)}", "pipe_file", self.path(rel), data, mode="create",
                        size=len(data))  # fmt: skip
        except FileExistsError:
            return False
        except TypeError as exc:  # a backend whose pipe_file has no create mode
            raise ConfigError(f"{self.url}: this filesystem has no create-once write ({exc})") from None
        return True

    def download(
        self, folder: str | os.PathLike[str], files: Mapping[str, int | None], *, max_unsized: int = 1 << 30
    ) -> None:
        """Copy the objects `files` names into the local `folder` (created), by relative path, and nothing
        else under the prefix. ``files[rel]`` is the object's size in bytes as a manifest records it (an
        object listed with another size is refused before a byte of it is read), or None where the manifest
        records none (then at most `max_unsized` bytes). `SnapshotError` naming the object otherwise."""
        listing = self.list()
        for rel, size in sorted(files.items()):
            if rel.startswith("/") or any(part in ("", ".", "..") for part in rel.split("/")):
                raise SnapshotError(f"{self.url_of(rel)}: an object name that is no relative path")
            info = listing.get(rel)
            if info is None:
                raise SnapshotError(f"{self.url_of(rel)}: missing")
            if info.size != (info.size if size is None else size) or info.size > max(size or 0, max_unsized):
                bound = f"the manifest records {size}" if size is not None else f"the bound is {max_unsized}"
                raise SnapshotError(f"{self.url_of(rel)} has {info.size} bytes; {bound}")
            target = os.path.join(folder, *rel.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            self._retry(f"downloading {self.url_of(rel)}", "get_file", self.path(rel), target, size=info.size)
            if os.path.getsize(target) != info.size:
                raise SnapshotError(f"{self.url_of(rel)}: changed while it was downloaded")

    def upload(self, folder: str | os.PathLike[str], *, last: str | None = None) -> None:
        """Upload every regular file under the local `folder` by relative path; `last` (a relative path:
        the manifest) is left out, for the caller to write once after the rest."""
        for base, _, names in sorted(os.walk(folder)):
            for name in sorted(names):
                local = os.path.join(base, name)
                rel = os.path.relpath(local, folder).replace(os.sep, "/")
                if rel != last and os.path.isfile(local) and not os.path.islink(local):
                    self.put_file(rel, local)

    def delete(self, rels: Iterable[str]) -> None:
        """Remove the objects `rels` (missing ones are fine)."""
        paths = [self.path(rel) for rel in rels]
        if paths:
            self._retry(f"removing objects under {self.url}", "rm", paths)


_TRANSIENT = ("SlowDown", "InternalError", "ServiceUnavailable", "503", "500", "RequestTimeout")


def _backoff(attempt: int) -> float:
    """Seconds to wait before attempt `attempt` (1, 2, ...)."""
    return _BACKOFF_S[min(attempt - 1, len(_BACKOFF_S) - 1)]


def _deadline_text(seconds: float) -> str:
    return f"no whole answer within {seconds:g} s (PUZZLETRON_OBJECT_REQUEST_TIMEOUT_S)"


def _etag(info: Mapping[str, Any]) -> str | None:
    etag = info.get("ETag") or info.get("etag")
    return str(etag) if etag else None

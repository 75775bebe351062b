"""Crash-safe publication of a directory: an exclusive lock, a transaction directory, fsync, one rename.

The protocol every writer of a destination follows::

    with locked(dest):                      # one writer per destination, across processes
        if complete(dest):
            reuse(dest)
        else:
            with staging_dir(dest) as tmp:  # <parent>/.<name>.txn-<pid>-<token>
                write(tmp)                  # on exit: fsync tree, rename(tmp, dest), fsync parent

A run killed at any point leaves either no destination or a complete one; its transaction directory is
swept by the next holder of the lock. Because a transaction directory is only ever created by the holder
of the destination lock, every transaction directory found while holding that lock is stale: this avoids
trusting pids, which the kernel reuses.

Names: the lock is ``.<name>.lock`` and a transaction ``.<name>.txn-<pid>-<16 hex>`` beside the destination
(a writer's other work directories likewise: `sibling_prefix`, e.g. a token store's ``.<name>.build-<16
hex>``); a name too long to take those suffixes within `NAME_MAX` bytes (about 222 bytes and more) uses
``pz-<32 hex of its SHA-256>`` in their place, so every destination name a file system accepts can be
written. A longer name is a `ConfigError` (`check_destination`), raised before anything is created.

Forked children never hold a lock: a lock is an ``flock`` on an open file description, which a fork shares
with the child, so a worker that outlived its parent (killed by ``kill`` or the OOM killer) would keep the
destination locked and every rerun would wait forever. Every process fork closes, in the child, the lock
descriptors this process holds (`os.register_at_fork`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import secrets
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from puzzletron.dataset.errors import ConfigError

__all__ = [
    "NAME_MAX",
    "check_destination",
    "close_in_children",
    "fsync_path",
    "fsync_tree",
    "locked",
    "note_publication",
    "publications",
    "sibling_prefix",
    "staging_dir",
    "sweep_stale",
    "tidy",
    "total_publications",
    "txn_prefix",
    "with_path",
]

logger = logging.getLogger(__name__)

NAME_MAX = 255  # bytes in one path component (Linux, every common file system)
_TXN_ROOM = len("..txn-") + 10 + 1 + 16  # what a transaction name adds to the stem (a pid has <= 10 digits)
_PUBLISHED: dict[str, int] = {}  # how often this process published each destination (`publications`)

# Destinations locked by this process -> the thread holding it; lets `staging_dir` check the protocol.
_HELD: dict[str, int] = {}
_HELD_GUARD = threading.Lock()
_LOCK_FDS: dict[str, int] = {}  # destination -> the descriptor of its held lock (closed in forked children)


def _forget_locks_in_child() -> None:
    """In a forked child: close the inherited lock descriptors (the parent alone holds its locks)."""
    for fd in _LOCK_FDS.values():
        with suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


def close_in_children(key: str, fd: int | None) -> None:
    """Have the lock descriptor `fd` this process holds closed in every forked child (None: forget `key`),
    as this module's own locks are (`storage.scratch`'s folder locks use it)."""
    with _HELD_GUARD:
        if fd is None:
            _LOCK_FDS.pop(key, None)
        else:
            _LOCK_FDS[key] = fd


def with_path(exc: OSError, path: Path) -> OSError:
    """`exc` naming `path` when it names no file (a full disk says ``No space left on device`` on a write,
    without saying where): the same error type and errno, so callers still tell ENOSPC from EROFS."""
    if exc.filename is not None:
        return exc
    return type(exc)(exc.errno, exc.strerror or str(exc), str(path))


def fsync_path(path: Path, *, directory: bool) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every regular file and directory below `path` (symlinks are not followed), then `path`."""
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        fsync_path(path, directory=False)
        return
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            file = Path(root, name)
            if file.is_file() and not file.is_symlink():
                fsync_path(file, directory=False)
        for name in dirs:
            sub = Path(root, name)
            if not sub.is_symlink():
                fsync_path(sub, directory=True)
    fsync_path(path, directory=True)


def check_destination(destination: str | Path, what: str = "output directory") -> Path:
    """`destination` made absolute; `ConfigError` when its name is longer than `NAME_MAX` bytes (no file
    system could hold it: better said before any request than as ``File name too long`` after one).

    >>> check_destination("/data/" + "x" * 256)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    puzzletron.dataset.errors.ConfigError: output directory name 'xxx...' is 256 bytes; a file name may ...
    """
    path = _normal(Path(destination))
    size = len(os.fsencode(path.name))
    if size > NAME_MAX:
        shown = path.name if len(path.name) <= 32 else f"{path.name[:32]}..."
        raise ConfigError(f"{what} name {shown!r} is {size} bytes; a file name may have at most {NAME_MAX}")
    return path


def _stem(destination: Path) -> str:
    """What the lock and transaction names of `destination` are built on: its name, or a digest of it when
    the name plus the longest suffix would not fit in `NAME_MAX` bytes."""
    raw = os.fsencode(Path(destination).name)
    if len(raw) + _TXN_ROOM <= NAME_MAX:
        return Path(destination).name
    return f"pz-{hashlib.sha256(raw).hexdigest()[:32]}"


def sibling_prefix(destination: Path, kind: str) -> str:
    """The name prefix of a writer's `kind` work directories of `destination` in its parent
    (``.<name>.<kind>-``; the name is a digest when too long, see the module docstring). `kind` must be at
    most 5 bytes; a suffix of up to 25 more bytes then fits `NAME_MAX`."""
    if len(kind.encode()) > 5:
        raise ValueError(f"sibling kind {kind!r} is longer than 5 bytes")
    return f".{_stem(destination)}.{kind}-"


def txn_prefix(destination: Path) -> str:
    """The name prefix of transaction directories of `destination` (they live in its parent)."""
    return sibling_prefix(destination, "txn")


def _lock_path(destination: Path) -> Path:
    destination = Path(destination)
    return destination.parent / f".{_stem(destination)}.lock"


def publications(destination: str | Path) -> int:
    """How many times this process published `destination` (a `staging_dir` renamed into place): a call
    that leaves it unchanged reused what was there."""
    return _PUBLISHED.get(_key(Path(destination)), 0)


def note_publication(destination: str) -> None:
    """Count one publication of `destination` made without `staging_dir` (an URL prefix whose manifest this
    process wrote: `publications` and `total_publications` see it)."""
    _PUBLISHED[destination] = _PUBLISHED.get(destination, 0) + 1


def total_publications() -> int:
    """How many directories this process has published so far (any destination)."""
    return sum(_PUBLISHED.values())


def _normal(destination: Path) -> Path:
    """`destination` made absolute and normalised: ``.`` or ``out/`` must lock and stage beside the
    directory, in its real parent, never inside it."""
    return Path(os.path.abspath(destination))


def _key(destination: Path) -> str:
    return str(_normal(destination))


def sweep_stale(destination: Path) -> list[Path]:
    """Remove the transaction directories of `destination`; call only while holding `locked(destination)`."""
    destination = Path(destination)
    removed = []
    if not destination.parent.is_dir():
        return removed
    # Exactly our names: the prefix alone would also match another destination called "<name>.txn-...".
    pattern = re.compile(re.escape(txn_prefix(destination)) + r"\d+-[0-9a-f]{16}")
    for entry in sorted(destination.parent.iterdir()):
        if pattern.fullmatch(entry.name):
            logger.info("removing stale transaction directory %s", entry)
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
    if removed:
        fsync_path(destination.parent, directory=True)
    return removed


def _make_parents(directory: Path) -> list[Path]:
    """`mkdir -p directory`; return the directories this call created, deepest first."""
    missing = []
    for candidate in (directory, *directory.parents):
        if candidate.is_dir():
            break
        missing.append(candidate)
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_empty(created: list[Path]) -> None:
    """rmdir the directories `locked` created (deepest first), stopping at the first one that is in use.

    `rmdir` only removes an empty directory, so a directory another process has meanwhile put a lock file
    or a destination in survives; such a process, if it loses the race, recreates the directory (see the
    retry in `locked`).
    """
    for directory in created:
        try:
            os.rmdir(directory)
        except OSError:
            return


def _acquire(lock_path: Path) -> int:
    """Open and flock `lock_path` (blocking); return the fd once it is the lock file currently linked there.

    Retries when the file was unlinked (by the previous holder's release) while we waited, and when its
    directory was removed by a failed run's clean-up in between (recreated here).
    """
    while True:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            continue  # the parent vanished between mkdir and open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)


@contextmanager
def locked(destination: Path) -> Iterator[None]:
    """Hold an exclusive, inter-process lock on `destination` (blocking); sweep its stale transactions.

    The lock is `flock` on `<parent>/.<name>.lock`. The lock file is removed on release; a waiter that
    acquired a lock file already unlinked by the previous holder notices (inode changed) and retries, so
    removal never lets two holders in at once. Parent directories created here are removed again on release
    when nothing was published (a failed run leaves no empty directories the user did not ask for).
    Re-entrant within a thread: a nested `locked` of a destination the thread already holds (e.g. a caller
    holding it around `materialize_...`) just yields.
    """
    destination = check_destination(destination)
    if _holds(destination):
        yield
        return
    created = _make_parents(destination.parent)
    lock_path = _lock_path(destination)
    fd = _acquire(lock_path)
    key = _key(destination)
    with _HELD_GUARD:
        _HELD[key] = threading.get_ident()
        _LOCK_FDS[key] = fd
    try:
        sweep_stale(destination)
        yield
    finally:
        with _HELD_GUARD:
            _HELD.pop(key, None)
            _LOCK_FDS.pop(key, None)
        with suppress(FileNotFoundError):
            os.unlink(lock_path)
        if not os.path.lexists(destination):
            _remove_empty(created)
        os.close(fd)


def tidy(destination: Path) -> None:
    """Remove what a killed run left beside the complete `destination` (its lock file, transaction
    directories), under the lock; nothing is locked when there is nothing to remove, so a reader of a
    complete snapshot needs no lock. Best effort: a file system that refuses (read-only) is left as it is."""
    destination = _normal(destination)
    prefix = txn_prefix(destination)
    try:
        debris = _lock_path(destination).exists() or any(
            entry.name.startswith(prefix) for entry in os.scandir(destination.parent)
        )
        if debris:
            with locked(destination):
                pass  # `locked` sweeps the transactions and removes the lock file on release
    except OSError as exc:
        logger.info("left what a killed run left beside %s: %s", destination, exc)


def _holds(destination: Path) -> bool:
    with _HELD_GUARD:
        return _HELD.get(_key(destination)) == threading.get_ident()


def _check_free(destination: Path) -> None:
    if destination.is_symlink() or (destination.exists() and not destination.is_dir()):
        raise FileExistsError(errno.EEXIST, "destination exists and is not a directory", str(destination))
    if destination.is_dir() and any(destination.iterdir()):
        raise FileExistsError(errno.ENOTEMPTY, "destination exists and is not empty", str(destination))


@contextmanager
def staging_dir(destination: Path) -> Iterator[Path]:
    """Yield a fresh transaction directory; publish it as `destination` on normal exit, remove it on error.

    `destination` must be absent or an empty directory (which the rename replaces atomically). Takes
    `locked(destination)` itself when the calling thread does not already hold it.
    """
    destination = _normal(destination)
    if not _holds(destination):
        with locked(destination), staging_dir(destination) as tmp:
            yield tmp
        return
    _check_free(destination)
    tmp = destination.parent / f"{txn_prefix(destination)}{os.getpid()}-{secrets.token_hex(8)}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        fsync_path(destination.parent, directory=True)
        _check_free(destination)
        os.rename(tmp, destination)
        _PUBLISHED[_key(destination)] = _PUBLISHED.get(_key(destination), 0) + 1
        fsync_path(destination.parent, directory=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise with_path(exc, destination) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

"""Scratch folders private to one live process, under a parent many processes share (the node's object
cache's ``builds/``: every rank and every concurrent build of a node).

    with private_scratch(parent / f"{digest[:16]}-{token}") as folder:   # this process's alone
        ...                                                             # removed on exit

Each folder ``<name>/`` has a lock file ``<name>.lock`` its process holds (``flock``) while it uses it.
Entering one sweeps the parent: a folder whose lock no process holds belongs to a process that was killed
and is removed, a live one's is never touched (the kernel drops a dead process's ``flock``; no pid is
trusted). So two builds of one identity on one node, or the ranks of two ``torchrun`` jobs, never delete
each other's files, and a killed build's scratch does not outlive the next build on the node. A folder
with no lock file at all (an older version's) is removed once it is an hour old.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from puzzletron.dataset.storage.atomic import close_in_children

__all__ = ["private_scratch", "sweep_scratch"]

_LOCK = ".lock"
_UNLOCKED_S = 3600.0
_HELD: set[str] = set()  # folders this process holds (their lock descriptors are closed in forked children)


def _lock_of(folder: Path) -> Path:
    return folder.with_name(folder.name + _LOCK)


def _take(lock: Path, *, wait: bool) -> int | None:
    """A descriptor holding `lock` while it is the file linked there; None when another process holds it
    (``wait=False``) or it is gone."""
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if wait else 0), 0o644)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # unlinked by a sweeper between open and flock
        if not wait:
            return None


def sweep_scratch(parent: Path, *, keep: Path | None = None) -> None:
    """Remove the folders of `parent` whose process is gone (their lock is free), but `keep`."""
    if not parent.is_dir():
        return
    for entry in sorted(parent.iterdir()):
        if entry == keep or entry.name.endswith(_LOCK) or not entry.is_dir():
            continue
        lock = _lock_of(entry)
        if not lock.exists():
            with suppress(FileNotFoundError):
                if time.time() - entry.stat().st_mtime > _UNLOCKED_S:
                    shutil.rmtree(entry, ignore_errors=True)
            continue
        fd = _take(lock, wait=False)
        if fd is None:  # held: a live process's
            continue
        try:
            shutil.rmtree(entry, ignore_errors=True)
            with suppress(FileNotFoundError):
                os.unlink(lock)
        finally:
            os.close(fd)


@contextmanager
def private_scratch(folder: Path) -> Iterator[Path]:
    """Hold `folder` (created) for this process while the block runs, after sweeping its parent of dead
    processes' folders; remove it on exit. Re-entrant: a nested call for a held folder just yields it."""
    key = f"scratch:{folder}"
    if key in _HELD:
        yield folder
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    fd = _take(_lock_of(folder), wait=True)
    assert fd is not None
    _HELD.add(key)
    close_in_children(key, fd)
    try:
        sweep_scratch(folder.parent, keep=folder)
        folder.mkdir(exist_ok=True)
        yield folder
    finally:
        _HELD.discard(key)
        close_in_children(key, None)
        shutil.rmtree(folder, ignore_errors=True)
        with suppress(FileNotFoundError):
            os.unlink(_lock_of(folder))
        os.close(fd)

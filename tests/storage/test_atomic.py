"""Publication is all-or-nothing, one writer holds a destination at a time, stale transactions are swept."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from puzzletron.dataset.storage.atomic import fsync_tree, locked, staging_dir, txn_prefix

FORK = multiprocessing.get_context("fork")


def test_staging_dir_publishes_whole_tree_and_leaves_nothing_else(tmp_path):
    dest = tmp_path / "out" / "dest"
    with locked(dest), staging_dir(dest) as tmp:
        assert tmp.parent == dest.parent and tmp.name.startswith(txn_prefix(dest))
        assert not dest.exists()
        (tmp / "sub").mkdir()
        (tmp / "sub" / "f").write_text("x")
    assert (dest / "sub" / "f").read_text() == "x"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["dest"]  # no txn dir, no lock file


def test_staging_dir_removes_the_transaction_on_error(tmp_path):
    dest = tmp_path / "dest"
    with pytest.raises(RuntimeError, match="boom"), staging_dir(dest) as tmp:
        (tmp / "f").write_text("half")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_staging_dir_refuses_a_non_empty_destination_but_replaces_an_empty_one(tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    with staging_dir(dest) as tmp:
        (tmp / "f").write_text("1")
    assert (dest / "f").read_text() == "1"
    with pytest.raises(FileExistsError), staging_dir(dest) as tmp:
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]


def test_locked_sweeps_transactions_left_by_a_killed_writer(tmp_path):
    dest = tmp_path / "dest"

    def writer(ready):
        with locked(dest), staging_dir(dest) as tmp:
            (tmp / "f").write_text("partial")
            ready.set()
            time.sleep(60)

    ready = FORK.Event()
    proc = FORK.Process(target=writer, args=(ready,))
    proc.start()
    assert ready.wait(30)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(txn_prefix(dest))]
    assert len(leftovers) == 1 and leftovers[0].startswith(f"{txn_prefix(dest)}{proc.pid}-")
    with locked(dest):
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(txn_prefix(dest))] == []
    assert not dest.exists()


def _hold(dest, log, hold_s):
    with locked(dest):
        with open(log, "a") as fh:
            fh.write(f"enter {os.getpid()}\n")
            fh.flush()
        time.sleep(hold_s)
        with open(log, "a") as fh:
            fh.write(f"exit {os.getpid()}\n")


def test_locked_excludes_other_processes(tmp_path):
    dest, log = tmp_path / "dest", tmp_path / "log"
    procs = [FORK.Process(target=_hold, args=(dest, log, 0.15)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    events = log.read_text().split("\n")[:-1]
    assert len(events) == 8
    for enter, leave in zip(events[::2], events[1::2], strict=True):  # strictly nested: never interleaved
        assert enter.startswith("enter") and leave == "exit" + enter[len("enter") :]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log"]


def test_fsync_tree_accepts_files_dirs_and_symlinks(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"1")
    (tmp_path / "link").symlink_to("/nonexistent")
    fsync_tree(tmp_path)
    fsync_tree(tmp_path / "d" / "f")


def test_sweep_leaves_a_similarly_named_destination_alone(tmp_path):
    dest, other = tmp_path / "a", tmp_path / "a.txn-1"  # other's lock and txn names start with ".a.txn-"
    stale = tmp_path / f"{txn_prefix(dest)}123-{'0' * 16}"
    stale.mkdir()
    with locked(other), staging_dir(other) as tmp:
        (tmp / "f").write_text("other")
        with locked(dest):
            assert tmp.is_dir() and (tmp_path / ".a.txn-1.lock").exists()
        assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txn-1"]


def test_locked_is_reentrant_within_a_thread(tmp_path):
    dest = tmp_path / "dest"
    with locked(dest):
        with locked(dest):  # would deadlock on flock without re-entrancy
            pass
        with staging_dir(dest) as tmp:  # still held after the nested exit
            (tmp / "f").write_text("1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]


def test_a_failed_run_removes_the_parent_directories_it_created_and_only_those(tmp_path):
    (tmp_path / "mine").mkdir()
    dest = tmp_path / "mine" / "a" / "b" / "dest"
    with pytest.raises(RuntimeError, match="boom"), staging_dir(dest) as tmp:
        (tmp / "x").write_text("half")
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["mine"]  # a/ and b/ were ours; mine/ was not


def test_a_published_run_keeps_its_parent_directories(tmp_path):
    dest = tmp_path / "a" / "dest"
    with staging_dir(dest) as tmp:
        (tmp / "x").write_text("done")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["a", "a/dest", "a/dest/x"]


def test_a_waiter_survives_the_failed_holder_removing_the_parent(tmp_path):
    import threading

    dest = tmp_path / "a" / "dest"
    holding, waited = threading.Event(), []

    def waiter():
        holding.wait()
        with staging_dir(dest) as tmp:  # blocks on the lock, then finds its directory gone: recreates it
            (tmp / "x").write_text("second")
        waited.append(True)

    thread = threading.Thread(target=waiter)
    thread.start()
    with pytest.raises(RuntimeError, match="first fails"), locked(dest):
        holding.set()
        time.sleep(0.2)  # let the waiter open the lock file and block on it
        raise RuntimeError("first fails")
    thread.join(10)
    assert waited == [True]
    assert (dest / "x").read_text() == "second"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["dest"]


_HOLD_AND_DIE = """
import os, signal, sys, time
from pathlib import Path
from puzzletron.dataset.storage.atomic import locked
with locked(Path(sys.argv[1])):
    child = os.fork()
    if child == 0:  # a worker that outlives its parent
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # killed while holding the lock: no release runs
"""


def test_a_forked_child_never_holds_its_parents_lock(tmp_path):
    dest = tmp_path / "dest"
    done = subprocess.run([sys.executable, "-c", _HOLD_AND_DIE, str(dest)], capture_output=True, text=True)
    child = int(done.stdout.split()[0])
    try:
        lock = tmp_path / ".dest.lock"  # left behind by the killed parent, its child still alive
        assert lock.exists() and os.path.exists(f"/proc/{child}")
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: the child closed its copy at fork
        finally:
            os.close(fd)
        with locked(dest):
            pass
    finally:
        os.kill(child, signal.SIGKILL)

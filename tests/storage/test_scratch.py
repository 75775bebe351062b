"""Scratch folders private to a live process: a folder whose process was killed is swept by the next one
that starts, a live process's is never touched, whatever runs beside it on the node."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

from puzzletron.dataset.storage.scratch import private_scratch, sweep_scratch

FORK = multiprocessing.get_context("fork")


def _hold(folder: Path, ready, stop) -> None:
    with private_scratch(folder) as mine:
        (mine / "work").write_text("in progress")
        ready.set()
        stop.wait(120)


def test_a_live_processs_folder_is_kept_and_a_killed_ones_is_swept(tmp_path: Path) -> None:
    ready, stop = FORK.Event(), FORK.Event()
    live = FORK.Process(target=_hold, args=(tmp_path / "a-live", ready, stop))
    live.start()
    assert ready.wait(60)
    ready.clear()
    killed = FORK.Process(target=_hold, args=(tmp_path / "b-killed", ready, FORK.Event()))
    killed.start()
    assert ready.wait(60)
    os.kill(killed.pid, signal.SIGKILL)
    killed.join(60)
    with private_scratch(tmp_path / "c-mine") as mine:  # entering sweeps
        assert (tmp_path / "a-live" / "work").read_text() == "in progress"
        assert not (tmp_path / "b-killed").exists() and not (tmp_path / "b-killed.lock").exists()
        assert mine.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-live", "a-live.lock"]  # mine removed on exit
    stop.set()
    live.join(60)
    assert live.exitcode == 0 and list(tmp_path.iterdir()) == []


def test_a_folder_without_a_lock_is_left_until_it_is_an_hour_old(tmp_path: Path) -> None:
    young, old = tmp_path / "young", tmp_path / "old"
    young.mkdir()
    old.mkdir()
    os.utime(old, (0, 0))
    sweep_scratch(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["young"]

"""The subset writer under crashes and contention: a SIGKILL at 20 seeded audit-event points across every
phase leaves the destination absent or complete and the rerun leaves no debris; of four concurrent writers
one writes and all get identical manifests; a caller that already holds the destination's lock can write."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest

from _conversation_samples import jpeg_bytes, single_row, single_samples
from _files import siblings
from puzzletron.dataset import materialize_normalized_conversation_samples, normalize_intersyn_single
from puzzletron.dataset.formats.subset import verify_subset

FORK = multiprocessing.get_context("fork")


# The kill points are audit events (PEP 578: `open`, `os.mkdir`, `os.rename`, ...) on paths under the
# destination's parent, counted in the child: the hook runs *before* the operation, so "kill at event k"
# is a precise, repeatable place. A traced run (not killed) lists the events and their phases once.
_WATCHED = {"open", "os.mkdir", "os.rename", "os.unlink", "os.remove", "os.rmdir", "os.listdir", "os.scandir"}
_KILL_SAMPLES = 6


def _kill_samples() -> list:
    return [
        normalize_intersyn_single(single_row(i, image={"bytes": jpeg_bytes(i, (64, 48)), "path": None}))
        for i in range(_KILL_SAMPLES)
    ]


def _materialize_until_event(dest: Path, kill_at: int | None, trace: Path | None) -> None:
    """Child process: materialise, SIGKILLing itself at the `kill_at`-th watched event (1-based)."""
    import sys

    parent, seen = str(dest.parent), []

    def hook(event: str, args: tuple) -> None:
        if event not in _WATCHED or not args or not isinstance(args[0], str | os.PathLike):
            return
        path = os.fspath(args[0])
        if not isinstance(path, str) or not path.startswith(parent):
            return
        seen.append((event, os.path.relpath(path, parent)))
        if len(seen) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    materialize_normalized_conversation_samples(
        iter(_kill_samples()), dest, acquisition={"k": "kill"}, expected_count=_KILL_SAMPLES
    )
    if trace is not None:
        trace.write_text(json.dumps(seen))


def _phase(events: list, k: int) -> str:
    """The phase of the 1-based event `k` of a traced run."""

    def first(test) -> int:
        return next(i for i, (event, path) in enumerate(events, 1) if test(event, path))

    first_image = first(lambda event, path: "/images/" in path)
    index = first(lambda event, path: path.endswith("/samples.idx"))  # written after the last sample
    rename = first(lambda event, path: event == "os.rename")
    if k < first_image:
        return "before: lock, sweep, transaction directory, sample file"
    if k < index:
        return "image writes"
    if k < rename:
        return "index, manifest, fsync of the tree and the parent"
    if k == rename:
        return "at the rename"
    return "after the rename"


@pytest.mark.slow
def test_sigkill_in_every_phase_leaves_absent_or_complete_and_a_rerun_leaves_no_debris(tmp_path):
    trace = tmp_path / "trace.json"
    probe = FORK.Process(target=_materialize_until_event, args=(tmp_path / "probe" / "dest", None, trace))
    probe.start()
    probe.join(60)
    assert probe.exitcode == 0
    events = json.loads(trace.read_text())
    phases: dict[str, list[int]] = {}
    for k in range(1, len(events) + 1):
        phases.setdefault(_phase(events, k), []).append(k)
    assert len(phases) == 5, phases
    # 20 kill points, seeded: 4 per phase (every event when a phase has fewer, the rest from the others).
    rng = random.Random(20240601)
    points = sorted({k for ks in phases.values() for k in rng.sample(ks, min(4, len(ks)))})
    spare = sorted(set(range(1, len(events) + 1)) - set(points))
    points = sorted(points + rng.sample(spare, 20 - len(points)))
    assert len(points) == 20
    seen_phases, outcomes = set(), set()
    for k in points:
        dest = tmp_path / f"kill{k}" / "dest"
        proc = FORK.Process(target=_materialize_until_event, args=(dest, k, None))
        proc.start()
        proc.join(60)
        assert proc.exitcode == -signal.SIGKILL, f"kill at event {k} {events[k - 1]} did not happen"
        phase = _phase(events, k)
        expected = "complete" if phase == "after the rename" else "absent"
        outcome = "complete" if dest.exists() else "absent"
        assert outcome == expected, f"kill at event {k} {events[k - 1]} ({phase}): {outcome}"
        if outcome == "complete":
            assert verify_subset(dest).ok, verify_subset(dest).problems
        seen_phases.add(phase)
        outcomes.add(outcome)
        manifest = materialize_normalized_conversation_samples(
            iter(_kill_samples()), dest, acquisition={"k": "kill"}
        )
        assert manifest["sample_count"] == _KILL_SAMPLES and verify_subset(dest).ok
        assert siblings(dest) == ["dest"], f"debris (.txn-*, .lock) after the kill at event {k}"
    assert seen_phases == set(phases)
    assert outcomes == {"absent", "complete"}


def _concurrent_writer(dest: Path, barrier, results: Path) -> None:
    import logging

    # The library's own log says which path each process took: "published" (the writer) or "reusing".
    handler = logging.FileHandler(results / f"log-{os.getpid()}.txt")
    logger = logging.getLogger("puzzletron.dataset.formats.subset.writer")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    def stream():
        (results / f"writer-{os.getpid()}").touch()  # only the writer ever asks for samples
        for sample in single_samples(6):
            time.sleep(0.01)
            yield sample

    barrier.wait()
    manifest = materialize_normalized_conversation_samples(stream(), dest, acquisition={"c": 4})
    (results / f"manifest-{os.getpid()}.json").write_text(json.dumps(manifest, sort_keys=True))
    handler.close()


def test_four_concurrent_writers_one_writes_all_get_identical_manifests(tmp_path):
    dest, results = tmp_path / "out" / "dest", tmp_path / "results"
    results.mkdir()
    barrier = FORK.Barrier(4)
    procs = [FORK.Process(target=_concurrent_writer, args=(dest, barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    writers = [p.name.removeprefix("writer-") for p in results.glob("writer-*")]
    assert len(writers) == 1
    logs = {p.name.removeprefix("log-").removesuffix(".txt"): p.read_text() for p in results.glob("log-*")}
    assert len(logs) == 4
    published = sorted(pid for pid, log in logs.items() if "published subset at" in log)
    reused = sorted(pid for pid, log in logs.items() if "reusing the complete subset" in log)
    assert published == writers and len(reused) == 3 and writers[0] not in reused
    manifests = {p.read_text() for p in results.glob("manifest-*.json")}
    assert len(list(results.glob("manifest-*.json"))) == 4 and len(manifests) == 1
    assert verify_subset(dest).ok
    assert siblings(dest) == ["dest"]


def test_materialize_inside_a_callers_lock_of_the_same_destination(tmp_path):
    from puzzletron.dataset.storage.atomic import locked

    dest = tmp_path / "subset"
    with locked(dest):
        manifest = materialize_normalized_conversation_samples(iter(single_samples(1)), dest)
    assert manifest["sample_count"] == 1 and siblings(dest) == ["subset"]

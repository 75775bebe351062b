"""Token store builds against damaged inputs and careless runs (``docs/trust-model.md``): a snapshot edited
after it was written builds nothing under its clean identity; a killed parent takes its workers along and
leaves the lock free; a sibling output's build is left alone; long names build; a failure leaves no empty
build directory; of two concurrent runs only the one that publishes says "done"."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _token_store_data import ROWS_PER_SHARD
from puzzletron.cli import main
from puzzletron.dataset import formats
from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.tokenize import build_token_store
from puzzletron.fixtures.hostile_tokenizers import hostile_tokenizer
from puzzletron.fixtures.tampering import edit_arrow_in_place

OPTIONS = TokenizeOptions(rows_per_shard=ROWS_PER_SHARD)


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def test_an_arrow_file_edited_in_place_builds_nothing_and_does_not_poison_the_cache(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(snapshot, damaged)
    arrow = next((damaged / "train").glob("data-*.arrow"))
    old, new = edit_arrow_in_place(arrow)
    clean_arrow = next((snapshot / "train").glob("data-*.arrow"))
    assert old != new and arrow.stat().st_size == clean_arrow.stat().st_size
    cache = tmp_path / "cache"
    with pytest.raises(SnapshotError) as exc:
        build_token_store(damaged, tokenizer=tokenizer_dir, cache_dir=cache, options=OPTIONS)
    assert f"train/{arrow.name} differs from the SHA-256 its manifest records" in _one_line(exc)
    assert not cache.exists() or not any(cache.iterdir())  # nothing published, no build directory left
    clean = build_token_store(snapshot, tokenizer=tokenizer_dir, cache_dir=cache, options=OPTIONS)
    assert sorted(p.name for p in cache.iterdir()) == [clean.name]


# ------------------------------------------------------------------------------- processes, names, status

_CLI = [sys.executable, "-m", "puzzletron.cli"]


def _tokenize_argv(snapshot: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    return [*_CLI, "tokenize", str(snapshot), "--tokenizer", str(tokenizer), "--output", str(out), *extra]


def test_killing_the_parent_of_tokenize_num_proc_2_kills_its_workers_and_the_rerun_completes(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    psutil = pytest.importorskip("psutil")
    slow = hostile_tokenizer(tokenizer_dir, tmp_path / "slow", "slow")
    out = tmp_path / "store"
    argv = _tokenize_argv(snapshot, slow, out, "--num-proc", "2", "--rows-per-shard", "2", "--quiet")
    parent = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    workers: list = []
    while len(workers) < 2:  # both forked workers are up and tokenising
        assert parent.poll() is None and time.monotonic() < deadline, parent.communicate()
        workers = psutil.Process(parent.pid).children()
        time.sleep(0.02)
    os.kill(parent.pid, signal.SIGKILL)  # what the OOM killer does; `kill PID` (SIGTERM) ends it the same way
    parent.wait(timeout=30)
    _, alive = psutil.wait_procs(workers, timeout=20)
    assert not alive, [p.pid for p in alive]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)  # the lock is free
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "done" and formats.verify(out).ok


def test_a_build_does_not_sweep_a_sibling_outputs_build_directory(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    sibling = tmp_path / ".s.build-x.build-0123456789abcdef"  # the build directory of an output "s.build-x"
    (sibling / "shard-000000").mkdir(parents=True)
    build_token_store(snapshot, tokenizer=tokenizer_dir, output=tmp_path / "s", split="validation")
    assert (sibling / "shard-000000").is_dir()


@pytest.mark.parametrize("size", [232, 255])
def test_output_names_up_to_255_bytes_build_and_leave_no_debris(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, size: int
) -> None:
    out = tmp_path / ("n" * size)
    build_token_store(snapshot, tokenizer=tokenizer_dir, output=out, split="validation")
    assert [p.name for p in tmp_path.iterdir()] == [out.name] and formats.verify(out).ok


def test_a_failed_tokenize_leaves_no_empty_build_directory(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = hostile_tokenizer(tokenizer_dir, tmp_path / "tok", "zero-division")
    out = tmp_path / "out" / "store"
    argv = [
        "tokenize",
        str(snapshot),
        "--tokenizer",
        str(broken),
        "--output",
        str(out),
        "--split",
        "validation",
    ]
    assert main(argv) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_two_concurrent_tokenize_runs_on_one_output_say_done_once(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    argv = _tokenize_argv(snapshot, tokenizer_dir, tmp_path / "store", "--split", "validation")
    runs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outputs = [run.communicate(timeout=240) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert sorted(json.loads(out)["status"] for out, _ in outputs) == ["done", "reused"]


def test_a_full_disk_names_the_file_or_output_it_could_not_write(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no mount namespace can be made here (unshare -rm)")
    disk = tmp_path / "disk"
    disk.mkdir()
    argv = _tokenize_argv(snapshot, tokenizer_dir, disk / "store", "--rows-per-shard", "64")
    done = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            'mount -t tmpfs -o size=48k tmpfs "$1" && shift && exec "$@"',
            "sh",
            str(disk),
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "No space left on device" in last and str(disk) in last and "Traceback" not in done.stderr, last

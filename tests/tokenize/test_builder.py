"""The sharded builder on a local destination: a rerun after a kill reuses a finished shard only when it is
exactly as it was sealed (a byte changed on disk since, in its tokens or its index part, is built again,
never published), and two builds of different identities into one output never both publish: the lock
lets one build, the other is refused naming what differs."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from _token_store_data import ROWS_PER_SHARD, TRAIN_ROWS
from puzzletron.dataset import formats
from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.tokenize import build_token_store
from puzzletron.dataset.tokenize import store as build_store

FORK = multiprocessing.get_context("fork")
OPTIONS = TokenizeOptions(rows_per_shard=ROWS_PER_SHARD)
SHARDS = -(-TRAIN_ROWS // ROWS_PER_SHARD)


@pytest.fixture(autouse=True)
def _serial_tokenizers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def _build_and_die(snapshot: Path, tokenizer_dir: Path, out: Path, shards: int) -> None:
    """Build `out`, SIGKILLed when shard `shards` starts (shards 0 .. shards-1 finished)."""
    real = build_store.tokenize_rows

    def rows(table, start, stop, **kwargs):
        if start == shards * ROWS_PER_SHARD:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(table, start, stop, **kwargs)

    build_store.tokenize_rows = rows
    build_token_store(snapshot, tokenizer=tokenizer_dir, output=out, options=OPTIONS)
    os._exit(3)


def _flip(path: Path, at: int = 0) -> None:
    """Change one byte of `path` in place (same size, same inode): damage a size check cannot see."""
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damaged", ["tokens", "ids.bin"])
def test_a_finished_shard_damaged_on_disk_is_built_again_never_published(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damaged: str
) -> None:
    clean = build_token_store(snapshot, tokenizer=tokenizer_dir, output=tmp_path / "clean", options=OPTIONS)
    out = tmp_path / "store"
    child = FORK.Process(target=_build_and_die, args=(snapshot, tokenizer_dir, out, 3))
    child.start()
    child.join(240)
    assert child.exitcode == -signal.SIGKILL
    (build,) = out.parent.glob(".store.build-*")
    assert sorted(p.name for p in build.glob("shard-*")) == ["shard-000000", "shard-000001", "shard-000002"]
    _flip(build / "shard-000001" / damaged, 3)
    calls: list[int] = []
    real = build_store.tokenize_rows
    monkeypatch.setattr(
        build_store, "tokenize_rows", lambda rows, a, b, **k: calls.append(a) or real(rows, a, b, **k)
    )
    assert build_token_store(snapshot, tokenizer=tokenizer_dir, output=out, options=OPTIONS) == out
    assert sorted(calls) == [k * ROWS_PER_SHARD for k in (1, *range(3, SHARDS))]  # 0 and 2 reused
    assert formats.verify(out).ok
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == {
        p.relative_to(clean): p.read_bytes() for p in clean.rglob("*") if p.is_file()
    }


def test_two_builds_of_different_identities_into_one_output_one_publishes_the_other_is_refused(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "store"
    argv = [sys.executable, "-m", "puzzletron.cli", "tokenize", str(snapshot), "--tokenizer"]
    argv += [str(tokenizer_dir), "--output", str(out), "--rows-per-shard"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    runs = [subprocess.Popen([*argv, str(rows)], **pipes) for rows in (ROWS_PER_SHARD, 2 * ROWS_PER_SHARD)]
    outputs = [run.communicate(timeout=300) for run in runs]
    codes = sorted(run.returncode for run in runs)
    assert codes == [0, 1], outputs
    done = next(out for (out, _), run in zip(outputs, runs, strict=True) if run.returncode == 0)
    refused = next(err for (_, err), run in zip(outputs, runs, strict=True) if run.returncode == 1)
    assert json.loads(done)["status"] == "done"
    assert "built from another identity" in refused and "options.rows_per_shard" in refused
    assert len(refused.strip().splitlines()) == 1
    assert formats.verify(out).ok

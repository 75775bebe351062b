"""Acquisition when things go wrong, through the real `huggingface_hub` and a fault proxy in front of the
mirror: an unknown repository or revision, a gated repository, a download dropped mid-file, a stray output
directory and a run SIGKILLed mid-download each end in one clear error naming what to do, publish nothing
and leave no debris; a rerun (or a retry within the run) succeeds."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest

from _files import cached_files
from puzzletron.dataset import (
    TextAcquisitionSpec,
    VlmAcquisitionSpec,
    materialize_intersyn_subset,
    materialize_nemotron_vlm_dataset,
    materialize_puzzle_kd_dataset,
)
from puzzletron.dataset.errors import AcquisitionError
from puzzletron.fixtures.faults import FaultProxy
from puzzletron.fixtures.hub import INTERSYN_SINGLE, NEMOTRON_VLM, PUZZLE_KD, FixtureHub
from puzzletron.fixtures.mirror import free_port


def test_unknown_repository_is_a_clear_error(hub_endpoint: str, tmp_path: Path) -> None:
    with pytest.raises(AcquisitionError) as info:
        materialize_puzzle_kd_dataset(
            TextAcquisitionSpec(
                output_dir=tmp_path / "x", train_samples=5, validation_samples=5, source="acme/nope"
            )
        )
    message = str(info.value)
    assert "acme/nope@main" in message and hub_endpoint in message and "HF_ENDPOINT" in message
    assert not (tmp_path / "x").exists()


def test_unknown_revision_is_a_clear_error(hub_endpoint: str, tmp_path: Path) -> None:
    bad = "0" * 40
    with pytest.raises(AcquisitionError) as info:
        materialize_puzzle_kd_dataset(
            TextAcquisitionSpec(
                output_dir=tmp_path / "x", train_samples=5, validation_samples=5, revision=bad
            )
        )
    assert f"{PUZZLE_KD}@{bad}" in str(info.value) and "revision" in str(info.value)
    assert list(tmp_path.iterdir()) == []
    # nothing left in the way: the same directory with the right revision succeeds
    fixed = TextAcquisitionSpec(output_dir=tmp_path / "x", train_samples=5, validation_samples=5)
    assert materialize_puzzle_kd_dataset(fixed)["splits"] == {"train": 5, "validation": 5}
    with pytest.raises(AcquisitionError, match="no-such-branch"):
        materialize_nemotron_vlm_dataset(
            VlmAcquisitionSpec(output_dir=tmp_path / "y", num_samples=3, revision="no-such-branch")
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


@pytest.mark.parametrize("status", [401, 403])
def test_gated_repository_says_to_set_hf_token_and_a_rerun_succeeds(
    hub_endpoint: str, tmp_path: Path, monkeypatch, status: int
) -> None:
    spec = VlmAcquisitionSpec(output_dir=tmp_path / "g", num_samples=3)
    with FaultProxy(hub_endpoint, mode="gated", gated_status=status) as proxy:
        monkeypatch.setenv("HF_ENDPOINT", proxy.endpoint)
        with pytest.raises(AcquisitionError) as info:
            materialize_nemotron_vlm_dataset(spec)
        assert proxy.requests  # it did ask, and got 401/403
        message = str(info.value)
        assert "HF_TOKEN" in message and f"{NEMOTRON_VLM}@main" in message and str(status) in message
        assert list(tmp_path.iterdir()) == []  # nothing published, no debris
        proxy.mode = "pass"  # access granted
        assert materialize_nemotron_vlm_dataset(spec)["sample_count"] == 3


def test_mirror_dropping_mid_tar_download_fails_cleanly_and_a_rerun_succeeds(
    hub_endpoint: str, fixture_hub: FixtureHub, fresh_hf_home: Path, tmp_path: Path, monkeypatch
) -> None:
    out = tmp_path / "vlm"
    spec = VlmAcquisitionSpec(output_dir=out, subsets=("plotqa_cot",), num_samples=2)
    with FaultProxy(hub_endpoint, mode="drop", drop_pattern=".tar") as proxy:
        monkeypatch.setenv("HF_ENDPOINT", proxy.endpoint)
        with pytest.raises(AcquisitionError) as info:
            materialize_nemotron_vlm_dataset(spec)
        message = str(info.value)
        pinned = fixture_hub.shas[NEMOTRON_VLM]
        assert f"{NEMOTRON_VLM}@{pinned}" in message and "plotqa_cot/media/" in message and "rerun" in message
        assert proxy.downloads(".jsonl") == ["plotqa_cot/plotqa_cot.jsonl"]  # it failed on the tar shard
        assert [p.name for p in tmp_path.iterdir()] == ["hf-home"]  # nothing published, no debris
        proxy.mode = "pass"
        assert materialize_nemotron_vlm_dataset(spec)["sample_count"] == 2


def test_mirror_dropping_mid_download_fails_cleanly_and_a_rerun_succeeds(
    hub_endpoint: str, fresh_hf_home: Path, tmp_path: Path, monkeypatch
) -> None:
    out = tmp_path / "snap"
    spec = TextAcquisitionSpec(output_dir=out, train_samples=30, validation_samples=30)
    with FaultProxy(hub_endpoint, mode="drop", drop_pattern="validation-") as proxy:
        monkeypatch.setenv("HF_ENDPOINT", proxy.endpoint)
        with pytest.raises(AcquisitionError) as info:
            materialize_puzzle_kd_dataset(spec)
        message = str(info.value)
        assert PUZZLE_KD in message and "rerun" in message and "HF_ENDPOINT" in message
        assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["hf-home"]
        # no truncated shard in the cache either (huggingface_hub drops the partial file)
        assert not [f for f in cached_files(fresh_hf_home, PUZZLE_KD) if "validation-" in f]
        proxy.mode = "pass"  # the mirror is back
        manifest = materialize_puzzle_kd_dataset(spec)
    assert manifest["splits"] == {"train": 30, "validation": 30}
    assert datasets.load_from_disk(str(out))["validation"].num_rows == 30


def test_subset_materialisers_refuse_a_stray_directory_before_any_request(
    tmp_path: Path, fixture_hub: FixtureHub, monkeypatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # any request would fail differently
    (tmp_path / "stray.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty and holds no complete subset"):
        materialize_nemotron_vlm_dataset(VlmAcquisitionSpec(output_dir=tmp_path, num_samples=3))
    with pytest.raises(ValueError, match="not empty and holds no complete subset"):
        materialize_intersyn_subset(tmp_path, single_turn_revision=fixture_hub.shas[INTERSYN_SINGLE])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stray.txt"]


def test_a_run_killed_mid_download_publishes_nothing_and_the_next_run_sweeps_it(
    hub_endpoint: str, tmp_path: Path
) -> None:
    import os
    import subprocess
    import sys
    import time

    out = tmp_path / "snap"
    code = (
        "import sys; from pathlib import Path; from puzzletron.dataset import *; "
        "materialize_puzzle_kd_dataset(TextAcquisitionSpec(output_dir=Path(sys.argv[1]), "
        "train_samples=20, validation_samples=20))"
    )
    with FaultProxy(hub_endpoint, mode="stall", drop_pattern="validation-") as proxy:
        env = {**os.environ, "HF_ENDPOINT": proxy.endpoint, "HF_HOME": str(tmp_path / "hf")}
        child = subprocess.Popen([sys.executable, "-c", code, str(out)], env=env)
        deadline = time.monotonic() + 60
        while not any(m == "GET" and "validation-" in p for m, p in proxy.requests):
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        child.kill()  # mid-download, holding the lock and a half-filled transaction directory
        child.wait(timeout=30)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".snap.txn-")]  # left by the kill
    manifest = materialize_puzzle_kd_dataset(
        TextAcquisitionSpec(output_dir=out, train_samples=20, validation_samples=20)
    )
    assert manifest["splits"] == {"train": 20, "validation": 20}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".snap.txn-")]  # swept


def test_one_dropped_download_is_retried_within_the_run(
    hub_endpoint: str, fresh_hf_home: Path, fixture_hub: FixtureHub, tmp_path: Path, monkeypatch
) -> None:
    """huggingface_hub resumes with a Range request; the mirror answers 200 with the whole file, which the
    client detects and restarts from byte 0, so the shard is intact."""
    with FaultProxy(hub_endpoint, mode="drop", drop_pattern="train-", max_drops=1) as proxy:
        monkeypatch.setenv("HF_ENDPOINT", proxy.endpoint)
        materialize_puzzle_kd_dataset(
            TextAcquisitionSpec(output_dir=tmp_path / "s", train_samples=10, validation_samples=10)
        )
        assert proxy.drops == 1
    cached = fresh_hf_home / "hub" / ("datasets--" + PUZZLE_KD.replace("/", "--")) / "snapshots"
    shard = next(cached.rglob("train-*.parquet"))
    assert shard.read_bytes() == (fixture_hub.repo_dir(PUZZLE_KD) / "data" / shard.name).read_bytes()

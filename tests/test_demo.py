"""`puzzletron-data demo` end to end in a subprocess, and `pack-report` drawing a PNG."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "puzzletron.cli"]


def _run(args: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, env=env, check=False)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    workdir = tmp_path_factory.mktemp("demo")
    return _run(["demo", "--workdir", str(workdir)], timeout=180), workdir


@pytest.mark.slow
def test_demo_runs_every_stage_and_reports(demo):
    result, workdir = demo
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    stages = re.findall(r"^\s+(ok|skip|FAIL)\s+[\d.]+ s  (.+)$", out, flags=re.M)
    assert len(stages) == 8 and all(status == "ok" for status, _ in stages), stages
    assert re.search(r"efficiency \d+\.\d+%", out)
    assert re.search(r"first batch per DP rank: [0-9a-f]{12}  [0-9a-f]{12}", out)
    assert "every one of" in out and "packs dealt exactly once" in out
    assert (workdir / "snapshots" / "puzzle-kd" / "train").is_dir()


@pytest.mark.slow
def test_demo_is_deterministic_for_a_seed(demo, tmp_path):
    first, _ = demo
    again = _run(["demo", "--workdir", str(tmp_path / "again")], timeout=180)
    assert again.returncode == 0

    def prints(text: str) -> list[str]:
        return re.findall(r"\b[0-9a-f]{12}\b", text.split("[2]")[0]) + re.findall(
            r"first batch per DP rank: (.+)$", text, flags=re.M
        )

    assert prints(first.stdout) == prints(again.stdout)


@pytest.mark.slow
def test_pack_report_writes_a_png_and_prints_the_numbers(demo, tmp_path):
    _, workdir = demo
    out = tmp_path / "report.png"
    result = _run(
        [
            "pack-report",
            str(workdir / "snapshots" / "puzzle-kd"),
            "--tokenizer",
            str(workdir / "tokenizer"),
            "--pack-size",
            "4096",
            "--out",
            str(out),
        ],
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert re.search(r"^rows\s+\d+ \(lower bound \d+\)$", result.stdout, flags=re.M)
    assert re.search(r"^efficiency\s+\d+\.\d+%", result.stdout, flags=re.M)
    assert "512 rows" in result.stdout

"""`puzzletron-data demo` end to end in a subprocess (`pack-report` is in test_pack_report.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from puzzletron.fixtures.faults import OutboundTrap

CLI = [sys.executable, "-m", "puzzletron.cli"]


def _run(
    args: list[str], *, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | (env or {})
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, env=clean, check=False)


DEMO_TOKEN = "hf_demo_must_never_send_this"
_OUTBOUND: list[tuple[str, str]] = []  # what the demo run tried to send off the machine


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    workdir = tmp_path_factory.mktemp("demo")
    # Debris of an interrupted hub generation: the run must clear it, not trip over it.
    (workdir / "hub.partial" / "mirrors").mkdir(parents=True)
    # A user's token in the environment, and every non-loopback request sent to a trap that refuses it.
    with OutboundTrap() as trap:
        result = _run(
            ["demo", "--workdir", str(workdir)],
            timeout=180,
            env={"HF_TOKEN": DEMO_TOKEN, **trap.environment()},
        )
    _OUTBOUND[:] = trap.requests
    return result, workdir


STAGE_LINE = r"^\s+(ok|FAIL)\s+[\d.]+ s  \[(\d+)\] (.+)$"


@pytest.mark.slow
def test_demo_runs_every_stage_and_reports(demo):
    result, workdir = demo
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    stages = re.findall(STAGE_LINE, out, flags=re.M)
    assert len(stages) == 10 and all(status == "ok" for status, _, _ in stages), stages
    assert [int(n) for _, n, _ in stages] == list(range(1, 11))
    assert "skip" not in out.lower().replace("skipped", "")  # every stage's code exists: none is skipped
    # The report: rows vs the bound, efficiency, tokens, what was dropped, fingerprints, total time.
    packing = re.search(
        r"^  packing\s+(\d+) rows of 4096 \(lower bound (\d+)\), efficiency (\d+\.\d+)%; ([\d,]+) tokens "
        r"packed, (\d+) samples \(([\d,]+) tokens\) dropped as longer than pack_size$",
        out,
        flags=re.M,
    )
    assert packing, out[-2000:]
    rows, bound, efficiency = int(packing[1]), int(packing[2]), float(packing[3])
    assert rows >= bound and rows - bound <= 1 and efficiency >= 99.0
    assert int(packing[4].replace(",", "")) <= rows * 4096
    split = re.search(r"^  text split\s+512 samples, ([\d,]+) tokens", out, flags=re.M)
    dropped_tokens = int(packing[6].replace(",", ""))
    assert split and int(split[1].replace(",", "")) == int(packing[4].replace(",", "")) + dropped_tokens
    assert re.search(r"first batch per DP rank: [0-9a-f]{12}  [0-9a-f]{12}", out)
    assert re.search(r"every one of \d+ packs \(\d+ samples\) dealt exactly once", out)
    # The VLM stage: one store built for both ranks, every image of the subset in some batch exactly once.
    vlm = re.search(r"(\d+) samples dropped; every pack and all (\d+) images dealt once$", out, flags=re.M)
    subset = json.loads((workdir / "snapshots" / "nemotron-vlm" / "manifest.json").read_text())
    assert vlm and (int(vlm[1]), int(vlm[2])) == (0, subset["image_count"]), out[-3000:]
    assert [p.name for p in (workdir / "stores").iterdir() if not p.name.startswith(".")].__len__() == 1
    assert re.search(r"^  total [\d.]+ s; ok$", out, flags=re.M)
    assert (workdir / "snapshots" / "puzzle-kd" / "train").is_dir()
    assert not (workdir / "hub.partial").exists()
    assert json.loads((workdir / "hub" / "demo-hub.json").read_text()) == {"seed": 0}
    # The README's try-it files load as what they stand for.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from puzzletron.fixtures.tokenizer import load_qwen2_5_vl_processor

    tokenizer = AutoTokenizer.from_pretrained(workdir / "tokenizer")
    model = AutoModelForCausalLM.from_pretrained(workdir / "model")
    assert model.config.vocab_size == len(tokenizer) and tokenizer.chat_template
    assert AutoTokenizer.from_pretrained(workdir / "model").get_vocab() == tokenizer.get_vocab()
    assert load_qwen2_5_vl_processor(workdir / "processor").tokenizer.get_vocab() == tokenizer.get_vocab()


@pytest.mark.slow
def test_demo_json_is_one_line_and_the_stages_go_to_stderr(demo, tmp_path):
    text, _ = demo
    result = _run(["demo", "--workdir", str(tmp_path), "--json"], timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = result.stdout.splitlines()
    facts = json.loads(line)
    assert (facts["command"], facts["status"], facts["path"]) == ("demo", "ok", str(tmp_path))
    assert [s["status"] for s in facts["stages"]] == ["ok"] * 10 and "[9] write the README" in result.stderr
    assert facts["sample_count"] == 512 and facts["model"] == str(tmp_path / "model")
    first = re.search(r"first batch per DP rank: ([0-9a-f]{12})  ([0-9a-f]{12})", text.stdout)
    assert first and [f[:12] for f in facts["fingerprints"]] == [first[1], first[2]]  # the same run, seed 0


@pytest.mark.slow
def test_demo_json_without_a_workdir_names_no_file_of_its_removed_folder():
    result = _run(["demo", "--json"], timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = result.stdout.splitlines()
    facts = json.loads(line)
    assert facts["status"] == "ok" and facts["path"] is None
    named = [v for v in facts.values() if isinstance(v, str) and "puzzletron-demo-" in v]
    assert named == [] and not {"tokenizer", "processor", "model"} & set(facts)


@pytest.mark.slow
def test_demo_exits_non_zero_naming_the_failed_stage_and_stops(tmp_path):
    # A non-empty folder where the Puzzle-KD snapshot goes: materialisation must refuse it.
    blocked = tmp_path / "snapshots" / "puzzle-kd"
    blocked.mkdir(parents=True)
    (blocked / "stray.txt").write_text("not a snapshot")
    result = _run(["demo", "--workdir", str(tmp_path)], timeout=180)
    assert result.returncode == 1, result.stdout[-3000:]
    stages = re.findall(STAGE_LINE, result.stdout, flags=re.M)
    assert [(status, n) for status, n, _ in stages] == [("ok", "1"), ("ok", "2"), ("FAIL", "3")]
    assert "holds no complete Puzzle-KD snapshot" in result.stdout
    assert "FAILED at stage [3], 7 stage(s) after it not run" in result.stdout


@pytest.mark.slow
def test_demo_refuses_a_hub_left_half_written_instead_of_serving_it(tmp_path):
    # What an interrupted generation used to leave: hub/mirrors with only some repositories.
    (tmp_path / "hub" / "mirrors" / "datasets" / "nvidia").mkdir(parents=True)
    result = _run(["demo", "--workdir", str(tmp_path)], timeout=180)
    assert result.returncode == 1, result.stdout[-3000:]
    stages = re.findall(STAGE_LINE, result.stdout, flags=re.M)
    assert [(status, n) for status, n, _ in stages] == [("ok", "1"), ("FAIL", "2")]
    assert f"{tmp_path / 'hub'} exists but is not a complete fixture Hub" in result.stdout


@pytest.mark.slow
def test_demo_refuses_to_reuse_a_workdir_of_another_seed(demo):
    _, workdir = demo  # generated with --seed 0
    result = _run(["demo", "--workdir", str(workdir), "--seed", "3"], timeout=180)
    assert result.returncode == 1, result.stdout[-3000:]
    stages = re.findall(STAGE_LINE, result.stdout, flags=re.M)
    assert [(status, n) for status, n, _ in stages] == [("ok", "1"), ("FAIL", "2")]
    assert "holds the fixture Hub of --seed 0, not --seed 3" in result.stdout


@pytest.mark.slow
def test_demo_is_deterministic_for_a_seed(demo, tmp_path):
    first, _ = demo
    again = _run(["demo", "--workdir", str(tmp_path / "again")], timeout=180)
    assert again.returncode == 0

    def prints(text: str) -> list[str]:
        return re.findall(r"\b[0-9a-f]{12}\b", text)

    # Stage 1: the batch, 2 DP shards, 2 x 2 CP partitions, 2 one-row shards (9); stage 2: 4 repository
    # shas; stage 7: each rank's first batch (2); stage 8: 2 DP shards, 2 x 2 CP partitions (6); stage 10:
    # each rank's first VLM batch (2), 2 DP shards, 2 x 2 CP partitions (8); report: 2.
    assert len(prints(first.stdout)) == 31
    assert prints(first.stdout) == prints(again.stdout)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:  # fields: state, ppid, ...
                found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_demo_stopped_with_sigterm_stops_its_hub_server(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    process = subprocess.Popen(
        [*CLI, "demo", "--workdir", str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        for line in process.stdout:  # the stage prints flush, line by line
            if "serving" in line:
                break
        servers = _children(process.pid)
        assert servers, "the hub server should be a child of the demo while it serves"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 143
    finally:
        process.kill()
        process.communicate()
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = [p for p in servers if _alive(p)]
    for pid in leaked:  # do not leave them running when the test fails
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not leaked, "the hub server outlived the demo"


def test_a_negative_seed_is_a_usage_error(capsys):
    from puzzletron.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--seed", "-1"])
    assert exit_info.value.code == 2
    assert "--seed: must be an int >= 0, got '-1'" in capsys.readouterr().err


def test_a_workdir_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    from puzzletron.cli import main

    path = tmp_path / "file"
    path.write_text("not a folder")
    assert main(["demo", "--workdir", str(path)]) == 2
    assert capsys.readouterr().err == f"puzzletron-data demo: --workdir {path}: File exists\n"


@pytest.mark.slow
def test_the_demo_sends_nothing_off_the_machine_and_records_no_token(demo):
    result, workdir = demo
    assert result.returncode == 0, result.stderr[-2000:]
    assert _OUTBOUND == []  # not even huggingface_hub's own registry fetch
    snapshots = [p for p in (workdir / "snapshots").rglob("*") if p.is_file()]
    assert snapshots and not any(DEMO_TOKEN.encode() in p.read_bytes() for p in snapshots)

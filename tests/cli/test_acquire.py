"""`puzzletron-data materialize ...` and `puzzletron-data hub ...` through the mirror."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from puzzletron.cli import main
from puzzletron.fixtures.hub import INTERSYN_MULTI, INTERSYN_SINGLE, PUZZLE_KD, FixtureHub


def _json_line(capsys: pytest.CaptureFixture[str]) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return json.loads(out[0])


def test_materialize_puzzle_kd_done_then_reused_then_mismatch(
    hub_endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pkd"
    argv = [
        "materialize",
        "puzzle-kd",
        "--output",
        str(out),
        "--train-samples",
        "30",
        "--validation-samples",
        "5",
    ]
    assert main(argv) == 0
    line = _json_line(capsys)
    assert line == {
        "command": "materialize puzzle-kd",
        "status": "done",
        "adapter": "puzzle_kd_v2",
        "path": str(out),
        "format": "puzzletron-text-snapshot",
        "manifest": str(out / "manifest.json"),
        "row_count": 35,
        "bytes_on_disk": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
    }
    assert json.loads(Path(line["manifest"]).read_text())["splits"] == {"train": 30, "validation": 5}
    assert main(argv) == 0
    assert _json_line(capsys)["status"] == "reused"
    assert main([*argv[:-1], "6"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "does not match requested acquisition" in captured.err


def test_materialize_nemotron_with_subset_rows(
    hub_endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "vlm"
    argv = ["materialize", "nemotron-vlm", "--output", str(out), "--num-samples", "7", "--quiet"]
    argv += ["--subset-rows", "sparsetables=10", "--subset-rows", "plotqa_cot=30"]
    assert main(argv) == 0
    line = _json_line(capsys)
    assert line["status"] == "done" and line["adapter"] == "nemotron_vlm_v2"
    manifest = json.loads(Path(line["manifest"]).read_text())
    assert manifest["diagnostics"]["requested_quotas"] == {"sparsetables": 2, "plotqa_cot": 5}
    assert manifest["acquisition"]["subsets"] == ["sparsetables", "plotqa_cot"]


def test_materialize_intersyn_with_pinned_fixture_revisions(
    hub_endpoint: str, fixture_hub: FixtureHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "inter"
    argv = ["materialize", "intersyn", "--output", str(out), "--rows-per-source", "2"]
    argv += ["--single-turn-revision", fixture_hub.shas[INTERSYN_SINGLE]]
    argv += ["--multi-turn-revision", fixture_hub.shas[INTERSYN_MULTI]]
    assert main(argv) == 0
    manifest = json.loads(Path(_json_line(capsys)["manifest"]).read_text())
    assert manifest["sample_count"] == 4


def test_an_unknown_subset_names_the_known_ones_and_a_shortfall_names_the_flag(
    hub_endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["materialize", "nemotron-vlm", "--output", str(tmp_path / "x"), "--quiet"]
    assert main([*argv, "--num-samples", "4", "--subset-rows", "nosuch=2", "--subset-rows", "wiki_en=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown subset(s) ['nosuch']" in err
    assert err.rstrip().endswith("known: chartqa_cot, plotqa_cot, sparsetables, wiki_en")
    assert main([*argv, "--num-samples", "500"]) == 1  # the fixture holds fewer usable rows
    err = capsys.readouterr().err
    assert "raise --max-shards-per-subset," in err and "max_shards_per_subset" not in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "extra",
    [
        ["--subset-rows", "sparsetables"],  # not NAME=ROWS
        ["--num-samples", "0"],  # spec field out of range
        ["--subset", "a", "--subset-rows", "b=1"],  # subset_rows must name the subsets
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["materialize", "nemotron-vlm", "--output", str(tmp_path / "x"), *extra]) == 2
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "x").exists()


def test_argparse_usage_error_exits_2(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["materialize", "puzzle-kd"])  # --output missing
    assert info.value.code == 2


def test_hub_error_exits_1_with_the_reason(
    hub_endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["materialize", "puzzle-kd", "--output", str(tmp_path / "x"), "--source", "acme/missing"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "acme/missing" in err and "HF_ENDPOINT" in err


def test_hub_fixtures_then_serve_in_a_subprocess(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hub", "fixtures", str(tmp_path / "hub")]) == 0
    shas = _json_line(capsys)["shas"]
    assert set(shas) >= {PUZZLE_KD}
    assert main(["hub", "fixtures", str(tmp_path / "hub")]) == 1  # already there
    capsys.readouterr()
    process = subprocess.Popen(
        [sys.executable, "-m", "puzzletron.cli", "hub", "serve", str(tmp_path / "hub"), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = json.loads(process.stdout.readline())  # type: ignore[union-attr]
        endpoint = line["endpoint"]
        assert (line["command"], line["status"], line["path"]) == (
            "hub serve",
            "serving",
            str(tmp_path / "hub"),
        )
        assert endpoint.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{endpoint}/api/datasets/{PUZZLE_KD}/revision/main", timeout=10) as r:
            assert json.load(r)["sha"] == shas[PUZZLE_KD]
    finally:
        os.kill(process.pid, signal.SIGTERM)
        code = process.wait(timeout=30)
    assert code == 0


def _run_on_a_terminal(argv: list[str]) -> tuple[int, str, str]:
    """Run the CLI in a child whose stderr is a pseudo-terminal; return (exit code, stdout, stderr)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    # a new pseudo-terminal is 0 columns wide, where tqdm draws empty bars: give it a real size
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    child = subprocess.Popen(
        [sys.executable, "-m", "puzzletron.cli", *argv], stdout=subprocess.PIPE, stderr=slave, text=True
    )
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    out = child.stdout.read()  # type: ignore[union-attr]
    return child.wait(timeout=60), out, err.decode(errors="replace")


def test_progress_bars_only_on_a_terminal_and_never_with_quiet(
    hub_endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["materialize", "puzzle-kd", "--train-samples", "40", "--validation-samples", "6"]
    code, out, err = _run_on_a_terminal([*argv, "--output", str(tmp_path / "tty")])
    assert code == 0 and json.loads(out)["status"] == "done"
    assert "train: 100%" in err and "40/40" in err and "validation: 100%" in err  # tqdm bars on stderr
    code, out, err = _run_on_a_terminal([*argv, "--output", str(tmp_path / "quiet"), "--quiet"])
    assert code == 0 and json.loads(out)["status"] == "done"
    assert "%|" not in err and "train" not in err
    # stderr captured (not a terminal): no bars either, and stdout holds the one JSON line only
    assert main([*argv, "--output", str(tmp_path / "pipe")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["status"] == "done" and "%|" not in captured.err

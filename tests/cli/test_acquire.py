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


def test_materialize_nemotron_media_shards_holds_the_same_images_as_files(
    hub_endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = {}
    for media in ("files", "shards"):
        argv = ["materialize", "nemotron-vlm", "--output", str(tmp_path / media), "--num-samples", "6"]
        assert main([*argv, "--quiet", "--media", media]) == 0
        lines[media] = _json_line(capsys)
        assert lines[media]["status"] == "done" and lines[media]["media"] == media
        assert main(["verify", str(tmp_path / media)]) == 0
        assert capsys.readouterr().out.startswith("OK ")
    files, shards = (json.loads(Path(lines[m]["manifest"]).read_text()) for m in ("files", "shards"))
    assert "media" not in files and len(shards["media"]["files"]) >= 1
    assert not (tmp_path / "shards" / "images").exists()
    assert [r["sha256"] for r in files["images"]] == [r["sha256"] for r in shards["images"]]
    assert files["samples"] == shards["samples"]
    # a complete subset is reused in the layout it has, and says so
    argv = ["materialize", "nemotron-vlm", "--output", str(tmp_path / "files"), "--num-samples", "6"]
    assert main([*argv, "--quiet", "--media", "shards"]) == 0
    again = _json_line(capsys)
    assert again["status"] == "reused" and again["media"] == "files"


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


_RERUN = """
import json, sys
from puzzletron.cli import main
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    print(json.dumps({"argv": argv, "code": code}), flush=True)
"""


def test_every_materializer_reruns_with_the_hub_stopped_and_makes_no_request(
    hub_endpoint: str, fixture_hub: FixtureHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rerun of each materializer with the spec of the snapshot there (with and without an explicit
    ``--revision <sha>``) is reused in a fresh process whose Hub is stopped (a loopback port that counts the
    connections it refuses) and whose outbound traffic is trapped: no request at all, not one retry."""
    from puzzletron.fixtures.faults import OutboundTrap
    from puzzletron.fixtures.hub import NEMOTRON_VLM
    from puzzletron.fixtures.mirror import free_port
    from puzzletron.fixtures.tcp_faults import TcpFaults

    shas = fixture_hub.shas
    kd = ["materialize", "puzzle-kd", "--output", str(tmp_path / "kd"), "--train-samples", "8"]
    kd += ["--validation-samples", "2", "--quiet"]
    vlm = ["materialize", "nemotron-vlm", "--output", str(tmp_path / "vlm"), "--num-samples", "4", "--quiet"]
    inter = ["materialize", "intersyn", "--rows-per-source", "2", "--quiet"]
    pinned = ["--single-turn-revision", shas[INTERSYN_SINGLE], "--multi-turn-revision", shas[INTERSYN_MULTI]]
    inter_sha = [*inter, "--output", str(tmp_path / "inter-sha"), *pinned]
    inter_main = [*inter, "--output", str(tmp_path / "inter-main")]
    inter_main += ["--single-turn-revision", "main", "--multi-turn-revision", "main"]
    for argv in (kd, vlm, inter_sha, inter_main):
        assert main(argv) == 0
    assert [json.loads(line)["status"] for line in capsys.readouterr().out.splitlines()] == ["done"] * 4
    reruns = [kd, [*kd, "--revision", shas[PUZZLE_KD]], vlm, [*vlm, "--revision", shas[NEMOTRON_VLM]]]
    reruns += [inter_sha, inter_main]
    with TcpFaults(free_port()) as stopped, OutboundTrap() as trap:  # a Hub that refuses every connection
        env = {**os.environ, **trap.environment(), "HF_ENDPOINT": stopped.endpoint}
        child = subprocess.run(
            [sys.executable, "-c", _RERUN, json.dumps(reruns)], env=env, capture_output=True, text=True
        )
    assert child.returncode == 0, child.stderr[-3000:]
    lines = [json.loads(line) for line in child.stdout.splitlines()]
    results = [line for line in lines if "argv" in line]
    assert [r["code"] for r in results] == [0] * len(reruns), child.stderr[-3000:]
    assert [line["status"] for line in lines if "status" in line] == ["reused"] * len(reruns)
    assert (stopped.connections, trap.requests) == (0, [])
    assert "Retrying" not in child.stderr


_ONE_RETRY = """
import logging, sys
from puzzletron.cli import main
from puzzletron.dataset.errors import AcquisitionError
from puzzletron.dataset.sources import hub

def retried_then_failed(call):  # what huggingface_hub's http_backoff says before each retry
    logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
    raise AcquisitionError("the Hub is unreachable")

hub._api = retried_then_failed
sys.exit(main(["materialize", "puzzle-kd", "--output", sys.argv[1]]))
"""


def test_a_hub_retry_is_said_once_on_stderr(tmp_path: Path) -> None:
    """huggingface_hub has a stderr handler of its own and also propagates to the root logger the command
    line configures: each retry warning was printed twice (bare, then ``WARNING:huggingface_hub...``)."""
    child = subprocess.run(
        [sys.executable, "-c", _ONE_RETRY, str(tmp_path / "x")], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 1
    assert child.stderr.count("Retrying in 1s [Retry 1/5].") == 1, child.stderr

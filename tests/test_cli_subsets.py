"""`puzzletron-data verify` exits 0 only on a fully matching subset; `inspect` describes one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _conversation_samples import multi_samples, single_samples
from puzzletron.cli import main
from puzzletron.dataset import materialize_normalized_conversation_samples


@pytest.fixture
def subset(tmp_path):
    dest = tmp_path / "subset"
    materialize_normalized_conversation_samples(iter([*single_samples(2), *multi_samples(1)]), dest)
    return dest


def test_verify_ok_exits_zero(subset, capsys):
    assert main(["verify", str(subset)]) == 0
    assert "OK" in capsys.readouterr().out


def test_verify_reports_every_mismatch_and_exits_one(subset, capsys):
    data = bytearray((subset / "images/000000_00.jpg").read_bytes())
    data[50] ^= 1
    (subset / "images/000000_00.jpg").write_bytes(bytes(data))
    (subset / "images/000002_01.png").unlink()
    assert main(["verify", str(subset)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out
    assert "images/000000_00.jpg': SHA-256 differs" in out
    assert "images/000002_01.png' is missing" in out


def test_verify_of_a_non_subset_exits_one(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 1
    assert "manifest is missing" in capsys.readouterr().out


def test_inspect_json(subset, capsys):
    assert main(["inspect", str(subset), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["sample_count"], info["image_count"]) == (3, 4)
    assert info["image_formats"] == {"JPEG": 2, "PNG": 2}
    assert [s["dataset"] for s in info["sources"]] == ["finyorko/multi-turn", "finyorko/single_turn"]
    assert info["image_width"] == {"min": 32, "max": 32}
    on_disk = sum(p.stat().st_size for p in subset.rglob("*") if p.is_file())
    assert info["bytes_on_disk"] == on_disk


def test_inspect_text_through_the_console_entry_point(subset):
    result = subprocess.run(
        [sys.executable, "-m", "puzzletron.cli", "inspect", str(subset)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "samples      3" in result.stdout
    assert "finyorko/single_turn @ 59acf6773cd2bf5b485f37296e862216aa99516b" in result.stdout
    assert "JPEG: 2" in result.stdout


def test_inspect_of_a_non_subset_exits_one(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 1
    assert "manifest is missing" in capsys.readouterr().err

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


# ------------------------------------------- a Puzzle-KD text snapshot (formats/text_snapshot.py)


def _rows(source, *, split, revision, seed):
    for i in range(3 if split == "train" else 2):
        yield {
            "messages": [{"role": "user", "content": f"{split} {i}"}, {"role": "assistant", "content": "ok"}]
        }


@pytest.fixture
def text_snapshot(tmp_path):
    from puzzletron.dataset.sources import TextAcquisitionSpec, materialize_puzzle_kd_dataset

    out = tmp_path / "pkd"
    spec = TextAcquisitionSpec(output_dir=out, train_samples=3, validation_samples=2, revision="a" * 40)
    materialize_puzzle_kd_dataset(spec, dataset_loader=_rows, revision_resolver=lambda source, rev: rev)
    return out


def test_inspect_describes_a_text_snapshot_from_its_manifest(text_snapshot, capsys):
    assert main(["inspect", str(text_snapshot), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["kind"], info["splits"], info["row_count"]) == (
        "text-snapshot",
        {"train": 3, "validation": 2},
        5,
    )
    assert info["acquisition"]["revision"] == "a" * 40
    assert info["bytes_on_disk"] == sum(p.stat().st_size for p in text_snapshot.rglob("*") if p.is_file())
    assert main(["inspect", str(text_snapshot)]) == 0
    assert "split        train: 3 rows" in capsys.readouterr().out


def test_verify_dispatches_a_text_snapshot_to_the_acquisition_verifier(text_snapshot, capsys):
    from puzzletron.dataset import sources as acquisition

    if not hasattr(acquisition, "verify_text_snapshot"):
        pytest.skip("acquisition.verify_text_snapshot is not there yet (the fallback is tested below)")
    assert main(["verify", str(text_snapshot)]) == 0
    assert "OK" in capsys.readouterr().out
    arrow = sorted((text_snapshot / "train").glob("*.arrow"))[0]
    data = bytearray(arrow.read_bytes())
    data[-20] ^= 0xFF  # same size: only the hash can tell
    arrow.write_bytes(bytes(data))
    assert main(["verify", str(text_snapshot)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "SHA-256 differs" in out

"""`puzzletron-data tokenize`: one JSON line, done then reused, exit codes 1 and 2, a progress bar only on a
terminal, and `verify` / `inspect` of the store it wrote."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from puzzletron.cli import main
from puzzletron.dataset.formats.token_store import TokenStore


def _args(snapshot: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    return ["tokenize", str(snapshot), "--tokenizer", str(tokenizer), "--output", str(out), *extra]


def test_tokenize_prints_one_json_line_then_reuses(snapshot, tokenizer_dir, tmp_path, capsys) -> None:
    out = tmp_path / "stores" / "validation"
    args = _args(snapshot, tokenizer_dir, out, "--split", "validation", "--rows-per-shard", "10")
    assert main([*args, "--num-proc", "2"]) == 0
    captured = capsys.readouterr()
    line = json.loads(captured.out)
    assert line == {
        "status": "done",
        "format": "puzzletron-token-store",
        "output": str(out),
        "manifest": str(out / "manifest.json"),
    }
    assert captured.err == ""  # no terminal: no progress bar
    assert TokenStore(out).manifest["counts"]["shards"] == 3
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "reused"
    assert main(["verify", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"OK {out}: ")
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["identity"]["snapshot"]["split"] == "validation"


def test_tokenize_exit_codes(snapshot, tokenizer_dir, tmp_path, capsys) -> None:
    out = tmp_path / "store"
    assert main(_args(tmp_path / "missing", tokenizer_dir, out)) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(_args(snapshot, tmp_path / "no-tokenizer", out)) == 2  # ConfigError: usage
    assert "is not a directory" in capsys.readouterr().err
    assert main(_args(snapshot, tokenizer_dir, out, "--split", "validation")) == 0
    capsys.readouterr()
    assert main(_args(snapshot, tokenizer_dir, out, "--split", "validation", "--rows-per-shard", "7")) == 1
    assert "another identity (existing vs requested: options.rows_per_shard" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(_args(snapshot, tokenizer_dir, out, "--num-proc", "0"))
    assert exc.value.code == 2


def test_progress_goes_to_a_terminal_only(snapshot, tokenizer_dir, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    out = tmp_path / "store"
    assert main(_args(snapshot, tokenizer_dir, out, "--split", "validation")) == 0
    captured = capsys.readouterr()
    assert (
        json.loads(captured.out)["status"] == "done" and "tokenize" in captured.err and "row" in captured.err
    )
    assert (
        main([*_args(snapshot, tokenizer_dir, tmp_path / "quiet", "--split", "validation"), "--quiet"]) == 0
    )
    assert capsys.readouterr().err == ""


def test_a_subset_with_a_processor_becomes_a_vlm_store(vlm_subset, processor_dirs, tmp_path, capsys) -> None:
    out = tmp_path / "vlm"
    args = ["tokenize", str(vlm_subset), "--processor", str(processor_dirs["qwen3_vl"]), "--output", str(out)]
    assert main([*args, "--rows-per-shard", "16", "--num-proc", "2"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["status"] == "done" and line["format"] == "puzzletron-vlm-store"
    assert main([*args, "--rows-per-shard", "16"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "reused"
    assert main(["verify", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"OK {out}: 38 samples, ")
    assert main(["inspect", str(out)]) == 0
    assert "processor    Qwen2VLImageProcessorPil: patch 16" in capsys.readouterr().out


def test_the_source_decides_which_of_tokenizer_and_processor_is_needed(
    vlm_subset, snapshot, tokenizer_dir, processor_dirs, tmp_path, capsys
) -> None:
    out = str(tmp_path / "out")
    assert main(["tokenize", str(vlm_subset), "--tokenizer", str(tokenizer_dir), "--output", out]) == 2
    assert "is a conversation subset: give --processor DIR" in capsys.readouterr().err
    assert (
        main(["tokenize", str(snapshot), "--processor", str(processor_dirs["qwen3_vl"]), "--output", out])
        == 2
    )
    assert "give --tokenizer DIR for a text snapshot" in capsys.readouterr().err

"""`puzzletron-data tokenize`: one JSON line, done then reused, exit codes 1 and 2, a progress bar only on a
terminal, `verify` / `inspect` of the store it wrote, and a text snapshot at an URL read as its folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _token_store_data import VALIDATION_ROWS
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
    store = TokenStore(out)
    assert line == {
        "command": "tokenize",
        "status": "done",
        "path": str(out),
        "format": "puzzletron-token-store",
        "manifest": str(out / "manifest.json"),
        "row_count": VALIDATION_ROWS,
        "sample_count": len(store),
        "token_count": store.num_tokens,
        "bytes_on_disk": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
        "identity_sha256": store.manifest["identity_sha256"],
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
    assert main(_args(snapshot, tokenizer_dir, out, "--split", "test")) == 1
    assert "has no split 'test' (splits: ['train', 'validation'])" in capsys.readouterr().err
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


def test_cache_dir_finds_the_store_an_output_put_there(snapshot, tokenizer_dir, tmp_path, capsys) -> None:
    stores = tmp_path / "stores"
    args = ["tokenize", str(snapshot), "--tokenizer", str(tokenizer_dir), "--split", "validation"]
    assert main([*args, "--output", str(stores / "kd-validation")]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "done"
    assert main([*args, "--cache-dir", str(stores)]) == 0
    line = json.loads(capsys.readouterr().out)
    assert (line["status"], line["path"]) == ("reused", str(stores / "kd-validation"))
    assert sorted(p.name for p in stores.iterdir()) == ["kd-validation"]
    with pytest.raises(SystemExit) as exc:  # exactly one of them
        main([*args, "--cache-dir", str(stores), "--output", str(tmp_path / "x")])
    assert exc.value.code == 2


def test_a_token_store_given_as_the_snapshot_is_refused_saying_what_it_is(
    snapshot, tokenizer_dir, tmp_path, capsys
) -> None:
    store = tmp_path / "store"
    assert main(_args(snapshot, tokenizer_dir, store, "--split", "validation")) == 0
    capsys.readouterr()
    assert main(_args(store, tokenizer_dir, tmp_path / "again")) == 1
    assert f"{store} is a token store already, not a text snapshot" in capsys.readouterr().err


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_torchrun_builds_one_store_cooperatively_with_the_bytes_of_one_process(
    snapshot, tokenizer_dir, tmp_path
) -> None:
    alone = tmp_path / "alone"
    assert main(_args(snapshot, tokenizer_dir, alone, "--rows-per-shard", "16")) == 0
    together = tmp_path / "together"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cli = ["-m", "puzzletron.cli", *_args(snapshot, tokenizer_dir, together, "--rows-per-shard", "16")]
    out = subprocess.run([*launcher, *cli], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")), key=str)
    assert sorted(line["rank"] for line in lines) == [0, 1]
    assert {line["status"] for line in lines} == {"done"}
    assert _tree(together) == _tree(alone)


def test_tokenize_verify_and_inspect_take_urls(snapshot, tokenizer_dir, bucket, capsys) -> None:
    url = f"{bucket}/stores/pk"
    assert main(_args(snapshot, tokenizer_dir, url)) == 0
    line = json.loads(capsys.readouterr().out)
    assert (line["status"], line["path"], line["manifest"]) == ("done", url, f"{url}/manifest.json")
    assert main(_args(snapshot, tokenizer_dir, url)) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "reused"
    assert main(["verify", url, "--json"]) == 0
    verified = json.loads(capsys.readouterr().out)
    assert (verified["status"], verified["sample_count"]) == ("ok", line["sample_count"])
    assert main(["inspect", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_on_disk"] == line["bytes_on_disk"]
    from puzzletron.dataset.storage.objects import Objects

    objects = Objects(url)
    objects.put_bytes("index/ids.bin", objects.get("index/ids.bin")[::-1])  # damaged after publication
    assert main(["verify", url]) == 1
    assert "index/ids.bin: SHA-256 differs from the manifest" in capsys.readouterr().out


def test_neither_output_nor_cache_dir_builds_in_the_per_user_cache(
    snapshot, tokenizer_dir, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("PUZZLETRON_CACHE_DIR", str(tmp_path / "per-user"))
    args = ["tokenize", str(snapshot), "--tokenizer", str(tokenizer_dir), "--split", "validation"]
    assert main(args) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["status"] == "done" and Path(line["path"]).parent == tmp_path / "per-user"
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "reused"


def test_tokenize_reads_a_text_snapshot_at_an_url(snapshot, tokenizer_dir, tmp_path, bucket, capsys) -> None:
    from puzzletron.dataset.storage.objects import Objects

    url = f"{bucket}/snapshots/pk"
    Objects(url).upload(snapshot)
    assert main(_args(snapshot, tokenizer_dir, tmp_path / "local", "--split", "validation")) == 0
    local = json.loads(capsys.readouterr().out)
    assert main(_args(url, tokenizer_dir, tmp_path / "from-url", "--split", "validation")) == 0
    line = json.loads(capsys.readouterr().out)
    assert (line["status"], line["path"]) == ("done", str(tmp_path / "from-url"))
    assert line["identity_sha256"] == local["identity_sha256"]  # the store of the same snapshot
    stores = f"{bucket}/stores/pk"
    assert main(_args(url, tokenizer_dir, stores, "--split", "validation")) == 0  # URL to URL
    assert json.loads(capsys.readouterr().out)["identity_sha256"] == local["identity_sha256"]
    assert main(_args(url, tokenizer_dir, stores, "--split", "validation")) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "reused"
    assert main(_args(f"{bucket}/nothing", tokenizer_dir, tmp_path / "none")) == 1
    assert "s3://bkt/nothing/manifest.json: no snapshot there" in capsys.readouterr().err

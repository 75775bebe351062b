"""`puzzletron-data pack-report`: the packing plan of a text snapshot split, as numbers and a PNG."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import numpy as np
import pytest

from puzzletron.cli import main
from puzzletron.cli._pack_report import draw_packing
from puzzletron.dataset.config import PackingSpec
from puzzletron.dataset.formats.text_snapshot import load_text_split
from puzzletron.dataset.packing import plan_packing
from puzzletron.dataset.tokenize import tokenize_conversations
from puzzletron.fixtures.hub import PUZZLE_KD, FixtureHub
from puzzletron.fixtures.tokenizer import build_chat_tokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TRAIN_ROWS = 160


@pytest.fixture(scope="module")
def snapshot(fixture_hub: FixtureHub, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Puzzle-KD text snapshot of the fixture Hub's rows, laid out like acquisition's (a saved
    `DatasetDict`: one ``save_to_disk`` folder per split)."""
    root = tmp_path_factory.mktemp("pack-report") / "puzzle-kd"
    data = fixture_hub.repo_dir(PUZZLE_KD) / "data"
    splits = {}
    for split, rows in (("train", TRAIN_ROWS), ("validation", 20)):
        files = sorted(str(p) for p in data.glob(f"{split}-*.parquet"))
        splits[split] = datasets.load_dataset("parquet", data_files=files, split="train").select(range(rows))
    datasets.DatasetDict(splits).save_to_disk(str(root))
    return root


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tok")


def _args(snapshot: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    return ["pack-report", str(snapshot), "--tokenizer", str(tokenizer), "--out", str(out), *extra]


def test_pack_report_writes_a_png_and_prints_the_plan(snapshot, tokenizer, tmp_path, capsys):
    out = tmp_path / "report" / "packing.png"  # its folder is created
    assert main(_args(snapshot, tokenizer, out, "--pack-size", "1024", "--seed", "3")) == 0
    stdout = capsys.readouterr().out
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 10_000
    # The numbers are those of the plan of the same split, tokenizer, pack size and seed.
    tokenized = tokenize_conversations(load_text_split(snapshot), tokenizer=tokenizer)
    plan = plan_packing(tokenized.samples.lengths, PackingSpec(pack_size=1024), seed=3)
    assert f"snapshot        {snapshot} [train]: {TRAIN_ROWS} rows\n" in stdout
    assert f"tokenised       {len(tokenized.samples)} samples, skipped {tokenized.skipped}" in stdout
    assert f"\nrows            {plan.num_rows} (lower bound {plan.lower_bound_rows})\n" in stdout
    assert f"\nefficiency      {plan.efficiency:.4%}  (non-pad tokens / slots)\n" in stdout
    dropped = (
        f"\ndropped         {len(plan.dropped)} samples longer than pack_size ({plan.dropped_tokens} tokens)"
    )
    assert dropped in stdout
    assert re.search(r"^lengths\s+min \d+  median \d+  p90 \d+  p99 \d+  max \d+$", stdout, flags=re.M)
    assert stdout.endswith(f"picture         {out}\n")


def test_pack_report_reads_the_split_it_is_given(snapshot, tokenizer, tmp_path, capsys):
    out = tmp_path / "validation.png"
    assert main(_args(snapshot, tokenizer, out, "--pack-size", "4096", "--split", "validation")) == 0
    assert f"snapshot        {snapshot} [validation]: 20 rows\n" in capsys.readouterr().out
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_pack_report_errors_are_one_line_with_the_documented_exit_codes(tmp_path, capsys):
    missing = tmp_path / "no-snapshot"
    args = ["pack-report", str(missing), "--tokenizer", str(tmp_path), "--out", str(tmp_path / "r.png")]
    assert main([*args, "--pack-size", "64"]) == 1
    err = capsys.readouterr().err
    assert err == f"puzzletron-data pack-report: text snapshot {missing} does not exist\n"
    assert main([*args, "--pack-size", "0"]) == 2  # a usage error, reported before any work
    err = capsys.readouterr().err
    assert err == "puzzletron-data pack-report: data.packing.pack_size must be > 0; got 0\n"
    assert not (tmp_path / "r.png").exists()


def test_a_missing_split_and_an_unwritable_picture_are_data_errors(snapshot, tokenizer, tmp_path, capsys):
    assert main(_args(snapshot, tokenizer, tmp_path / "r.png", "--pack-size", "64", "--split", "nope")) == 1
    err = capsys.readouterr().err
    expected = f"snapshot {snapshot} has no split 'nope' (splits: ['train', 'validation'])"
    assert err == f"puzzletron-data pack-report: {expected}\n"
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert main(_args(snapshot, tokenizer, blocker / "r.png", "--pack-size", "4096")) == 1  # an OSError
    err = capsys.readouterr().err
    assert err.startswith("puzzletron-data pack-report: ") and err.count("\n") == 1 and str(blocker) in err


def test_a_negative_seed_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "pack-report",
                "snap",
                "--tokenizer",
                "tok",
                "--pack-size",
                "8",
                "--out",
                "r.png",
                "--seed",
                "-1",
            ]
        )
    assert exit_info.value.code == 2
    assert "--seed: must be an int >= 0, got '-1'" in capsys.readouterr().err


def test_draw_packing_draws_a_plan_with_dropped_samples(tmp_path):
    lengths = np.array([5, 40, 12, 70, 33, 8, 64, 90, 21], dtype=np.int64)  # 70 and 90 are over pack_size
    plan = plan_packing(lengths, PackingSpec(pack_size=64, drop_long_samples=True), seed=0)
    assert len(plan.dropped) == 2
    out = tmp_path / "deep" / "plan.png"
    draw_packing(plan, lengths, out, title="tiny", max_rows=2)
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_a_token_store_needs_no_tokenizer_and_reports_the_same_plan(snapshot, tokenizer, tmp_path, capsys):
    """A store holds the lengths: the plan of the snapshot it was built from, with no tokenising."""
    from puzzletron.dataset.tokenize import build_token_store

    store = build_token_store(snapshot, tokenizer=tokenizer, output=tmp_path / "store")
    assert main(_args(snapshot, tokenizer, tmp_path / "a.png", "--pack-size", "1024")) == 0
    from_snapshot = capsys.readouterr().out.splitlines()
    args = ["pack-report", str(store), "--pack-size", "1024", "--out", str(tmp_path / "b.png")]
    assert main(args) == 0
    from_store = capsys.readouterr().out.splitlines()
    assert from_store[0] == f"token store     {store}: {TRAIN_ROWS} rows"
    keep = ("tokenised", "lengths", "pack_size", "rows", "efficiency", "dropped")
    assert [line for line in from_store if line.startswith(keep)] == [
        line for line in from_snapshot if line.startswith(keep)
    ]
    assert (tmp_path / "b.png").read_bytes()[:8] == PNG_MAGIC
    assert main(["pack-report", str(snapshot), "--pack-size", "64", "--out", str(tmp_path / "c.png")]) == 2
    assert capsys.readouterr().err == (
        f"puzzletron-data pack-report: --tokenizer is required: {snapshot} is not a token store\n"
    )


def test_pack_report_of_a_mixture_prints_each_component_and_draws_its_shares(
    snapshot, tokenizer, tmp_path, capsys
):
    """Two components (the snapshot's splits, tokenised into stores under --cache-dir) at shares 3:1."""
    config = tmp_path / "mix.yaml"
    config.write_text(
        "data:\n  modality: text\n  layout: packed_varlen\n  max_sample_length: 1024\n"
        "  packing: {pack_size: 1024, long_samples: truncate}\n  mixture:\n"
        f"    chat: {{path: {snapshot}, weight: 3}}\n    more: {{path: {snapshot}, weight: 1}}\n"
        "    num_tokens: 40960\n"
    )
    out = tmp_path / "shares.png"
    args = ["pack-report", "--mixture", str(config), "--tokenizer", str(tokenizer), "--out", str(out)]
    assert main([*args, "--cache-dir", str(tmp_path / "stores"), "--dp-size", "2"]) == 0
    stdout = capsys.readouterr().out
    assert out.read_bytes()[:8] == PNG_MAGIC
    rows = {
        line.split()[0]: line.split() for line in stdout.splitlines() if line.startswith(("chat ", "more "))
    }
    asked, got = (float(v.rstrip("%")) for v in rows["chat"][-2:])
    assert asked == 75.0 and abs(got - 75.0) < 5.0  # 40 rows of 1,024: within two rows of 75 %
    gap = float(re.search(r"share gap\s+([\d.]+) rows", stdout).group(1))
    assert gap <= 2
    assert main([*args, "--cache-dir", str(tmp_path / "stores"), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in facts["components"]] == ["chat", "more"] and facts["max_share_gap_rows"] <= 2


def test_a_snapshot_and_a_store_at_urls_report_the_plan_of_the_same_snapshot_in_a_folder(
    hub_endpoint, bucket, tokenizer, tmp_path, capsys
):
    url, folder, store = f"{bucket}/snapshots/pk", tmp_path / "pk", f"{bucket}/stores/pk"
    for output in (url, str(folder)):
        argv = ["materialize", "puzzle-kd", "--output", output, "--train-samples", "24"]
        assert main([*argv, "--validation-samples", "2", "--quiet"]) == 0
    assert main(["tokenize", url, "--tokenizer", str(tokenizer), "--output", store, "--quiet"]) == 0
    capsys.readouterr()
    reports = {}
    for source in (url, str(folder), store):
        picture = tmp_path / f"{len(reports)}.png"
        assert main([*_args(source, tokenizer, picture, "--pack-size", "512", "--seed", "5"), "--json"]) == 0
        reports[source] = json.loads(capsys.readouterr().out)
        assert picture.read_bytes()[:8] == PNG_MAGIC
    keys = ("row_count", "sample_count", "token_count", "packs", "lower_bound_packs", "efficiency")
    plans = [{key: report[key] for key in keys} for report in reports.values()]
    assert plans[0]["row_count"] == 24 and plans[0]["packs"] >= 1
    assert plans == [plans[1]] * 3
    assert [report["path"] for report in reports.values()] == [url, str(folder.absolute()), store]
    assert main(_args(url, tokenizer, tmp_path / "t.png", "--pack-size", "512")) == 0
    assert f"snapshot        {url} [train]: 24 rows\n" in capsys.readouterr().out

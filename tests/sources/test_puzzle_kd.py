"""Puzzle-KD acquisition end to end: the default loaders, the real `huggingface_hub`, the olah mirror and
the generated fixture repositories, nothing injected. Exact rows and columns, a seeded shuffle, byte-identical
reruns, only the shards it needs, a shortfall publishes nothing, reuse without any request, the revision
pinned against new commits, and a manifest of every file that `verify_text_snapshot` checks."""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq
import pytest

from _files import cached_files, copy_repo, tree_digest
from puzzletron.dataset import TextAcquisitionSpec, materialize_puzzle_kd_dataset
from puzzletron.dataset.errors import AcquisitionError
from puzzletron.dataset.sources import verify_text_snapshot
from puzzletron.fixtures.faults import FaultProxy
from puzzletron.fixtures.hub import PUZZLE_KD, FixtureHub, commit_files
from puzzletron.fixtures.mirror import serve_hub


def _source_rows(hub: FixtureHub, split: str) -> list[dict[str, Any]]:
    rows = []
    for shard in sorted((hub.repo_dir(PUZZLE_KD) / "data").glob(f"{split}-*.parquet")):
        rows += pq.read_table(shard).to_pylist()
    return rows


@pytest.fixture(scope="module")
def puzzle_kd(hub_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("pkd") / "snapshot"
    return out, materialize_puzzle_kd_dataset(
        TextAcquisitionSpec(output_dir=out, train_samples=500, validation_samples=120)
    )


def test_puzzle_kd_has_exact_rows_and_columns_and_reads_back(
    puzzle_kd: tuple[Path, dict[str, Any]], fixture_hub: FixtureHub
) -> None:
    out, manifest = puzzle_kd
    assert manifest["splits"] == {"train": 500, "validation": 120}
    assert manifest["version"] == 1
    assert manifest["acquisition"]["revision"] == fixture_hub.shas[PUZZLE_KD]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    loaded = datasets.load_from_disk(str(out))
    assert set(loaded) == {"train", "validation"}
    assert len(loaded["train"]) == 500 and len(loaded["validation"]) == 120
    columns = ["uuid", "license", "generator", "version", "category", "reasoning", "messages"]
    assert loaded["train"].column_names == columns
    source_train = {r["uuid"]: r for r in _source_rows(fixture_hub, "train")}
    source_validation = {r["uuid"]: r for r in _source_rows(fixture_hub, "validation")}
    for row in loaded["train"]:
        assert source_train[row["uuid"]] == row  # every column preserved, value for value
    assert all(row["uuid"] in source_validation for row in loaded["validation"])
    assert len(set(loaded["train"]["uuid"])) == 500


def test_puzzle_kd_is_shuffled_by_the_seed(
    puzzle_kd: tuple[Path, dict[str, Any]], fixture_hub: FixtureHub
) -> None:
    out, _ = puzzle_kd
    train = datasets.load_from_disk(str(out))["train"]["uuid"]
    in_file_order = [r["uuid"] for r in _source_rows(fixture_hub, "train")]
    position = {u: i for i, u in enumerate(in_file_order)}
    picked = [position[u] for u in train]
    assert picked != sorted(picked)  # not file order
    assert picked[:50] != list(range(picked[0], picked[0] + 50))


def test_puzzle_kd_other_seed_other_rows_same_seed_same_bytes(
    puzzle_kd: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out, manifest = puzzle_kd
    again = materialize_puzzle_kd_dataset(
        TextAcquisitionSpec(output_dir=tmp_path / "again", train_samples=500, validation_samples=120)
    )
    assert again == manifest
    # byte-identical snapshot, datasets' state.json included (fingerprint derived from the identity)
    assert tree_digest(tmp_path / "again") == tree_digest(out)
    other = tmp_path / "other"
    materialize_puzzle_kd_dataset(
        TextAcquisitionSpec(output_dir=other, train_samples=500, validation_samples=120, seed=7)
    )
    assert (
        datasets.load_from_disk(str(other))["train"]["uuid"]
        != datasets.load_from_disk(str(out))["train"]["uuid"]
    )


def test_puzzle_kd_downloads_only_the_shards_it_needs(
    hub_endpoint: str, fresh_hf_home: Path, tmp_path: Path, monkeypatch
) -> None:
    with FaultProxy(hub_endpoint) as proxy:  # pass-through: counts the requests that reach the mirror
        monkeypatch.setenv("HF_ENDPOINT", proxy.endpoint)
        materialize_puzzle_kd_dataset(
            TextAcquisitionSpec(output_dir=tmp_path / "s", train_samples=100, validation_samples=10)
        )
    # 750 rows per train shard, 200 per validation shard: one of each suffices (4 + 2 exist)
    fetched = proxy.downloads(".parquet")
    assert len(fetched) == 2, fetched
    assert fetched[0].startswith("data/train-") and fetched[1].startswith("data/validation-")
    shards = [f for f in cached_files(fresh_hf_home, PUZZLE_KD) if f.endswith(".parquet")]
    assert sorted(shards) == sorted(fetched)


def test_puzzle_kd_shortfall_names_k_of_n_and_publishes_nothing(hub_endpoint: str, tmp_path: Path) -> None:
    out = tmp_path / "short"
    with pytest.raises(AcquisitionError, match=r"400/401 rows"):
        materialize_puzzle_kd_dataset(
            TextAcquisitionSpec(output_dir=out, train_samples=10, validation_samples=401)
        )
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no transaction directory left behind


def test_puzzle_kd_rerun_reuses_without_any_request(
    fixture_hub: FixtureHub, tmp_path: Path, monkeypatch
) -> None:
    out = tmp_path / "snap"
    spec = TextAcquisitionSpec(output_dir=out, train_samples=50, validation_samples=5)
    with serve_hub(fixture_hub.root) as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        first = materialize_puzzle_kd_dataset(spec)
    with pytest.raises(urllib.error.URLError):  # the mirror process is gone: nothing answers any more
        urllib.request.urlopen(f"{endpoint}/api/whoami-v2", timeout=2)
    # revision=None reuses the pinned revision with no network at all
    assert materialize_puzzle_kd_dataset(spec) == first
    with pytest.raises(ValueError, match="does not match requested acquisition"):
        materialize_puzzle_kd_dataset(
            TextAcquisitionSpec(output_dir=out, train_samples=51, validation_samples=5)
        )
    with pytest.raises(ValueError, match="does not match requested acquisition"):
        materialize_puzzle_kd_dataset(
            TextAcquisitionSpec(output_dir=out, train_samples=50, validation_samples=5, revision="f" * 40)
        )
    # an explicit sha equal to the pinned one is reused without a request either
    pinned = first["acquisition"]["revision"]
    assert (
        materialize_puzzle_kd_dataset(
            TextAcquisitionSpec(output_dir=out, train_samples=50, validation_samples=5, revision=pinned)
        )
        == first
    )


def test_non_empty_directory_without_snapshot_is_an_error(hub_endpoint: str, tmp_path: Path) -> None:
    (tmp_path / "stray.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        materialize_puzzle_kd_dataset(
            TextAcquisitionSpec(output_dir=tmp_path, train_samples=5, validation_samples=5)
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stray.txt"]


def test_revision_none_pins_current_sha_and_new_commits_do_not_change_a_snapshot(
    fixture_hub: FixtureHub, hub_endpoint: str, tmp_path: Path
) -> None:
    repo_id = "acme/puzzle-kd-moving"
    repo = copy_repo(fixture_hub, PUZZLE_KD, repo_id)
    first_sha = commit_files(repo, {"NOTES.md": b"first\n"}, message="notes")
    out = tmp_path / "snap"
    spec = TextAcquisitionSpec(output_dir=out, train_samples=20, validation_samples=5, source=repo_id)
    manifest = materialize_puzzle_kd_dataset(spec)
    assert manifest["acquisition"]["revision"] == first_sha
    before = tree_digest(out)
    # the repository moves on: new data on main
    shard = next((repo / "data").glob("train-00000-*.parquet"))
    table = pq.read_table(shard).slice(0, 10)
    pq.write_table(table, shard)
    second_sha = commit_files(repo, {"NOTES.md": b"second\n"}, message="shrink a shard")
    assert second_sha != first_sha
    assert materialize_puzzle_kd_dataset(spec) == manifest  # revision=None: keeps the pinned snapshot
    assert tree_digest(out) == before
    with pytest.raises(ValueError, match="does not match requested acquisition"):
        materialize_puzzle_kd_dataset(
            TextAcquisitionSpec(
                output_dir=out, train_samples=20, validation_samples=5, source=repo_id, revision="main"
            )
        )
    fresh = materialize_puzzle_kd_dataset(
        TextAcquisitionSpec(
            output_dir=tmp_path / "new", train_samples=20, validation_samples=5, source=repo_id
        )
    )
    assert fresh["acquisition"]["revision"] == second_sha
    # "latest" and "main" resolve like None; an explicit sha is used as given
    old = materialize_puzzle_kd_dataset(
        TextAcquisitionSpec(
            output_dir=tmp_path / "old",
            train_samples=20,
            validation_samples=5,
            source=repo_id,
            revision=first_sha,
        )
    )
    assert old["acquisition"]["revision"] == first_sha
    assert tree_digest(tmp_path / "old") == before
    latest = materialize_puzzle_kd_dataset(
        TextAcquisitionSpec(
            output_dir=tmp_path / "latest",
            train_samples=20,
            validation_samples=5,
            source=repo_id,
            revision="latest",
        )
    )
    assert latest["acquisition"]["revision"] == second_sha


def test_puzzle_kd_reuse_checks_the_split_files_are_there(hub_endpoint: str, tmp_path: Path) -> None:
    spec = TextAcquisitionSpec(output_dir=tmp_path / "s", train_samples=5, validation_samples=5)
    materialize_puzzle_kd_dataset(spec)
    next((tmp_path / "s" / "validation").glob("*.arrow")).unlink()
    with pytest.raises(ValueError, match="incomplete Puzzle-KD snapshot"):
        materialize_puzzle_kd_dataset(spec)


def test_puzzle_kd_manifest_lists_every_file_and_verify_checks_them(
    hub_endpoint: str, tmp_path: Path
) -> None:
    out = tmp_path / "s"
    spec = TextAcquisitionSpec(output_dir=out, train_samples=20, validation_samples=7)
    manifest = materialize_puzzle_kd_dataset(spec)
    files = {r["path"]: r for r in manifest["files"]}
    assert list(files) == [
        "dataset_dict.json",
        "train/data-00000-of-00001.arrow",
        "train/dataset_info.json",
        "train/state.json",
        "validation/data-00000-of-00001.arrow",
        "validation/dataset_info.json",
        "validation/state.json",
    ]
    for rel, record in files.items():
        data = (out / rel).read_bytes()
        assert record == {"path": rel, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    report = verify_text_snapshot(out)
    assert report.ok and report.problems == ()
    assert (report.sample_count, report.image_count, report.path) == (27, 0, str(out))

    # one changed byte of a value, same size: reuse (sizes only) accepts it, verify names the file
    arrow = out / "train" / "data-00000-of-00001.arrow"
    data = arrow.read_bytes()
    uuid = datasets.load_from_disk(str(out))["train"][0]["uuid"].encode()
    at = data.index(uuid)
    arrow.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
    assert materialize_puzzle_kd_dataset(spec) == manifest
    assert verify_text_snapshot(out).problems == (
        f"{out}: train/data-00000-of-00001.arrow: SHA-256 differs from the manifest",
    )
    arrow.write_bytes(data)

    # a row count that disagrees with the manifest
    text = (out / "manifest.json").read_text()
    (out / "manifest.json").write_text(text.replace('"train": 20', '"train": 21'))
    assert verify_text_snapshot(out).problems == (f"{out}: split 'train' has 20 rows, the manifest says 21",)
    (out / "manifest.json").write_text(text)

    # a truncated file: reuse refuses it, verify reports its size
    validation = out / "validation" / "data-00000-of-00001.arrow"
    size = validation.stat().st_size
    validation.write_bytes(validation.read_bytes()[:100])
    with pytest.raises(
        ValueError,
        match=r"incomplete Puzzle-KD snapshot: .*validation/data-00000-of-00001.arrow has 100 bytes",
    ):
        materialize_puzzle_kd_dataset(spec)
    problems = verify_text_snapshot(out).problems
    assert (
        f"{out}: validation/data-00000-of-00001.arrow has 100 bytes, the manifest records {size} "
        "(truncated or replaced)"
    ) in problems
    assert any("split 'validation'" in p for p in problems)
    assert not verify_text_snapshot(tmp_path).ok  # no manifest at all

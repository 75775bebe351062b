"""Acquisition end to end: the default loaders, the real `huggingface_hub`, an olah mirror on loopback and
the generated fixture repositories. No loader or resolver is injected anywhere in this file."""

from __future__ import annotations

import hashlib
import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq
import pytest

from puzzletron.dataset import (
    TextAcquisitionSpec,
    VlmAcquisitionSpec,
    load_materialized_conversation_subset,
    materialize_intersyn_subset,
    materialize_nemotron_vlm_dataset,
    materialize_puzzle_kd_dataset,
)
from puzzletron.dataset.errors import AcquisitionError, ConfigError
from puzzletron.dataset.sources import verify_text_snapshot
from puzzletron.fixtures.faults import FaultProxy
from puzzletron.fixtures.hub import (
    INTERSYN_MULTI,
    INTERSYN_SINGLE,
    NEMOTRON_VLM,
    PUZZLE_KD,
    FixtureHub,
    commit_files,
    repo_path,
)
from puzzletron.fixtures.mirror import free_port, serve_hub

VLM_SUBSETS = ("sparsetables", "plotqa_cot", "wiki_en")


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _cached_files(hf_home: Path, repo_id: str) -> list[str]:
    """Files of `repo_id` in the Hub cache (what was downloaded), relative to the snapshot."""
    folder = hf_home / "hub" / ("datasets--" + repo_id.replace("/", "--")) / "snapshots"
    return sorted(str(p.relative_to(next(folder.iterdir()))) for p in folder.rglob("*") if p.is_file())


def _source_rows(hub: FixtureHub, split: str) -> list[dict[str, Any]]:
    rows = []
    for shard in sorted((hub.repo_dir(PUZZLE_KD) / "data").glob(f"{split}-*.parquet")):
        rows += pq.read_table(shard).to_pylist()
    return rows


def _copy_repo(hub: FixtureHub, repo_id: str, new_id: str) -> Path:
    """A private copy of a fixture repository under another name in the same mirror (safe to commit to)."""
    target = repo_path(hub.root, new_id)
    if not target.exists():
        shutil.copytree(hub.repo_dir(repo_id), target)
    return target


# ------------------------------------------------------------------------------------------------ specs


def test_specs_validate_and_normalise_their_fields(tmp_path: Path) -> None:
    spec = VlmAcquisitionSpec(
        output_dir=str(tmp_path), subsets=(" a ", "b"), subset_rows=(("a", 10), ("b", 30))
    )
    assert spec.subsets == ("a", "b") and spec.output_dir == tmp_path
    assert VlmAcquisitionSpec(output_dir=tmp_path, subsets=("a", "b")).subset_rows == (("a", 1), ("b", 1))
    identity = spec.identity(revision="abc")
    assert identity["adapter"] == "nemotron_vlm_v2" and identity["revision"] == "abc"
    assert identity["subsets"] == ["a", "b"] and identity["subset_rows"] == {"a": 10, "b": 30}
    assert "output_dir" not in identity
    json.dumps(identity)
    text = TextAcquisitionSpec(output_dir=tmp_path).identity(revision="r")
    assert text == {
        "adapter": "puzzle_kd_v2",
        "train_samples": 8192,
        "validation_samples": 1024,
        "seed": 408,
        "revision": "r",
        "source": PUZZLE_KD,
    }
    with pytest.raises(TypeError):
        TextAcquisitionSpec(tmp_path)  # type: ignore[misc]
    for bad in (
        {"train_samples": 0},
        {"validation_samples": -1},
        {"train_samples": True},
        {"source": "no-slash"},
        {"revision": " "},
    ):
        with pytest.raises(ConfigError):
            TextAcquisitionSpec(output_dir=tmp_path, **bad)
    for bad in (
        {"subsets": ()},
        {"subsets": ("a", " a")},
        {"subsets": ("a", "")},
        {"subsets": ("a", "b"), "subset_rows": (("b", 1), ("a", 1))},
        {"subsets": ("a",), "subset_rows": (("a", 0),)},
        {"num_samples": 0},
        {"max_shards_per_subset": 0},
    ):
        with pytest.raises(ConfigError):
            VlmAcquisitionSpec(output_dir=tmp_path, **bad)


# ------------------------------------------------------------------------------------------- Puzzle-KD


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
    assert _tree_digest(tmp_path / "again") == _tree_digest(out)
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
    shards = [f for f in _cached_files(fresh_hf_home, PUZZLE_KD) if f.endswith(".parquet")]
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
    repo = _copy_repo(fixture_hub, PUZZLE_KD, repo_id)
    first_sha = commit_files(repo, {"NOTES.md": b"first\n"}, message="notes")
    out = tmp_path / "snap"
    spec = TextAcquisitionSpec(output_dir=out, train_samples=20, validation_samples=5, source=repo_id)
    manifest = materialize_puzzle_kd_dataset(spec)
    assert manifest["acquisition"]["revision"] == first_sha
    before = _tree_digest(out)
    # the repository moves on: new data on main
    shard = next((repo / "data").glob("train-00000-*.parquet"))
    table = pq.read_table(shard).slice(0, 10)
    pq.write_table(table, shard)
    second_sha = commit_files(repo, {"NOTES.md": b"second\n"}, message="shrink a shard")
    assert second_sha != first_sha
    assert materialize_puzzle_kd_dataset(spec) == manifest  # revision=None: keeps the pinned snapshot
    assert _tree_digest(out) == before
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
    assert _tree_digest(tmp_path / "old") == before
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


# ---------------------------------------------------------------------------------------- Nemotron-VLM


def _vlm_rows(hub: FixtureHub, subset: str) -> dict[str, dict[str, Any]]:
    path = hub.repo_dir(NEMOTRON_VLM) / subset / f"{subset}.jsonl"
    return {row["id"]: row for row in map(json.loads, path.read_text().splitlines())}


def _tar_member(hub: FixtureHub, subset: str, name: str) -> bytes:
    import tarfile

    for shard in sorted((hub.repo_dir(NEMOTRON_VLM) / subset / "media").glob("*.tar")):
        with tarfile.open(shard) as tar:
            if name in tar.getnames():
                return tar.extractfile(name).read()  # type: ignore[union-attr]
    raise KeyError(name)


@pytest.fixture(scope="module")
def vlm_exhausting(
    hub_endpoint: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    """Every shard allowed and more samples than sparsetables and wiki_en hold: redistribution + rejects."""
    out = tmp_path_factory.mktemp("vlm") / "all"
    spec = VlmAcquisitionSpec(output_dir=out, num_samples=140, max_shards_per_subset=3)
    return out, materialize_nemotron_vlm_dataset(spec)


def test_nemotron_quotas_redistribution_and_rejected_rows(
    vlm_exhausting: tuple[Path, dict[str, Any]], fixture_hub: FixtureHub
) -> None:
    _, manifest = vlm_exhausting
    diag = manifest["diagnostics"]
    assert manifest["sample_count"] == 140 == manifest["image_count"]
    assert diag["requested_quotas"] == {"sparsetables": 47, "plotqa_cot": 47, "wiki_en": 46}
    # 36 + the string-content row in sparsetables; 36 in wiki_en: both run dry, plotqa_cot takes the rest
    assert diag["materialized_rows"] == {"sparsetables": 37, "plotqa_cot": 67, "wiki_en": 36}
    # wiki_en runs dry first: its 10 missing rows go 5/5 to the others (equal max(weight - taken, 1));
    # then sparsetables runs dry 47 + 5 - 37 = 15 short, all of which plotqa_cot takes
    assert diag["redistributed_rows"] == {"sparsetables": 5, "plotqa_cot": 20, "wiki_en": 0}
    rejected = {r["row_id"]: r for r in diag["rejected_rows"]}
    assert (
        "sparsetables-missing-image" in rejected
        and "999999.png" in rejected["sparsetables-missing-image"]["reason"]
    )
    assert "exactly one image" in rejected["sparsetables-two-images"]["reason"]
    assert rejected["wiki_en-video"]["subset"] == "wiki_en"
    assert "sparsetables-string-content" not in rejected
    assert manifest["acquisition"]["revision"] == fixture_hub.shas[NEMOTRON_VLM]
    assert manifest["sources"] == [{"dataset": NEMOTRON_VLM, "revision": fixture_hub.shas[NEMOTRON_VLM]}] or (
        manifest["sources"][0]["dataset"] == NEMOTRON_VLM
    )


def test_nemotron_no_assistant_row_is_rejected(hub_endpoint: str, tmp_path: Path) -> None:
    manifest = materialize_nemotron_vlm_dataset(
        VlmAcquisitionSpec(
            output_dir=tmp_path / "p", subsets=("plotqa_cot",), num_samples=72, max_shards_per_subset=3
        )
    )
    rejected = {r["row_id"]: r["reason"] for r in manifest["diagnostics"]["rejected_rows"]}
    assert list(rejected) == ["plotqa_cot-no-assistant"]
    assert "assistant" in rejected["plotqa_cot-no-assistant"]


def test_nemotron_images_are_joined_by_exact_member_name(
    vlm_exhausting: tuple[Path, dict[str, Any]], fixture_hub: FixtureHub
) -> None:
    out, _ = vlm_exhausting
    samples = load_materialized_conversation_subset(out)
    checked = 0
    for sample in samples:
        subset, row_id = sample["source"]["subset"], sample["source"]["row_id"]
        row = _vlm_rows(fixture_hub, subset)[row_id]
        ref = next(
            item["image"]
            for turn in row["messages"]
            if isinstance(turn["content"], list)
            for item in turn["content"]
            if isinstance(item, dict) and item.get("type") == "image"
        )
        image = next(
            it["image"] for turn in sample["conversation"] for it in turn["content"] if it["type"] == "image"
        )
        assert Path(image).read_bytes() == _tar_member(fixture_hub, subset, ref)
        assert sample["source"]["dataset"] == NEMOTRON_VLM
        checked += 1
    assert checked == 140
    # multi-turn CoT is preserved whole
    plot = next(s for s in samples if s["source"]["subset"] == "plotqa_cot")
    assert [t["role"] for t in plot["conversation"]] == ["user", "assistant", "user", "assistant"]
    assert "<think>" in plot["conversation"][1]["content"][0]["text"]


def test_nemotron_downloads_only_needed_shards_and_asks_each_subset_for_its_quota(
    hub_endpoint: str, fresh_hf_home: Path, tmp_path: Path, monkeypatch
) -> None:
    spec = VlmAcquisitionSpec(output_dir=tmp_path / "small", num_samples=9, max_shards_per_subset=3)
    with FaultProxy(hub_endpoint) as proxy:  # pass-through: counts the requests that reach the mirror
        monkeypatch.setenv("HF_ENDPOINT", proxy.endpoint)
        manifest = materialize_nemotron_vlm_dataset(spec)
    assert manifest["diagnostics"]["materialized_rows"] == {"sparsetables": 3, "plotqa_cot": 3, "wiki_en": 3}
    # 3 shards of 12 images per subset; 3 rows need one shard each, never the others; no JSONL-only subset
    tars = proxy.downloads(".tar")
    assert sorted(t.split("/")[0] for t in tars) == sorted(VLM_SUBSETS), tars
    assert sorted(proxy.downloads(".jsonl")) == sorted(f"{s}/{s}.jsonl" for s in VLM_SUBSETS)
    assert len(proxy.downloads()) == 6  # nothing else: no index, no README
    cached = _cached_files(fresh_hf_home, NEMOTRON_VLM)
    assert sorted(f for f in cached if f.endswith(".tar")) == sorted(tars)
    assert not any(f.startswith("chartqa_cot") for f in cached)


def test_nemotron_max_shards_and_seed_choose_the_shards(fresh_hf_home: Path, tmp_path: Path) -> None:
    spec = VlmAcquisitionSpec(output_dir=tmp_path / "one", subsets=("sparsetables",), num_samples=12, seed=42)
    manifest = materialize_nemotron_vlm_dataset(spec)
    tars = [f for f in _cached_files(fresh_hf_home, NEMOTRON_VLM) if f.endswith(".tar")]
    assert len(tars) == 1  # max_shards_per_subset=1
    # 12 images in that shard, plus the string-content row when its image is in it: no more than 13 usable
    with pytest.raises(AcquisitionError, match=r"only \d+/20 usable rows"):
        materialize_nemotron_vlm_dataset(
            VlmAcquisitionSpec(output_dir=tmp_path / "short", subsets=("sparsetables",), num_samples=20)
        )
    assert not (tmp_path / "short").exists()
    assert manifest["sample_count"] == 12


def test_nemotron_rows_waiting_for_a_later_shard_are_not_parsed_again_per_shard(
    hub_endpoint: str, tmp_path: Path, monkeypatch
) -> None:
    """Reading 3 shards, a row whose image is in the last one is parsed once to learn its reference and once
    when it is yielded, not once per shard (a 100,000-row subset over many shards would parse millions)."""
    parsed: dict[bytes, int] = {}
    loads = json.loads

    def counting(text: Any, *args: Any, **kwargs: Any) -> Any:
        line = text.encode() if isinstance(text, str) else text
        if isinstance(line, bytes) and b'"messages"' in line:
            parsed[line] = parsed.get(line, 0) + 1
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counting)
    manifest = materialize_nemotron_vlm_dataset(
        VlmAcquisitionSpec(
            output_dir=tmp_path / "s", subsets=("sparsetables",), num_samples=30, max_shards_per_subset=3
        )
    )
    assert manifest["sample_count"] == 30
    assert parsed and max(parsed.values()) <= 2, sorted(parsed.values())[-5:]


def test_nemotron_honours_spec_source(fixture_hub: FixtureHub, hub_endpoint: str, tmp_path: Path) -> None:
    repo_id = "acme/vlm-copy"
    _copy_repo(fixture_hub, NEMOTRON_VLM, repo_id)
    manifest = materialize_nemotron_vlm_dataset(
        VlmAcquisitionSpec(output_dir=tmp_path / "c", num_samples=6, source=repo_id)
    )
    assert manifest["acquisition"]["source"] == repo_id
    assert {s["dataset"] for s in manifest["sources"]} == {repo_id}
    assert all(
        s["source"]["dataset"] == repo_id for s in load_materialized_conversation_subset(tmp_path / "c")
    )


def test_nemotron_weights_and_reuse(hub_endpoint: str, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "w"
    spec = VlmAcquisitionSpec(
        output_dir=out,
        subsets=("sparsetables", "plotqa_cot"),
        subset_rows=(("sparsetables", 10), ("plotqa_cot", 30)),
        num_samples=7,
    )
    manifest = materialize_nemotron_vlm_dataset(spec)
    assert manifest["diagnostics"]["requested_quotas"] == {"sparsetables": 2, "plotqa_cot": 5}
    assert manifest["diagnostics"]["materialized_rows"] == {"sparsetables": 2, "plotqa_cot": 5}
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # no mirror: reuse needs none
    assert materialize_nemotron_vlm_dataset(spec) == manifest
    with pytest.raises(ValueError, match="does not match requested acquisition"):
        materialize_nemotron_vlm_dataset(
            VlmAcquisitionSpec(output_dir=out, subsets=("sparsetables", "plotqa_cot"), num_samples=7)
        )


def test_each_image_is_decoded_once(hub_endpoint: str, tmp_path: Path, monkeypatch) -> None:
    """Acquisition validates each image and hands the materialiser the `EncodedImage` it made, which is
    stored as it is: one full decode per image, not two (the real decoder, counted)."""
    from puzzletron.dataset.conversation import images as _images

    decoded: list[int] = []
    real = _images._decode

    def counting(data: bytes, where: str) -> tuple[str, int, int]:
        decoded.append(len(data))
        return real(data, where)

    monkeypatch.setattr(_images, "_decode", counting)
    manifest = materialize_nemotron_vlm_dataset(VlmAcquisitionSpec(output_dir=tmp_path / "v", num_samples=6))
    assert manifest["diagnostics"]["rejected_rows"] == [] and manifest["image_count"] == 6
    assert sorted(decoded) == sorted(i["bytes"] for i in manifest["images"])


def test_nemotron_two_runs_are_byte_identical(hub_endpoint: str, tmp_path: Path) -> None:
    a = materialize_nemotron_vlm_dataset(VlmAcquisitionSpec(output_dir=tmp_path / "a", num_samples=12))
    b = materialize_nemotron_vlm_dataset(VlmAcquisitionSpec(output_dir=tmp_path / "b", num_samples=12))
    assert a == b
    assert _tree_digest(tmp_path / "a") == _tree_digest(tmp_path / "b")
    c = materialize_nemotron_vlm_dataset(
        VlmAcquisitionSpec(output_dir=tmp_path / "c", num_samples=12, seed=1)
    )
    assert [i["sha256"] for i in c["images"]] != [i["sha256"] for i in a["images"]]


# -------------------------------------------------------------------------------------------- InterSyn


@pytest.fixture(scope="module")
def intersyn(hub_endpoint: str, fixture_hub: FixtureHub, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("intersyn") / "subset"
    pins = {
        "single_turn_revision": fixture_hub.shas[INTERSYN_SINGLE],
        "multi_turn_revision": fixture_hub.shas[INTERSYN_MULTI],
    }
    return out, pins, materialize_intersyn_subset(out, **pins)


def test_intersyn_keeps_the_first_valid_rows_per_source(intersyn, fixture_hub: FixtureHub) -> None:
    out, _, manifest = intersyn
    assert manifest["sample_count"] == 16
    samples = load_materialized_conversation_subset(out)
    single = [s["source"]["row_id"] for s in samples if s["source"]["dataset"] == INTERSYN_SINGLE]
    multi = [s["source"]["row_id"] for s in samples if s["source"]["dataset"] == INTERSYN_MULTI]
    # bad rows: st 2 (blank question), 5 (undecodable), 7 (no image); mt 1 (one image), 4 (bad image), 6
    assert single == [f"st-{i:05d}" for i in (0, 1, 3, 4, 6, 8, 9, 10)]
    assert multi == [f"mt-{i:05d}" for i in (0, 2, 3, 5, 7, 8, 9, 10)]
    rejected = [(r["dataset"], r["row_id"]) for r in manifest["diagnostics"]["rejected_rows"]]
    assert rejected == [
        (INTERSYN_SINGLE, "st-00002"),
        (INTERSYN_SINGLE, "st-00005"),
        (INTERSYN_SINGLE, "st-00007"),
        (INTERSYN_MULTI, "mt-00001"),
        (INTERSYN_MULTI, "mt-00004"),
        (INTERSYN_MULTI, "mt-00006"),
    ]
    assert {(s["dataset"], s["revision"]) for s in manifest["sources"]} == {
        (INTERSYN_SINGLE, fixture_hub.shas[INTERSYN_SINGLE]),
        (INTERSYN_MULTI, fixture_hub.shas[INTERSYN_MULTI]),
    }
    assert all(s["image_count"] >= 2 for s in samples if s["source"]["dataset"] == INTERSYN_MULTI)


def test_intersyn_images_are_stored_as_the_source_bytes(intersyn, fixture_hub: FixtureHub) -> None:
    """The parquet ``{bytes, path}`` structs are read as they are (never decoded to PIL and re-encoded)."""
    out, _, manifest = intersyn
    source: dict[tuple[str, int], bytes] = {}
    for repo_id in (INTERSYN_SINGLE, INTERSYN_MULTI):
        for shard in sorted((fixture_hub.repo_dir(repo_id) / "data").glob("*.parquet")):
            for row in pq.read_table(shard).to_pylist():
                images = [row["image"]] if "image" in row else [row[f"image{g}"] for g in range(1, 6)]
                for k, image in enumerate(i for i in images if i is not None):
                    source[(row["id"], k)] = image["bytes"]
    formats = set()
    for record in manifest["images"]:
        data = source[(record["row_id"], record["image_index"])]
        stored = (out / record["path"]).read_bytes()
        assert hashlib.sha256(stored).hexdigest() == hashlib.sha256(data).hexdigest() == record["sha256"]
        formats.add(record["path"].rsplit(".", 1)[1])
    assert formats == {"png", "jpg"}  # JPEG stays JPEG
    assert len(manifest["images"]) >= 24


def test_intersyn_reuse_and_other_rows_per_source(intersyn, tmp_path: Path) -> None:
    out, pins, manifest = intersyn
    assert materialize_intersyn_subset(out, **pins) == manifest
    with pytest.raises(ValueError, match="does not match requested acquisition"):
        materialize_intersyn_subset(out, rows_per_source=4, **pins)
    with pytest.raises(AcquisitionError, match=r"only 17/18 valid rows"):
        materialize_intersyn_subset(tmp_path / "big", rows_per_source=18, **pins)
    assert not (tmp_path / "big").exists()
    again = materialize_intersyn_subset(tmp_path / "again", **pins)  # same request, another directory
    assert again == manifest
    assert _tree_digest(tmp_path / "again") == _tree_digest(out)


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


# ---------------------------------------------------------------------------------------------- faults


def test_unknown_repository_is_a_clear_error(hub_endpoint: str, tmp_path: Path) -> None:
    with pytest.raises(AcquisitionError) as info:
        materialize_puzzle_kd_dataset(
            TextAcquisitionSpec(
                output_dir=tmp_path / "x", train_samples=5, validation_samples=5, source="acme/nope"
            )
        )
    message = str(info.value)
    assert "acme/nope@main" in message and hub_endpoint in message and "HF_ENDPOINT" in message
    assert not (tmp_path / "x").exists()


def test_unknown_revision_is_a_clear_error(hub_endpoint: str, tmp_path: Path) -> None:
    bad = "0" * 40
    with pytest.raises(AcquisitionError) as info:
        materialize_puzzle_kd_dataset(
            TextAcquisitionSpec(
                output_dir=tmp_path / "x", train_samples=5, validation_samples=5, revision=bad
            )
        )
    assert f"{PUZZLE_KD}@{bad}" in str(info.value) and "revision" in str(info.value)
    assert list(tmp_path.iterdir()) == []
    # nothing left in the way: the same directory with the right revision succeeds
    fixed = TextAcquisitionSpec(output_dir=tmp_path / "x", train_samples=5, validation_samples=5)
    assert materialize_puzzle_kd_dataset(fixed)["splits"] == {"train": 5, "validation": 5}
    with pytest.raises(AcquisitionError, match="no-such-branch"):
        materialize_nemotron_vlm_dataset(
            VlmAcquisitionSpec(output_dir=tmp_path / "y", num_samples=3, revision="no-such-branch")
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


@pytest.mark.parametrize("status", [401, 403])
def test_gated_repository_says_to_set_hf_token_and_a_rerun_succeeds(
    hub_endpoint: str, tmp_path: Path, monkeypatch, status: int
) -> None:
    spec = VlmAcquisitionSpec(output_dir=tmp_path / "g", num_samples=3)
    with FaultProxy(hub_endpoint, mode="gated", gated_status=status) as proxy:
        monkeypatch.setenv("HF_ENDPOINT", proxy.endpoint)
        with pytest.raises(AcquisitionError) as info:
            materialize_nemotron_vlm_dataset(spec)
        assert proxy.requests  # it did ask, and got 401/403
        message = str(info.value)
        assert "HF_TOKEN" in message and f"{NEMOTRON_VLM}@main" in message and str(status) in message
        assert list(tmp_path.iterdir()) == []  # nothing published, no debris
        proxy.mode = "pass"  # access granted
        assert materialize_nemotron_vlm_dataset(spec)["sample_count"] == 3


def test_mirror_dropping_mid_tar_download_fails_cleanly_and_a_rerun_succeeds(
    hub_endpoint: str, fixture_hub: FixtureHub, fresh_hf_home: Path, tmp_path: Path, monkeypatch
) -> None:
    out = tmp_path / "vlm"
    spec = VlmAcquisitionSpec(output_dir=out, subsets=("plotqa_cot",), num_samples=2)
    with FaultProxy(hub_endpoint, mode="drop", drop_pattern=".tar") as proxy:
        monkeypatch.setenv("HF_ENDPOINT", proxy.endpoint)
        with pytest.raises(AcquisitionError) as info:
            materialize_nemotron_vlm_dataset(spec)
        message = str(info.value)
        pinned = fixture_hub.shas[NEMOTRON_VLM]
        assert f"{NEMOTRON_VLM}@{pinned}" in message and "plotqa_cot/media/" in message and "rerun" in message
        assert proxy.downloads(".jsonl") == ["plotqa_cot/plotqa_cot.jsonl"]  # it failed on the tar shard
        assert [p.name for p in tmp_path.iterdir()] == ["hf-home"]  # nothing published, no debris
        proxy.mode = "pass"
        assert materialize_nemotron_vlm_dataset(spec)["sample_count"] == 2


def test_mirror_dropping_mid_download_fails_cleanly_and_a_rerun_succeeds(
    hub_endpoint: str, fresh_hf_home: Path, tmp_path: Path, monkeypatch
) -> None:
    out = tmp_path / "snap"
    spec = TextAcquisitionSpec(output_dir=out, train_samples=30, validation_samples=30)
    with FaultProxy(hub_endpoint, mode="drop", drop_pattern="validation-") as proxy:
        monkeypatch.setenv("HF_ENDPOINT", proxy.endpoint)
        with pytest.raises(AcquisitionError) as info:
            materialize_puzzle_kd_dataset(spec)
        message = str(info.value)
        assert PUZZLE_KD in message and "rerun" in message and "HF_ENDPOINT" in message
        assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["hf-home"]
        # no truncated shard in the cache either (huggingface_hub drops the partial file)
        assert not [f for f in _cached_files(fresh_hf_home, PUZZLE_KD) if "validation-" in f]
        proxy.mode = "pass"  # the mirror is back
        manifest = materialize_puzzle_kd_dataset(spec)
    assert manifest["splits"] == {"train": 30, "validation": 30}
    assert datasets.load_from_disk(str(out))["validation"].num_rows == 30


def test_nemotron_streams_each_sample_to_disk_before_pulling_the_next_row(
    hub_endpoint: str, tmp_path: Path
) -> None:
    """The real Hub reader, spied on: when row p is requested, the p - 1 accepted rows' images are on disk."""
    from puzzletron.dataset.sources import hub_vlm_rows

    out = tmp_path / "stream"
    seen: list[int] = []

    asked: dict[str, dict[str, Any]] = {}

    def spy(subset: str, **kwargs: Any):
        asked[subset] = kwargs
        for row in hub_vlm_rows(subset, **kwargs):
            txn = [p for p in tmp_path.iterdir() if p.name.startswith(".stream.txn-")]
            on_disk = len(list((txn[0] / "images").iterdir())) if txn else 0
            seen.append(on_disk)
            yield row

    manifest = materialize_nemotron_vlm_dataset(
        VlmAcquisitionSpec(output_dir=out, num_samples=9), sample_loader=spy
    )
    assert manifest["diagnostics"]["rejected_rows"] == []
    assert seen == list(range(9))
    # each subset is asked for its own quota (3 of 9), with the spec's source, seed and shard bound
    assert {s: a["quota"] for s, a in asked.items()} == {"sparsetables": 3, "plotqa_cot": 3, "wiki_en": 3}
    assert all(
        a["source"] == NEMOTRON_VLM and a["seed"] == 42 and a["max_shards"] == 1 for a in asked.values()
    )


def test_subset_materialisers_refuse_a_stray_directory_before_any_request(
    tmp_path: Path, fixture_hub: FixtureHub, monkeypatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # any request would fail differently
    (tmp_path / "stray.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty and holds no complete subset"):
        materialize_nemotron_vlm_dataset(VlmAcquisitionSpec(output_dir=tmp_path, num_samples=3))
    with pytest.raises(ValueError, match="not empty and holds no complete subset"):
        materialize_intersyn_subset(tmp_path, single_turn_revision=fixture_hub.shas[INTERSYN_SINGLE])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stray.txt"]


def test_jsonl_only_subset_rows_are_rejected_as_external_media(hub_endpoint: str, tmp_path: Path) -> None:
    spec = VlmAcquisitionSpec(
        output_dir=tmp_path / "c", subsets=("chartqa_cot", "sparsetables"), num_samples=4
    )
    manifest = materialize_nemotron_vlm_dataset(spec)
    diag = manifest["diagnostics"]
    assert diag["materialized_rows"] == {"chartqa_cot": 0, "sparsetables": 4}
    assert diag["redistributed_rows"] == {"chartqa_cot": 0, "sparsetables": 2}
    assert len(diag["rejected_rows"]) == 6 and all("external" in r["reason"] for r in diag["rejected_rows"])


def test_a_run_killed_mid_download_publishes_nothing_and_the_next_run_sweeps_it(
    hub_endpoint: str, tmp_path: Path
) -> None:
    import os
    import subprocess
    import sys
    import time

    out = tmp_path / "snap"
    code = (
        "import sys; from pathlib import Path; from puzzletron.dataset import *; "
        "materialize_puzzle_kd_dataset(TextAcquisitionSpec(output_dir=Path(sys.argv[1]), "
        "train_samples=20, validation_samples=20))"
    )
    with FaultProxy(hub_endpoint, mode="stall", drop_pattern="validation-") as proxy:
        env = {**os.environ, "HF_ENDPOINT": proxy.endpoint, "HF_HOME": str(tmp_path / "hf")}
        child = subprocess.Popen([sys.executable, "-c", code, str(out)], env=env)
        deadline = time.monotonic() + 60
        while not any(m == "GET" and "validation-" in p for m, p in proxy.requests):
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        child.kill()  # mid-download, holding the lock and a half-filled transaction directory
        child.wait(timeout=30)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".snap.txn-")]  # left by the kill
    manifest = materialize_puzzle_kd_dataset(
        TextAcquisitionSpec(output_dir=out, train_samples=20, validation_samples=20)
    )
    assert manifest["splits"] == {"train": 20, "validation": 20}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".snap.txn-")]  # swept


def test_one_dropped_download_is_retried_within_the_run(
    hub_endpoint: str, fresh_hf_home: Path, fixture_hub: FixtureHub, tmp_path: Path, monkeypatch
) -> None:
    """huggingface_hub resumes with a Range request; the mirror answers 200 with the whole file, which the
    client detects and restarts from byte 0, so the shard is intact."""
    with FaultProxy(hub_endpoint, mode="drop", drop_pattern="train-", max_drops=1) as proxy:
        monkeypatch.setenv("HF_ENDPOINT", proxy.endpoint)
        materialize_puzzle_kd_dataset(
            TextAcquisitionSpec(output_dir=tmp_path / "s", train_samples=10, validation_samples=10)
        )
        assert proxy.drops == 1
    cached = fresh_hf_home / "hub" / ("datasets--" + PUZZLE_KD.replace("/", "--")) / "snapshots"
    shard = next(cached.rglob("train-*.parquet"))
    assert shard.read_bytes() == (fixture_hub.repo_dir(PUZZLE_KD) / "data" / shard.name).read_bytes()

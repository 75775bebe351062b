"""Nemotron-VLM acquisition end to end through the olah mirror, nothing injected but a spy on the real
reader: quotas, redistribution and rejected rows, images joined by exact tar member name, only the needed
shards downloaded, each row parsed and each image decoded once, each sample on disk before the next row,
the spec's source, weights and reuse honoured, and byte-identical reruns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from _files import cached_files, copy_repo, tree_digest
from puzzletron.dataset import (
    VlmAcquisitionSpec,
    load_materialized_conversation_subset,
    materialize_nemotron_vlm_dataset,
)
from puzzletron.dataset.errors import AcquisitionError
from puzzletron.fixtures.faults import FaultProxy
from puzzletron.fixtures.hub import NEMOTRON_VLM, FixtureHub
from puzzletron.fixtures.mirror import free_port

VLM_SUBSETS = ("sparsetables", "plotqa_cot", "wiki_en")


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
    cached = cached_files(fresh_hf_home, NEMOTRON_VLM)
    assert sorted(f for f in cached if f.endswith(".tar")) == sorted(tars)
    assert not any(f.startswith("chartqa_cot") for f in cached)


def test_nemotron_max_shards_and_seed_choose_the_shards(fresh_hf_home: Path, tmp_path: Path) -> None:
    spec = VlmAcquisitionSpec(output_dir=tmp_path / "one", subsets=("sparsetables",), num_samples=12, seed=42)
    manifest = materialize_nemotron_vlm_dataset(spec)
    tars = [f for f in cached_files(fresh_hf_home, NEMOTRON_VLM) if f.endswith(".tar")]
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
    copy_repo(fixture_hub, NEMOTRON_VLM, repo_id)
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
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")
    c = materialize_nemotron_vlm_dataset(
        VlmAcquisitionSpec(output_dir=tmp_path / "c", num_samples=12, seed=1)
    )
    assert [i["sha256"] for i in c["images"]] != [i["sha256"] for i in a["images"]]


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


def test_jsonl_only_subset_rows_are_rejected_as_external_media(hub_endpoint: str, tmp_path: Path) -> None:
    spec = VlmAcquisitionSpec(
        output_dir=tmp_path / "c", subsets=("chartqa_cot", "sparsetables"), num_samples=4
    )
    manifest = materialize_nemotron_vlm_dataset(spec)
    diag = manifest["diagnostics"]
    assert diag["materialized_rows"] == {"chartqa_cot": 0, "sparsetables": 4}
    assert diag["redistributed_rows"] == {"chartqa_cot": 0, "sparsetables": 2}
    assert len(diag["rejected_rows"]) == 6 and all("external" in r["reason"] for r in diag["rejected_rows"])

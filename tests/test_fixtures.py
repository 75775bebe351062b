"""The fixture Hub generator is deterministic and schema-faithful; the mirror starts and stops cleanly."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest
from PIL import Image

from puzzletron.fixtures.hub import (
    INTERSYN_MULTI,
    INTERSYN_SINGLE,
    NEMOTRON_VLM,
    PUZZLE_KD,
    FixtureHub,
    FixtureSizes,
    generate_fixture_hub,
)
from puzzletron.fixtures.mirror import serve_hub, wait_for_endpoint

TINY = FixtureSizes(
    puzzle_kd_train_rows=40, puzzle_kd_validation_rows=10, vlm_images_per_shard=3, intersyn_rows=12
)


def test_same_sizes_and_seed_give_the_same_commit_shas(tmp_path: Path) -> None:
    a = generate_fixture_hub(tmp_path / "a", sizes=TINY)
    b = generate_fixture_hub(tmp_path / "b", sizes=TINY)
    c = generate_fixture_hub(tmp_path / "c", sizes=TINY, seed=1)
    assert a.shas == b.shas
    assert set(a.shas) == {PUZZLE_KD, NEMOTRON_VLM, INTERSYN_SINGLE, INTERSYN_MULTI}
    assert all(a.shas[r] != c.shas[r] for r in a.shas)
    with pytest.raises(FileExistsError):
        generate_fixture_hub(tmp_path / "a", sizes=TINY)


def test_repositories_are_git_repos_on_main(fixture_hub: FixtureHub) -> None:
    for repo_id, sha in fixture_hub.shas.items():
        repo = fixture_hub.repo_dir(repo_id)
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        )
        branch = subprocess.run(["git", "branch", "--show-current"], cwd=repo, capture_output=True, text=True)
        assert head.stdout.strip() == sha and branch.stdout.strip() == "main"


def test_puzzle_kd_schema_and_shape(fixture_hub: FixtureHub) -> None:
    repo = fixture_hub.repo_dir(PUZZLE_KD)
    readme = (repo / "README.md").read_text()
    assert "path: data/train-*.parquet" in readme and "path: data/validation-*.parquet" in readme
    train = sorted((repo / "data").glob("train-*.parquet"))
    assert len(train) == 4 and len(list((repo / "data").glob("validation-*.parquet"))) == 2
    table = pq.read_table(train[0])
    assert table.column_names == [
        "uuid",
        "license",
        "generator",
        "version",
        "category",
        "reasoning",
        "messages",
    ]
    rows = table.to_pylist()
    assert {r["reasoning"] for r in rows} == {"off"}
    assert {r["category"] for r in rows} == {"math", "code", "stem", "chat"}
    assert any(r["messages"][0] == {"role": "system", "content": ""} for r in rows)
    assert any(len(r["messages"]) >= 5 for r in rows)  # multi-turn chat
    lengths = sorted(len(r["messages"][-1]["content"]) for r in rows)
    assert lengths[-1] > 5 * lengths[len(lengths) // 2]  # long tail


def test_nemotron_layout_and_special_rows(fixture_hub: FixtureHub) -> None:
    repo = fixture_hub.repo_dir(NEMOTRON_VLM)
    assert (repo / "README.md").is_file() and (repo / "data_format.md").is_file()
    formats = set()
    for subset in ("sparsetables", "plotqa_cot", "wiki_en"):
        shards = sorted((repo / subset / "media").glob("shard_*.tar"))
        assert [s.name for s in shards] == [f"shard_{i:06d}.tar" for i in range(3)]
        for shard in shards:
            with tarfile.open(shard) as tar:
                for member in tar.getmembers():
                    assert "/" not in member.name  # members at the tar root
                    if not member.name.endswith(".mp4"):
                        with Image.open(io.BytesIO(tar.extractfile(member).read())) as img:  # type: ignore[union-attr]
                            formats.add(img.format)
    assert formats == {"PNG", "JPEG"}
    rows = {
        row["id"]: row
        for subset in ("sparsetables", "plotqa_cot", "wiki_en")
        for row in map(json.loads, (repo / subset / f"{subset}.jsonl").read_text().splitlines())
    }
    assert {"sparsetables-missing-image", "sparsetables-two-images", "sparsetables-string-content"} <= set(
        rows
    )
    assert {"plotqa_cot-no-assistant", "wiki_en-video"} <= set(rows)
    assert isinstance(rows["sparsetables-string-content"]["messages"][0]["content"], str)
    plot = next(r for r in rows.values() if r["id"].startswith("plotqa_cot-") and r["id"].endswith("-0"))
    assert "<think>" in plot["messages"][1]["content"][0]["text"] and len(plot["messages"]) == 4
    refs = [
        r["messages"][0]["content"][0]["image"] for r in rows.values() if r["id"].startswith("plotqa_cot-2")
    ]
    assert len(refs) > len(set(refs))  # rows share images
    assert not (repo / "chartqa_cot" / "media").exists()
    chart = json.loads((repo / "chartqa_cot" / "chartqa_cot.jsonl").read_text().splitlines()[0])
    assert chart["messages"][0]["content"][0]["image"].startswith("train/png/two_col_")


def test_intersyn_parquet_reads_as_hf_image_features(fixture_hub: FixtureHub) -> None:
    single = fixture_hub.repo_dir(INTERSYN_SINGLE) / "data"
    ds = datasets.load_dataset("parquet", data_files=str(single / "*.parquet"), split="train")
    assert ds.column_names == ["id", "topic", "human", "gpt", "caption", "image"]
    assert isinstance(ds.features["image"], datasets.Image)
    assert ds[0]["image"].size == (64, 48)
    multi = sorted((fixture_hub.repo_dir(INTERSYN_MULTI) / "data").glob("multi-*.parquet"))
    assert len(multi) == 2
    table = pq.read_table(multi[0])
    assert table.column_names[:6] == ["id", "topic", "human1", "gpt1", "caption1", "image1"]
    rows = table.to_pylist()
    assert rows[0]["image5"] is None and rows[0]["human5"] is None  # null trailing groups
    assert set(rows[0]["image1"]) == {"bytes", "path"}
    readme = (fixture_hub.repo_dir(INTERSYN_MULTI) / "README.md").read_text()
    assert "split: multi" in readme and "path: data/multi-*" in readme


def test_serve_hub_starts_on_loopback_and_stops_its_process(fixture_hub: FixtureHub) -> None:
    with serve_hub(fixture_hub.root) as endpoint:
        assert endpoint.startswith("http://127.0.0.1:")
        wait_for_endpoint(f"{endpoint}/api/datasets/{PUZZLE_KD}/revision/main", timeout=5)
    with pytest.raises(TimeoutError):  # stopped: nothing answers on that port any more
        wait_for_endpoint(f"{endpoint}/api/whoami-v2", timeout=0.5)


def test_serve_hub_needs_a_mirrors_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="mirrors"), serve_hub(tmp_path):
        pass

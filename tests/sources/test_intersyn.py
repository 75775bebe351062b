"""InterSyn acquisition end to end through the olah mirror: the first valid rows of each source with the
rejected ones named, images stored as the source bytes (JPEG stays JPEG), reuse, a shortfall that publishes
nothing, and byte-identical reruns."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from _files import tree_digest
from puzzletron.dataset import load_materialized_conversation_subset, materialize_intersyn_subset
from puzzletron.dataset.errors import AcquisitionError
from puzzletron.fixtures.hub import INTERSYN_MULTI, INTERSYN_SINGLE, FixtureHub


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
    assert tree_digest(tmp_path / "again") == tree_digest(out)


def test_intersyn_writes_media_shards_when_asked(intersyn, tmp_path: Path) -> None:
    out, pins, manifest = intersyn
    sharded = materialize_intersyn_subset(tmp_path / "sharded", **pins, media="shards")
    assert sharded["version"] == 3 and sharded["media"]["images"] == manifest["image_count"]
    assert sharded["images"] == manifest["images"]  # the same images, by name, size and SHA-256
    assert (tmp_path / "sharded" / "samples.jsonl").read_bytes() == (out / "samples.jsonl").read_bytes()
    assert not (tmp_path / "sharded" / "images").exists()

"""The VLM store format: the reader's API (token reads, image table, references, pickling), verify and
describe through the format registry, and verify / the reader against tampered, truncated and foreign
stores."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from puzzletron.dataset import formats
from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.blocks import block_sums
from puzzletron.dataset.formats.manifest import sha256_file
from puzzletron.dataset.formats.token_store import content_sha256
from puzzletron.dataset.formats.vlm_store import VlmStore


@pytest.fixture
def store_dir(vlm_stores: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy of the Qwen2.5-VL fixture store (safe to damage)."""
    return Path(shutil.copytree(vlm_stores["qwen2_5_vl"], tmp_path / "store"))


def _sign(manifest_path: Path, root: Path, blocks_rel: str) -> None:
    """Record every listed file's size and SHA-256 and recompute `blocks_rel` (the block checksums of the
    files it covers) in the manifest at `manifest_path`: a forger's store, only content checks refuse it."""
    manifest = json.loads(manifest_path.read_text())
    covered = [r for r in manifest["files"] if r["path"] not in (blocks_rel, "tokens/manifest.json")]
    blocks = np.concatenate([block_sums((root / r["path"]).read_bytes()) for r in covered])
    (root / blocks_rel).write_bytes(blocks.astype("<u8").tobytes())
    for record in manifest["files"]:
        record["sha256"] = sha256_file(root / record["path"])
        record["bytes"] = (root / record["path"]).stat().st_size
    if "content_sha256" in manifest:  # the token store's binding of its identity to its files
        manifest["content_sha256"] = content_sha256(manifest)
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _forge(store: Path, rel: str, data: bytes) -> None:
    """Replace `rel` (``tokens/...`` or ``media/...``) and re-sign every manifest and checksum above it."""
    (store / rel).write_bytes(data)
    if rel.startswith("tokens/"):
        _sign(store / "tokens" / "manifest.json", store / "tokens", "index/blocks.u64")
    _sign(store / "manifest.json", store, "media/blocks.u64")


def test_the_reader_serves_tokens_images_and_references(vlm_stores: dict[str, Path]) -> None:
    store = VlmStore(vlm_stores["qwen2_5_vl"])
    assert store.image_offsets[0] == 0 and store.image_offsets[-1] == store.num_images
    assert store.grid.shape == (store.num_images, 3) and not store.grid.flags.writeable
    per_image = store.grid.astype(np.int64).prod(axis=1) // 4
    cum = np.concatenate([[0], np.cumsum(per_image)])
    assert np.array_equal(cum[store.image_offsets[1:]] - cum[store.image_offsets[:-1]], store.image_tokens)
    ids, _ = store.read(store.offsets[:-1], store.offsets[1:])
    assert int((ids == store.image_token_id).sum()) == int(store.image_tokens.astype(np.int64).sum())
    refs = store.image_refs(np.arange(store.num_images))
    assert all(p.startswith("images/") and len(h) == 64 for p, h in refs)
    copy = pickle.loads(pickle.dumps(store))
    assert np.array_equal(copy.read([0], [50])[0], store.read([0], [50])[0])
    assert repr(store).startswith("VlmStore(")


def test_verify_and_describe_dispatch_on_the_manifest(vlm_stores: dict[str, Path]) -> None:
    report = formats.verify(vlm_stores["qwen3_vl"])
    store = VlmStore(vlm_stores["qwen3_vl"])
    assert report.ok and report.format == "puzzletron-vlm-store"
    assert (report.sample_count, report.image_count) == (len(store), store.num_images)
    assert formats.summary(report) == f"{len(store)} samples, {store.num_images} images"
    info = formats.describe(vlm_stores["qwen3_vl"])
    assert info["processor"]["patch_size"] == 16 and info["identity"]["subset"]["sample_count"] == 40
    lines = formats.render(info)
    assert lines[0].startswith("VLM store ") and any(line.startswith("processor") for line in lines)


def test_a_tampered_shard_is_caught_by_verify_and_refused_by_the_reader(store_dir: Path) -> None:
    shard = store_dir / "tokens" / "shards" / "000001.tokens"
    data = bytearray(shard.read_bytes())
    data[10:12] = (65535).to_bytes(2, "little")
    shard.write_bytes(bytes(data))
    report = formats.verify(store_dir)
    assert any("000001.tokens: SHA-256 differs" in p for p in report.problems)
    store = VlmStore(store_dir)  # sizes match: opening succeeds, reading the damaged block does not
    first = store.tokens.manifest["shards"][1]["tokens"][0]
    with pytest.raises(SnapshotError, match=r"000001\.tokens: bytes 0\.\.\d+ \(block 0\) do not match"):
        store.read([first], [first + 20])


def test_an_id_outside_the_vocabulary_behind_matching_checksums_is_refused_by_the_reader(
    store_dir: Path,
) -> None:
    data = bytearray((store_dir / "tokens/shards/000001.tokens").read_bytes())
    data[10:12] = (65535).to_bytes(2, "little")
    _forge(store_dir, "tokens/shards/000001.tokens", bytes(data))
    store = VlmStore(store_dir)
    first = store.tokens.manifest["shards"][1]["tokens"][0]
    with pytest.raises(SnapshotError, match="outside the vocabulary"):
        store.read([first], [first + 20])
    assert any("outside the vocabulary" in p for p in formats.verify(store_dir).problems)


def test_an_image_token_turned_into_text_is_caught_behind_matching_hashes(store_dir: Path) -> None:
    image_token_id = VlmStore(store_dir).image_token_id
    ids = np.fromfile(store_dir / "tokens/shards/000000.tokens", dtype="<u2")
    ids[int(np.flatnonzero(ids == image_token_id)[0])] = 100  # an image run one token short
    _forge(store_dir, "tokens/shards/000000.tokens", ids.tobytes())
    problems = formats.verify(store_dir).problems
    assert len(problems) == 1 and "not one run per image as long as its grid says" in problems[0]


def test_a_changed_grid_is_caught_by_verify_and_refused_by_the_reader(store_dir: Path) -> None:
    grid = np.fromfile(store_dir / "media" / "grid.u32", dtype="<u4")
    grid[1] += 2  # the first image two patch rows taller: its token count no longer adds up
    grid.tofile(store_dir / "media" / "grid.u32")
    assert any("media/grid.u32: SHA-256 differs" in p for p in formats.verify(store_dir).problems)
    with pytest.raises(SnapshotError, match=r"media/grid\.u32: bytes 0\.\.\d+ \(block 0\) do not match"):
        VlmStore(store_dir).grid.sum()
    _forge(store_dir, "media/grid.u32", grid.tobytes())
    problems = formats.verify(store_dir).problems
    assert problems[0] == f"{store_dir}: media/image_tokens.u32 is not the sum of each sample's image grids"
    assert len(problems) == 2 and "not one run per image as long as its grid says" in problems[1]


@pytest.mark.parametrize("rel", ["tokens/shards/000002.mask", "media/sha256.bin", "media/media_end.u32"])
@pytest.mark.parametrize("change", ["truncate", "remove"])
def test_a_truncated_or_missing_file_fails_verify_and_the_reader_refuses_to_open(
    store_dir: Path, rel: str, change: str
) -> None:
    path = store_dir / rel
    if change == "remove":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:-1])
    report = formats.verify(store_dir)
    assert not report.ok and any(path.name in p for p in report.problems)
    with pytest.raises(SnapshotError, match=path.name):
        VlmStore(store_dir)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("version", 1, "VLM store version 1 is not supported"),
    ("version", 2, "VLM store version 2 is not supported"),
    ("version", 4, "VLM store version 4 is not supported"),
    ("format", "puzzletron-token-store", "not a VLM store"),
])  # fmt: skip
def test_the_reader_refuses_another_version_or_format(
    store_dir: Path, key: str, value: object, message: str
) -> None:
    manifest = json.loads((store_dir / "manifest.json").read_text())
    manifest[key] = value
    (store_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SnapshotError, match=message):
        VlmStore(store_dir)
    assert not formats.verify(store_dir).ok


def test_a_foreign_token_store_under_tokens_is_refused(store_dir: Path, vlm_stores: dict[str, Path]) -> None:
    shutil.rmtree(store_dir / "tokens")
    shutil.copytree(vlm_stores["qwen3_vl"] / "tokens", store_dir / "tokens")
    with pytest.raises(SnapshotError, match="tokens"):
        VlmStore(store_dir)
    assert not formats.verify(store_dir).ok

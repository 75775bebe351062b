"""Building VLM stores: every sample's ids, assistant mask and grids equal the processor's own output on it
(Qwen2.5-VL and Qwen3-VL fixture processors), planted bad rows are skipped with their reason, the store is
reused without loading the processor, a changed pixel limit or chat template is another store, and
``num_proc`` and gloo world sizes 1 and 2 write the same bytes."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp_mp

from _files import tree_digest
from _vlm_data import PLANTED
from _vlm_fixtures import VLM_ROWS, VLM_ROWS_PER_SHARD
from _vlm_reference import LOADERS, processor_output, sample_of
from puzzletron.dataset import formats
from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.formats.subset import SubsetReader
from puzzletron.dataset.formats.vlm_store import VlmStore
from puzzletron.dataset.tokenize import build_vlm_store, short_hash, vlm_store_identity
from puzzletron.dataset.tokenize import vlm_store as build_module

FORK = multiprocessing.get_context("fork")


@pytest.fixture(autouse=True)
def _serial_tokenizers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_every_sample_equals_the_processor_output_on_it_alone(
    kind: str, vlm_stores: dict[str, Path], vlm_subset: Path, processor_dirs: dict[str, Path]
) -> None:
    store = VlmStore(vlm_stores[kind])
    processor = LOADERS[kind](processor_dirs[kind])
    reader = SubsetReader(vlm_subset)
    names = store.sample_ids(np.arange(len(store)))
    assert len(store) + store.skipped == VLM_ROWS and store.num_images > 30
    for i, name in enumerate(names):
        want = processor_output(processor, sample_of(reader, name))
        ids, mask = store.read(store.offsets[[i]], store.offsets[[i + 1]])
        assert torch.equal(torch.from_numpy(ids), want["input_ids"]), name
        assert torch.equal(torch.from_numpy(mask), want["assistant_mask"]), name
        a, b = store.image_offsets[i], store.image_offsets[i + 1]
        grid = torch.from_numpy(store.grid[a:b].astype(np.int64))
        assert torch.equal(grid, want.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))), name
        image = want["mm_token_type_ids"] == 1
        assert int(store.image_tokens[i]) == int(image.sum())
        last = int(torch.nonzero(image).max()) + 1 if image.any() else 0
        assert int(store.media_end[i]) == last
    # the subset manifest's SHA-256 of each image file, and its path inside the subset
    manifest = json.loads((vlm_subset / "manifest.json").read_text())
    recorded = [(r["path"], r["sha256"]) for r in manifest["images"] if f"{r['sample_index']}:" in names[0]]
    assert store.image_refs(np.arange(store.image_offsets[0], store.image_offsets[1])) == recorded
    assert store.manifest["processor"]["patch_size"] == (14 if kind == "qwen2_5_vl" else 16)


def test_planted_rows_are_skipped_with_their_reason(vlm_stores: dict[str, Path]) -> None:
    store = VlmStore(vlm_stores["qwen2_5_vl"])
    skipped = dict(zip(store.skipped_ids(), store.skipped_reasons(), strict=True))
    assert skipped == {f"{i}:row{i}": reason for i, reason in PLANTED.items()}
    reasons = store.manifest["counts"]["skipped_reasons"]
    assert reasons == {"image_aspect_ratio": 1, "image_placeholder_in_text": 1, "no_supervised_label": 0}


def test_a_store_is_reused_without_loading_the_processor(
    vlm_subset: Path, processor_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    path = build_vlm_store(vlm_subset, processor=processor_dirs["qwen3_vl"], cache_dir=cache)
    identity = vlm_store_identity(vlm_subset, processor=processor_dirs["qwen3_vl"], rows_per_shard=8192)
    assert path == cache / short_hash(identity)

    def never(*args, **kwargs):
        raise AssertionError("a reused store must not load the processor or tokenise")

    monkeypatch.setattr(build_module, "vlm_processor", never)
    monkeypatch.setattr(build_module, "tokenize_batch", never)
    assert build_vlm_store(vlm_subset, processor=processor_dirs["qwen3_vl"], cache_dir=cache) == path
    assert sorted(p.name for p in cache.iterdir()) == [path.name]


def _edited(source: Path, out: Path, name: str, edit) -> Path:
    shutil.copytree(source, out)
    (out / name).write_text(edit((out / name).read_text()))
    return out


def test_a_changed_pixel_limit_or_chat_template_builds_another_store(
    vlm_subset: Path, processor_dirs: dict[str, Path], vlm_stores: dict[str, Path], tmp_path: Path
) -> None:
    base = processor_dirs["qwen2_5_vl"]

    def smaller(text: str) -> str:
        config = json.loads(text)
        config["max_pixels"] = 112 * 112
        return json.dumps(config)

    pixels = _edited(base, tmp_path / "pixels", "preprocessor_config.json", smaller)
    template = _edited(base, tmp_path / "template", "chat_template.jinja", lambda t: t.replace("\n", "\n\n"))
    cache = tmp_path / "cache"
    paths = {name: build_vlm_store(vlm_subset, processor=p, cache_dir=cache) for name, p in (
        ("base", base), ("pixels", pixels), ("template", template),
    )}  # fmt: skip
    assert len({p.name for p in paths.values()}) == 3
    original, shrunk = VlmStore(paths["base"]), VlmStore(paths["pixels"])
    assert shrunk.manifest["processor"]["max_pixels"] == 112 * 112
    assert int(shrunk.grid.astype(np.int64).prod(axis=1).max()) <= (112 // 14) ** 2
    assert shrunk.num_tokens < original.num_tokens
    assert VlmStore(paths["template"]).num_tokens > original.num_tokens  # "\n\n": more tokens
    # the fixture store (other rows_per_shard) and this one hold the same samples and tokens
    assert VlmStore(vlm_stores["qwen2_5_vl"]).num_tokens == original.num_tokens


def test_unsupported_processors_and_bad_options_are_config_errors(
    vlm_subset: Path, processor_dirs: dict[str, Path], tokenizer_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=r"no preprocessor_config\.json"):
        build_vlm_store(vlm_subset, processor=tokenizer_dir, output=tmp_path / "a")
    other = shutil.copytree(processor_dirs["qwen2_5_vl"], tmp_path / "clip")
    config = json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(
        json.dumps({**config, "image_processor_type": "CLIPImageProcessor", "crop_size": 56})
    )
    with pytest.raises(ConfigError, match=r"not supported: .*Qwen2-VL-family image processor.*got CLIPImage"):
        build_vlm_store(vlm_subset, processor=other, output=tmp_path / "b")
    with pytest.raises(ConfigError, match="exactly one of output"):
        build_vlm_store(vlm_subset, processor=other)
    with pytest.raises(SnapshotError, match=r"missing/manifest\.json: the manifest is missing"):
        build_vlm_store(tmp_path / "missing", processor=processor_dirs["qwen2_5_vl"], output=tmp_path / "c")


def test_num_proc_2_writes_the_same_bytes(
    vlm_subset: Path, processor_dirs: dict[str, Path], vlm_stores: dict[str, Path], tmp_path: Path
) -> None:
    out = build_vlm_store(
        vlm_subset, processor=processor_dirs["qwen2_5_vl"], output=tmp_path / "s",
        rows_per_shard=VLM_ROWS_PER_SHARD, num_proc=2, batch_size=5,
    )  # fmt: skip
    assert tree_digest(out) == tree_digest(vlm_stores["qwen2_5_vl"])
    assert formats.verify(out).ok
    assert sorted(p.name for p in out.parent.iterdir()) == ["s"]


# ---------------------------------------------------------------------------------- gloo process groups


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, subset: Path, processor: Path, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        path = build_vlm_store(subset, processor=processor, output=out, rows_per_shard=VLM_ROWS_PER_SHARD)
        digest = hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
    finally:
        dist.destroy_process_group()
    (out.parent / f"rank{rank}.json").write_text(json.dumps({"manifest": digest}))


@pytest.mark.slow
def test_gloo_worlds_1_and_2_write_the_same_bytes(
    vlm_subset: Path, processor_dirs: dict[str, Path], vlm_stores: dict[str, Path], tmp_path: Path
) -> None:
    for world in (1, 2):
        out = tmp_path / f"world{world}" / "store"
        out.parent.mkdir()
        args = (world, _free_port(), vlm_subset, processor_dirs["qwen2_5_vl"], out)
        tmp_mp.start_processes(_rank_main, args=args, nprocs=world, join=True, start_method="fork")
        digests = {json.loads((out.parent / f"rank{r}.json").read_text())["manifest"] for r in range(world)}
        assert digests == {
            hashlib.sha256((vlm_stores["qwen2_5_vl"] / "manifest.json").read_bytes()).hexdigest()
        }
        assert tree_digest(out) == tree_digest(vlm_stores["qwen2_5_vl"])


def test_a_subset_manifest_edited_between_two_builds_in_one_process_is_read_again(
    vlm_subset: Path, processor_dirs: dict[str, Path], tmp_path: Path
) -> None:
    subset = Path(shutil.copytree(vlm_subset, tmp_path / "subset"))
    first = VlmStore(build_vlm_store(subset, processor=processor_dirs["qwen3_vl"], cache_dir=tmp_path / "c"))
    manifest = json.loads((subset / "manifest.json").read_text())
    record = manifest["images"][0]
    record["width"], record["height"] = 2 * record["width"], 2 * record["height"]  # the same path
    (subset / "manifest.json").write_text(json.dumps(manifest))
    second = VlmStore(build_vlm_store(subset, processor=processor_dirs["qwen3_vl"], cache_dir=tmp_path / "c"))
    assert second.path != first.path
    assert second.grid[0].tolist() != first.grid[0].tolist()  # from the edited manifest, not a cached table

"""Where `build_vlm_batches` gets its samples and images: a subset (its VLM store built once in a cache
directory, then reused without the processor being loaded), or a store folder (planned with no processor;
batches need the processor and the subset it was built from), and the clear errors of everything else: a
text spec, another processor, another subset, a changed image file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.pipelines.vlm import build_vlm_batches
from puzzletron.dataset.tokenize import vlm_store as build_module

SPEC = PuzzletronDataSpec.from_mapping(
    {
        "modality": "multimodal",
        "layout": "packed_varlen",
        "max_sample_length": 512,
        "packing": {"pack_size": 512},
    }
)


def test_a_subset_is_tokenised_once_into_the_cache_and_reused_without_the_processor(
    vlm_subset: Path, processor_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    first = build_vlm_batches(
        vlm_subset, processor=processor_dirs["qwen3_vl"], spec=SPEC, batch_size=2, cache_dir=cache
    )
    fingerprints = [b.fingerprint for b in first]
    (store,) = [p for p in cache.iterdir() if not p.name.startswith(".")]  # and the hidden plan cache

    def never(*args, **kwargs):
        raise AssertionError("a reused store must not be tokenised again")

    monkeypatch.setattr(build_module, "tokenize_batch", never)
    again = build_vlm_batches(
        vlm_subset, processor=processor_dirs["qwen3_vl"], spec=SPEC, batch_size=2, cache_dir=cache
    )
    assert again.store.path == store and [b.fingerprint for b in again] == fingerprints


def test_a_store_is_planned_without_a_processor_and_built_with_one(
    vlm_stores: dict[str, Path], vlm_subset: Path, processor_dirs: dict[str, Path]
) -> None:
    planned = build_vlm_batches(vlm_stores["qwen2_5_vl"], processor=None, spec=SPEC, batch_size=2)
    assert planned.plan.num_samples == 38 and len(planned) > 0
    with pytest.raises(ConfigError, match="pass processor= and subset= to build_vlm_batches"):
        next(iter(planned))
    full = build_vlm_batches(
        vlm_stores["qwen2_5_vl"],
        processor=processor_dirs["qwen2_5_vl"],
        subset=vlm_subset,
        spec=SPEC,
        batch_size=2,
    )
    assert full.plan.sample_order.tolist() == planned.plan.sample_order.tolist()
    assert next(iter(full)).model_kwargs["pixel_values"].shape[0] > 0


def test_a_text_spec_or_a_foreign_source_is_a_config_error(
    vlm_stores: dict[str, Path], processor_dirs: dict[str, Path], vlm_subset: Path, snapshot: Path
) -> None:
    text = PuzzletronDataSpec.from_mapping({"modality": "text", "layout": "fixed", "max_sample_length": 64})
    with pytest.raises(ConfigError, match=r"builds multimodal batches; data\.modality is text"):
        build_vlm_batches(vlm_stores["qwen2_5_vl"], processor=None, spec=text, batch_size=1)
    with pytest.raises(ConfigError, match="is a puzzletron-text-snapshot: build_batches reads it"):
        build_vlm_batches(snapshot, processor=None, spec=SPEC, batch_size=1)
    with pytest.raises(ConfigError, match=r"is a subset: give processor= \(its VLM store is built once"):
        build_vlm_batches(vlm_subset, processor=None, spec=SPEC, batch_size=1)
    with pytest.raises(ConfigError, match=r"pixel_dtype must be a floating torch\.dtype"):
        build_vlm_batches(vlm_subset, processor=None, spec=SPEC, batch_size=1, pixel_dtype="bf16")


def test_another_processor_or_subset_is_refused(
    vlm_stores: dict[str, Path], processor_dirs: dict[str, Path], vlm_subset: Path, tmp_path: Path
) -> None:
    with pytest.raises(
        ConfigError, match=r"does not match the VLM store .*patch_size: store 14 vs processor 16"
    ):
        build_vlm_batches(
            vlm_stores["qwen2_5_vl"],
            processor=processor_dirs["qwen3_vl"],
            subset=vlm_subset,
            spec=SPEC,
            batch_size=1,
        )
    other = shutil.copytree(vlm_subset, tmp_path / "other")
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["acquisition"] = {"edited": True}
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SnapshotError, match=r"is not the subset the VLM store \S+ was built from"):
        build_vlm_batches(
            vlm_stores["qwen2_5_vl"],
            processor=processor_dirs["qwen2_5_vl"],
            subset=other,
            spec=SPEC,
            batch_size=1,
        )


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"image_mean": [0.5, 0.5, 0.5]}, "pixels.image_mean: store [0.48145466, 0.4578275, 0.40821073] vs "),
        ({"image_std": [0.25, 0.25, 0.25]}, "pixels.image_std: store [0.26862954, "),
        ({"rescale_factor": 1 / 127.5}, "pixels.rescale_factor: store 0.00392156862745098 vs "),
        ({"do_normalize": False}, "pixels.do_normalize: store True vs processor False"),
        ({"resample": 2}, "pixels.resample: store 3 vs processor 2"),
    ],
)
def test_a_processor_whose_pixels_differ_from_the_stores_is_refused(
    vlm_stores: dict[str, Path], processor_dirs: dict[str, Path], vlm_subset: Path, tmp_path: Path,
    config: dict, says: str,
) -> None:  # fmt: skip
    other = Path(shutil.copytree(processor_dirs["qwen2_5_vl"], tmp_path / "proc"))
    path = other / "preprocessor_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | config))
    with pytest.raises(ConfigError, match=r"does not match the VLM store ") as exc:
        build_vlm_batches(
            vlm_stores["qwen2_5_vl"], processor=other, subset=vlm_subset, spec=SPEC, batch_size=1
        )
    assert says in str(exc.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # computed here; by the image processor
def test_a_subset_manifest_that_lies_about_an_images_size_is_refused_at_batch_time(
    processor_dirs: dict[str, Path], vlm_subset: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    liar = Path(shutil.copytree(vlm_subset, tmp_path / "subset"))
    manifest = json.loads((liar / "manifest.json").read_text())
    record = manifest["images"][0]
    record["width"], record["height"] = (
        10 * record["width"],
        10 * record["height"],
    )  # file, SHA-256 as they were
    (liar / "manifest.json").write_text(json.dumps(manifest))
    batches = build_vlm_batches(
        liar, processor=processor_dirs["qwen2_5_vl"], spec=SPEC, batch_size=64, cache_dir=tmp_path / "c",
        shuffle=False, pixel_dtype=dtype,
    )  # fmt: skip
    with pytest.raises(SnapshotError, match=r"of the VLM store \S+ is \d+x\d+, whose grid is not the stored"):
        list(batches)


def test_a_changed_image_file_is_refused_at_batch_time(
    vlm_stores: dict[str, Path], processor_dirs: dict[str, Path], vlm_subset: Path, tmp_path: Path
) -> None:
    copy = shutil.copytree(vlm_subset, tmp_path / "subset")
    batches = build_vlm_batches(
        vlm_stores["qwen2_5_vl"],
        processor=processor_dirs["qwen2_5_vl"],
        subset=copy,
        spec=SPEC,
        batch_size=8,
        shuffle=False,
    )
    rel, _ = batches.store.image_refs([0])[0]
    data = bytearray((copy / rel).read_bytes())
    data[-1] ^= 1  # the same size: only its SHA-256 tells
    (copy / rel).write_bytes(bytes(data))
    with pytest.raises(
        SnapshotError, match=rf"image '{rel}' .*SHA-256 differs from the one the store recorded"
    ):
        list(batches)


def test_a_packed_plan_is_planned_once_into_the_plan_cache_and_mapped_after(
    vlm_stores: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from puzzletron.dataset.packing import plan_cache, plan_vlm

    spec = PuzzletronDataSpec.from_mapping(
        {"modality": "multimodal", "layout": "packed_varlen", "max_sample_length": 96,
         "packing": {"pack_size": 96, "long_samples": "truncate"}}
    )  # fmt: skip
    store = vlm_stores["qwen3_vl"]
    first = build_vlm_batches(store, processor=None, spec=spec, batch_size=1, plan_cache=tmp_path / "plans")

    def never(*args, **kwargs):
        raise AssertionError("a cached plan must not be planned again")

    monkeypatch.setattr(plan_cache, "plan_packing", never)
    again = build_vlm_batches(store, processor=None, spec=spec, batch_size=1, plan_cache=tmp_path / "plans")
    alone = plan_vlm(first.store.lengths, first.store.media_end, spec)
    for plan in (first.plan, again.plan):
        assert type(plan).__name__ == "MappedPlan" and plan.cut_samples == alone.cut_samples > 0
        assert plan.rows == alone.rows and list(plan.dropped) == list(alone.dropped)
        assert np.array_equal(plan.units.length, alone.units.length)


def test_a_spec_may_be_a_data_mapping_and_anything_else_is_refused(vlm_stores: dict[str, Path]) -> None:
    raw = {"modality": "multimodal", "layout": "packed_varlen", "max_sample_length": 512}
    raw["packing"] = {"pack_size": 512}
    planned = build_vlm_batches(vlm_stores["qwen2_5_vl"], processor=None, spec=raw, batch_size=2)
    same = build_vlm_batches(vlm_stores["qwen2_5_vl"], processor=None, spec=SPEC, batch_size=2)
    assert planned.plan.sample_order.tolist() == same.plan.sample_order.tolist()
    with pytest.raises(ConfigError, match=r"build_vlm_batches: spec must be a PuzzletronDataSpec or a data"):
        build_vlm_batches(vlm_stores["qwen2_5_vl"], processor=None, spec="packed_varlen", batch_size=2)


def test_a_subset_without_cache_dir_goes_to_the_per_user_cache_and_says_where(
    vlm_subset: Path,
    processor_dirs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: refused ("give processor= and cache_dir="), although cache_dir=None is the default."""
    monkeypatch.setenv("PUZZLETRON_CACHE_DIR", str(tmp_path / "per-user"))
    with caplog.at_level("INFO"):
        batches = build_vlm_batches(vlm_subset, processor=processor_dirs["qwen3_vl"], spec=SPEC, batch_size=2)
    assert batches.store.path.parent == tmp_path / "per-user"
    assert any(str(tmp_path / "per-user") in r.getMessage() and "PUZZLETRON_CACHE_DIR" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert next(iter(batches)).model_kwargs["pixel_values"].shape[0] > 0


def test_a_store_reads_the_subset_it_was_built_from_unless_it_moved(
    vlm_subset: Path, processor_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The store records where its subset was (a hint checked by the subset manifest's SHA-256): no
    subset= needed while it is there; once it moved, subset= names the new place."""
    from puzzletron.dataset.tokenize import build_vlm_store

    subset = tmp_path / "subset"
    shutil.copytree(vlm_subset, subset)
    store = build_vlm_store(subset, processor=processor_dirs["qwen2_5_vl"], output=tmp_path / "store")
    assert json.loads((store / "manifest.json").read_text())["subset_path"] == str(subset)
    processor = processor_dirs["qwen2_5_vl"]
    batches = build_vlm_batches(store, processor=processor, spec=SPEC, batch_size=2)
    first = next(iter(batches))
    assert first.model_kwargs["pixel_values"].shape[0] > 0
    subset.rename(tmp_path / "moved")
    stranded = build_vlm_batches(store, processor=processor, spec=SPEC, batch_size=2)
    with pytest.raises(ConfigError, match="pass processor= and subset= to build_vlm_batches"):
        next(iter(stranded))
    moved = build_vlm_batches(store, processor=processor, spec=SPEC, batch_size=2, subset=tmp_path / "moved")
    assert next(iter(moved)).fingerprint == first.fingerprint
    shutil.copytree(tmp_path / "moved", subset)  # another subset where it was: not taken
    (subset / "manifest.json").write_text((subset / "manifest.json").read_text().replace("\n", "\n "))
    with pytest.raises(ConfigError, match="pass processor= and subset="):
        next(iter(build_vlm_batches(store, processor=processor, spec=SPEC, batch_size=2)))

"""The factory's length hints for AutoModel's neat VLM packing: items of a subset carry ``mm_inputs_meta``
(every image's ``[height, width]``, from the subset's manifest) and, given the subset's VLM store (or a
processor and a cache directory to build it), exact ``_text_tokens``; AutoModel 0.7.0's own
``_estimate_sample_length`` then gives every sample's true length (the processor's token count), and the
image part is exact from the sizes alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from nemo_automodel.components.datasets.vlm.neat_packing_vlm import _estimate_sample_length
from nemo_automodel.components.datasets.vlm.samplers import LengthGroupedSampler

from _vlm_data import image_sizes
from _vlm_reference import LOADERS, processor_output, sample_of
from puzzletron.dataset import load_materialized_conversation_dataset
from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.formats.subset import SubsetReader


def _row(item: dict) -> int:
    return int(item["source"]["row_id"].removeprefix("row"))


def test_items_carry_the_image_sizes_height_first(vlm_subset: Path) -> None:
    dataset = load_materialized_conversation_dataset(vlm_subset)
    for i in range(len(dataset)):
        item = dataset[i]
        assert item["mm_inputs_meta"] == {"images_meta": [[h, w] for w, h in image_sizes(item)]}
        assert "_text_tokens" not in item


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_with_the_store_automodel_estimates_every_true_length(
    kind: str, vlm_subset: Path, vlm_stores: dict[str, Path], processor_dirs: dict[str, Path]
) -> None:
    processor = LOADERS[kind](processor_dirs[kind])
    image_cfg = LengthGroupedSampler._extract_image_config(processor)
    reader = SubsetReader(vlm_subset)
    sized = load_materialized_conversation_dataset(vlm_subset)
    exact = load_materialized_conversation_dataset(vlm_subset, vlm_store=vlm_stores[kind])
    checked = 0
    for i in range(len(exact)):
        item = exact[i]
        if "_text_tokens" not in item:  # a row the store skipped (a planted bad row)
            continue
        want = processor_output(processor, sample_of(reader, f"{_row(item)}:row{_row(item)}"))
        length, media = _estimate_sample_length(item, image_cfg, None, return_media_tokens=True)
        assert (length, media) == (want["input_ids"].numel(), int(want["mm_token_type_ids"].sum()))
        assert _estimate_sample_length(sized[i], image_cfg, None, return_media_tokens=True)[1] == media
        checked += 1
    assert checked == 38


def test_a_processor_and_cache_dir_build_the_store_for_the_hints(
    vlm_subset: Path, vlm_stores: dict[str, Path], processor_dirs: dict[str, Path], tmp_path: Path
) -> None:
    built = load_materialized_conversation_dataset(
        vlm_subset, processor_path=processor_dirs["qwen3_vl"], cache_dir=tmp_path / "stores", num_samples=10
    )
    given = load_materialized_conversation_dataset(
        vlm_subset, vlm_store=vlm_stores["qwen3_vl"], num_samples=10
    )
    assert [built[i].get("_text_tokens") for i in range(10)] == [
        given[i].get("_text_tokens") for i in range(10)
    ]
    assert len(list((tmp_path / "stores").iterdir())) == 1


def test_a_processor_without_cache_dir_builds_in_the_per_user_cache(
    vlm_subset: Path, processor_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: refused ("processor_path and cache_dir go together")."""
    monkeypatch.setenv("PUZZLETRON_CACHE_DIR", str(tmp_path / "per-user"))
    dataset = load_materialized_conversation_dataset(
        vlm_subset, processor_path=processor_dirs["qwen3_vl"], num_samples=4
    )
    assert dataset[0]["_text_tokens"] > 0 and len(list((tmp_path / "per-user").iterdir())) == 1


def test_hint_options_are_checked(
    vlm_subset: Path, vlm_stores: dict[str, Path], processor_dirs, tmp_path
) -> None:
    with pytest.raises(ConfigError, match="cache_dir goes with processor_path"):
        load_materialized_conversation_dataset(vlm_subset, cache_dir=tmp_path / "stores")
    with pytest.raises(ConfigError, match="need a subset directory"):
        load_materialized_conversation_dataset([{"conversation": []}], vlm_store=vlm_stores["qwen3_vl"])
    from _vlm_data import make_subset

    other = make_subset(tmp_path / "other", 6, seed=9)
    with pytest.raises(SnapshotError, match="is not the VLM store of the subset"):
        load_materialized_conversation_dataset(other, vlm_store=vlm_stores["qwen3_vl"])

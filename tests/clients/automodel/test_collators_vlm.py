"""`batch_from_automodel` on the outputs of the real NeMo AutoModel 0.7 VLM collators: the default and
Qwen2.5 collate functions, the pre-tokenized pad collate, neat packing with mRoPE positions and THD packing,
images from a local Qwen2.5-VL processor, and AutoModel's own YAML loader building its VLM dataloader on our
factory. Image counts are the subset's declared ones; the checks (``_collator_checks``) compare with the
collators' own maps and follow every batch, images included, through `dp_slice`, `pp_microbatches` and
`cp_partition`. `nemo_automodel` is a test dependency (the `automodel` extra)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from nemo_automodel.components.datasets.vlm.collate_fns import (
    default_collate_fn,
    neat_packed_vlm_collater,
    packed_sequence_thd_vlm_collater,
    pad_collate_fn,
    qwen2_5_collate_fn,
)
from nemo_automodel.components.datasets.vlm.datasets import PreTokenizedDatasetWrapper
from nemo_automodel.components.datasets.vlm.neat_packing_vlm import neat_pack_dataset_vlm
from PIL import Image

from _collator_checks import (
    MASK_TYPES,
    PACKED,
    Contract,
    check_cp_partition,
    check_labels,
    check_media,
    check_packed_against_doc_ids,
    check_row_splits,
    convert,
    image_ranges,
    thd_doc_ids,
)
from puzzletron.dataset import (
    load_materialized_conversation_dataset,
    materialize_normalized_conversation_samples,
)
from puzzletron.fixtures.tokenizer import build_qwen2_5_vl_processor, load_qwen2_5_vl_processor

IMAGE_COUNTS = (1, 2, 0, 1, 1, 2, 0, 1)  # declared per conversation of the VLM subset


def _vlm_sample(i: int) -> dict[str, Any]:
    images = [
        {"type": "image", "image": Image.new("RGB", (56 + 28 * (i % 2), 56 + 28 * j), (i * 30, j * 80, 90))}
        for j in range(IMAGE_COUNTS[i])
    ]
    return {
        "conversation": [
            {"role": "user", "content": [*images, {"type": "text", "text": f"Describe picture {i}."}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"The total is {i * 7}."}]},
        ],
        "image_count": IMAGE_COUNTS[i],
        "source": {"dataset": "fixture/vlm", "revision": "r1", "row_id": str(i)},
    }


@pytest.fixture(scope="module")
def processor(workdir: Path) -> Any:
    return load_qwen2_5_vl_processor(build_qwen2_5_vl_processor(workdir / "processor"))


@pytest.fixture(scope="module")
def vlm_dataset(workdir: Path, processor: Any) -> Any:
    """The factory over 8 conversations, with exact length hints (the subset's VLM store under the
    processor): AutoModel's neat packing then knows every sample's true length."""
    materialize_normalized_conversation_samples((_vlm_sample(i) for i in range(8)), workdir / "vlm")
    return load_materialized_conversation_dataset(
        workdir / "vlm", num_samples=8, processor_path=workdir / "processor", cache_dir=workdir / "stores"
    )


@pytest.mark.parametrize("collate", [default_collate_fn, qwen2_5_collate_fn], ids=["default", "qwen2_5"])
def test_vlm_collators(vlm_dataset: Any, processor: Any, collate: Any) -> None:
    examples = [vlm_dataset[i] for i in range(4)]
    counts = [e["image_count"] for e in examples]
    assert counts == list(IMAGE_COUNTS[:4])
    collated = collate(examples, processor)
    labels = collated["labels"]
    batch = convert(dict(collated), "padded_varlen")
    check_media(batch, counts)
    assert batch.labels is labels
    assert int(batch.hidden_mask.sum()) == int(collated["attention_mask"].sum())
    # Every image token row belongs to a row that declared images, as many merged tokens as patches / 4.
    image_tokens = (batch.input_ids == processor.image_token_id).sum(dim=1)
    per_image = (batch.model_kwargs["image_grid_thw"].prod(dim=1) // 4).tolist()
    starts, _ = image_ranges(counts, batch.model_kwargs["image_grid_thw"])
    assert image_tokens.tolist() == [sum(per_image[starts[r] : starts[r + 1]]) for r in range(4)]
    doc_ids = collated["attention_mask"].long()
    check_labels(batch, labels, doc_ids)
    check_row_splits(batch, collated, doc_ids, counts)
    check_cp_partition(batch, collated, doc_ids)


def test_vlm_pretokenized_pad_collate(vlm_dataset: Any, processor: Any) -> None:
    wrapped = PreTokenizedDatasetWrapper(vlm_dataset, processor, inject_fake_images=False)
    examples = [wrapped[i] for i in range(4, 8)]
    collated = pad_collate_fn(examples, processor)
    counts = list(IMAGE_COUNTS[4:8])
    batch = convert(dict(collated), "padded_varlen")
    check_media(batch, counts)
    assert torch.equal(batch.labels, collated["labels"])
    # pad_collate_fn pads to the longest sample, then drops the last column for the shift.
    longest = max(e["input_ids"].shape[0] for e in examples)
    expected = sum(min(int(e["attention_mask"].sum()), longest - 1) for e in examples)
    assert int(batch.hidden_mask.sum()) == expected
    doc_ids = collated["attention_mask"].long()
    check_labels(batch, collated["labels"], doc_ids)
    check_row_splits(batch, collated, doc_ids, counts)
    check_cp_partition(batch, collated, doc_ids)


@pytest.fixture(scope="module")
def vlm_packs(vlm_dataset: Any, processor: Any) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    tokens = processor.tokenizer
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": len(tokens),
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 16,
            "fullatt_block_indexes": [0],
        },
        image_token_id=processor.image_token_id,
        video_token_id=processor.video_token_id,
        vision_start_token_id=tokens.convert_tokens_to_ids("<|vision_start|>"),
    )
    model = Qwen2_5_VLModel(config)
    wrapped = PreTokenizedDatasetWrapper(vlm_dataset, processor, inject_fake_images=False)
    packs = neat_pack_dataset_vlm(
        wrapped, pack_size=128, get_rope_index=model.get_rope_index, ds_raw=vlm_dataset, processor=processor
    )
    return packs, [packs[i] for i in range(len(packs))]


@pytest.mark.parametrize("metadata", [False, True])
@pytest.mark.parametrize("mask_type", MASK_TYPES)
def test_vlm_neat_packing_with_mrope(
    vlm_packs: Any, vlm_dataset: Any, mask_type: str, metadata: bool
) -> None:
    packs, items = vlm_packs
    collated = neat_packed_vlm_collater(copy.deepcopy(items), packing=Contract(mask_type, metadata))
    rows = collated["input_ids"].shape[0]
    assert tuple(collated["position_ids"].shape) == (3, rows, collated["input_ids"].shape[1])
    # Images per pack from the knapsack's bins and the subset's declared counts.
    counts = [sum(vlm_dataset[i]["image_count"] for i in bin_) for bin_ in packs.bins]
    assert (
        max(len(bin_) for bin_ in packs.bins) >= 2 and max(counts) >= 2
    )  # multi-document, multi-image packs
    doc_ids = collated["_packed_seq_ids"]
    labels = collated["labels"].clone()
    batch = convert(dict(collated), PACKED)
    check_media(batch, counts)
    check_packed_against_doc_ids(batch, doc_ids)
    assert batch.model_kwargs["position_ids"] is collated["position_ids"]
    # Every sample of the subset is in exactly one pack (lengths after the collator's shift).
    assert len(batch.sequence.sample_offsets) == sum(len(bin_) for bin_ in packs.bins) == len(vlm_dataset)
    check_labels(batch, labels, doc_ids)
    check_row_splits(batch, collated, doc_ids, counts)
    check_cp_partition(batch, collated, doc_ids)


def test_vlm_thd_packing(vlm_packs: Any, vlm_dataset: Any) -> None:
    packs, items = vlm_packs
    collated = packed_sequence_thd_vlm_collater(copy.deepcopy(items))
    assert collated["qkv_format"] == "thd"
    seq_lens = collated["seq_lens"]
    counts = [sum(vlm_dataset[i]["image_count"] for i in bin_) for bin_ in packs.bins]
    batch = convert(dict(collated), PACKED)
    check_media(batch, counts)
    assert batch.sequence.global_cu_seqlens.diff().tolist() == seq_lens[seq_lens >= 0].tolist()
    assert int(batch.hidden_mask.sum()) == int(seq_lens.clamp(min=0).sum())
    assert torch.equal(batch.labels, collated["labels"])
    assert batch.model_kwargs["position_ids"].dim() == 3
    doc_ids = thd_doc_ids(seq_lens, collated["seq_lens_padded"], collated["input_ids"].shape[1])
    assert int(doc_ids.max()) >= 2  # packs really hold several documents
    check_packed_against_doc_ids(batch, doc_ids)
    check_labels(batch, collated["labels"], doc_ids)
    check_row_splits(batch, collated, doc_ids, counts)
    check_cp_partition(batch, collated, doc_ids)


# --- AutoModel's own YAML loader and VLM dataloader config ---------------------------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["collate", "neat-packed"])
def test_automodel_yaml_dataloader_instantiates_our_factory(
    workdir: Path, vlm_dataset: Any, packed: bool
) -> None:
    from nemo_automodel.components.config.loader import load_yaml_config
    from nemo_automodel.recipes._typed_config import RecipeConfig

    processor_dir = build_qwen2_5_vl_processor(workdir / "yaml-processor")
    config_path = workdir / f"vlm-{packed}.yaml"
    config_path.write_text(
        f"""
step_scheduler:
  local_batch_size: 2
dataset:
  _target_: puzzletron.dataset.load_materialized_conversation_dataset
  path_or_dataset: {workdir / "vlm"}
  num_samples: 8
  max_length: 512
  inject_fake_images: false
dataloader:
  _target_: torchdata.stateful_dataloader.StatefulDataLoader
  shuffle: false
processor:
  _target_: puzzletron.fixtures.tokenizer.load_qwen2_5_vl_processor
  directory: {processor_dir}
"""
        + ("packed_sequence:\n  pack_size: 256\n" if packed else "")
    )
    # The same calls FinetuneRecipeForVLM.setup makes (less the model, which only adds mRoPE positions).
    config = RecipeConfig(load_yaml_config(config_path))
    loader_config = config.vlm_dataloader
    assert loader_config.dataset_config.factory is load_materialized_conversation_dataset
    built = loader_config.build(
        pretrained_model_name_or_path=str(processor_dir),
        dp_rank=0,
        dp_world_size=1,
        batch_size=config.get("step_scheduler.local_batch_size", 1),
    )
    layout = PACKED if packed else "padded_varlen"
    collated_batches = [dict(collated) for collated in built.dataloader]
    batches = [convert(collated, layout) for collated in collated_batches]
    assert batches
    for collated, batch in zip(collated_batches, batches, strict=True):
        doc_ids = collated.get("_packed_seq_ids")
        if doc_ids is None:  # one document per row: the collator's 2-D mask, or the block mask's diagonal
            mask = collated["attention_mask"]
            doc_ids = (mask.diagonal(dim1=-2, dim2=-1)[:, 0] if mask.dim() == 4 else mask).long()
        assert torch.equal(batch.hidden_mask, doc_ids > 0)
        if packed:
            check_packed_against_doc_ids(batch, doc_ids)
    images = sum(int(b.sequence.media_counts.sum()) for b in batches)
    assert images == sum(IMAGE_COUNTS)  # no fake images were injected, none lost
    for batch in batches:
        assert batch.model_kwargs["image_grid_thw"].shape[0] == int(batch.sequence.media_counts.sum())
    if packed:
        documents = sum(len(b.sequence.sample_offsets) for b in batches)
        assert documents == len(vlm_dataset)
        assert documents > sum(b.batch_size for b in batches)  # some pack holds several documents
    else:
        assert [b.batch_size for b in batches] == [2, 2, 2, 2]
        order = [c for b in batches for c in b.sequence.media_counts.tolist()]
        assert order == list(IMAGE_COUNTS)

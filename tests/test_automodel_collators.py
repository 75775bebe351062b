"""`batch_from_automodel` on the outputs of the real NeMo AutoModel 0.7 collators.

Conversations come from a materialised subset through `load_materialized_conversation_dataset`; text is
tokenised by AutoModel's own `format_chat_template`, images by a local Qwen2.5-VL processor. Expected values
come from the collators' own maps (`_packed_seq_ids`, `seq_lens`, the packer's indexed masks,
`n_images_per_sample`), from AutoModel's own builders (`build_packed_sequence_metadata`,
`packed_seq_params_from_doc_ids`, `process_input_for_thd`) or from the subset's declared image counts, never
from the code under test. Every collator form also goes through `dp_slice`, `pp_microbatches` and a
load-balanced `cp_partition`, each part checked against the collator's map at its rows or tokens.

`nemo_automodel` is a test dependency (the `automodel` extra): if it is missing this module fails.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from nemo_automodel.components.datasets.llm.formatting_utils import format_chat_template
from nemo_automodel.components.datasets.llm.neat_packing import neat_pack_dataset
from nemo_automodel.components.datasets.llm.packed_sequence import pack_dataset
from nemo_automodel.components.datasets.packed_seq import packed_seq_params_from_doc_ids
from nemo_automodel.components.datasets.packing import get_seqlens_in_batch
from nemo_automodel.components.datasets.utils import (
    build_packed_sequence_metadata,
    default_collater,
    neat_packed_collater,
    packed_sequence_thd_collater,
)
from nemo_automodel.components.datasets.vlm.collate_fns import (
    default_collate_fn,
    neat_packed_vlm_collater,
    packed_sequence_thd_vlm_collater,
    pad_collate_fn,
    qwen2_5_collate_fn,
)
from nemo_automodel.components.datasets.vlm.datasets import PreTokenizedDatasetWrapper
from nemo_automodel.components.datasets.vlm.neat_packing_vlm import neat_pack_dataset_vlm
from nemo_automodel.components.distributed.thd_utils import process_input_for_thd
from PIL import Image
from transformers import AutoTokenizer

from puzzletron.dataset import (
    DataLayout,
    Modality,
    PuzzletronBatch,
    batch_from_automodel,
    load_materialized_conversation_dataset,
    materialize_normalized_conversation_samples,
)
from puzzletron.dataset.batch.cp import batch_cp_indices
from puzzletron.dataset.clients.automodel.adapter import forward_kwargs
from puzzletron.dataset.errors import BatchValidationError
from puzzletron.fixtures.tokenizer import (
    build_chat_tokenizer,
    build_qwen2_5_vl_processor,
    load_qwen2_5_vl_processor,
)

PACKED = DataLayout.PACKED_VARLEN
MASK_TYPES = ("block_causal", "document_ids", "flash_varlen")
FLASH_KWARGS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
# Row-aligned kwargs a row split must slice, never rebuild: [B, ...] tensors of the collator.
ROW_LOCAL_KWARGS = ("cu_seqlens", "packed_token_indices", "seq_lens", "seq_lens_padded")
IMAGE_COUNTS = (1, 2, 0, 1, 1, 2, 0, 1)  # declared per conversation of the VLM subset


class Contract:
    """AutoModel's structural `PackedSequenceContract` (a Protocol): which mask form the collator emits."""

    def __init__(self, packed_mask_type: str, requires_packed_sequence_metadata: bool) -> None:
        self.packed_mask_type = packed_mask_type
        self.requires_packed_sequence_metadata = requires_packed_sequence_metadata


def _text_sample(i: int) -> dict[str, Any]:
    question = "Question: " + "what is the total in the table? " * (1 + i % 5)
    return {
        "conversation": [
            {"role": "user", "content": [{"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"The total is {i * 37}."}]},
        ],
        "image_count": 0,
        "source": {"dataset": f"fixture/text-{i % 2}", "revision": "r1", "row_id": str(i)},
    }


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
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("automodel")


@pytest.fixture(scope="module")
def tokenizer(workdir: Path) -> Any:
    return AutoTokenizer.from_pretrained(build_chat_tokenizer(workdir / "tokenizer"))


@pytest.fixture(scope="module")
def processor(workdir: Path) -> Any:
    return load_qwen2_5_vl_processor(build_qwen2_5_vl_processor(workdir / "processor"))


@pytest.fixture(scope="module")
def text_samples(workdir: Path, tokenizer: Any) -> list[dict[str, Any]]:
    """AutoModel-tokenised samples (``input_ids``, shifted ``labels``, ``attention_mask``) from the subset."""
    materialize_normalized_conversation_samples((_text_sample(i) for i in range(10)), workdir / "text")
    dataset = load_materialized_conversation_dataset(workdir / "text", num_samples=10)
    assert len(dataset) == 10
    return [
        format_chat_template(
            tokenizer, dataset[i]["conversation"], tokenizer.eos_token_id, tokenizer.pad_token_id
        )
        for i in range(len(dataset))
    ]


@pytest.fixture(scope="module")
def vlm_dataset(workdir: Path) -> Any:
    materialize_normalized_conversation_samples((_vlm_sample(i) for i in range(8)), workdir / "vlm")
    return load_materialized_conversation_dataset(workdir / "vlm", num_samples=8)


def _lengths(samples: list[dict[str, Any]]) -> list[int]:
    return [len(s["input_ids"]) for s in samples]


def _convert(collated: dict[str, Any], layout: DataLayout | str) -> PuzzletronBatch:
    rows = collated["input_ids"].shape[0]
    return batch_from_automodel(
        collated, sample_ids=[f"row-{i}" for i in range(rows)], source_metadata={"test": True}, layout=layout
    )


def _check_packed_against_doc_ids(batch: PuzzletronBatch, doc_ids: torch.Tensor) -> None:
    """Boundaries, validity and lengths agree with a collator's 1-based per-row document map."""
    seq_ids = batch.sequence.seq_ids
    assert torch.equal(seq_ids >= 0, doc_ids > 0)
    assert torch.equal(batch.hidden_mask, doc_ids > 0)
    # A new sample starts exactly where the collator's document index changes inside a row.
    assert torch.equal(seq_ids[:, 1:] != seq_ids[:, :-1], doc_ids[:, 1:] != doc_ids[:, :-1])
    lengths = get_seqlens_in_batch(doc_ids)  # AutoModel's own per-document lengths, batch-major
    assert batch.sequence.global_cu_seqlens.diff().tolist() == lengths.tolist()
    assert batch.sequence.max_seqlen == int(lengths.max())


def _thd_doc_ids(seq_lens: torch.Tensor, seq_lens_padded: torch.Tensor, length: int) -> torch.Tensor:
    """The THD collator's own map, written out: document k fills ``seq_lens[k]`` tokens of its span."""
    rows = []
    for lens, spans in zip(seq_lens.tolist(), seq_lens_padded.tolist(), strict=True):
        row = []
        for k, (n, span) in enumerate(zip(lens, spans, strict=True)):
            if n >= 0:
                row += [k + 1] * n + [0] * (span - n)
        rows.append(row + [0] * (length - len(row)))
    return torch.tensor(rows)


def _check_labels(batch: PuzzletronBatch, labels_before: torch.Tensor, doc_ids: torch.Tensor) -> None:
    """Labels equal the collator's on every document token and are -100 on padding (never shifted)."""
    expected = labels_before.masked_fill(doc_ids == 0, -100)
    assert torch.equal(batch.labels, expected)
    assert torch.equal(batch.ce_mask, (expected != -100) & (doc_ids > 0))


def _split_sizes(batch_size: int) -> list[int]:
    """dp sizes a row split accepts: the smallest divisor > 1 of B, and B (one row per rank)."""
    assert batch_size >= 2, "a row split needs two rows: the test would pass vacuously"
    smallest = next(d for d in range(2, batch_size + 1) if batch_size % d == 0)
    return sorted({smallest, batch_size})


def _check_row_group(
    group: PuzzletronBatch,
    batch: PuzzletronBatch,
    collated: dict[str, Any],
    doc_ids: torch.Tensor,
    start: int,
) -> None:
    """Rows ``[start, start + group.batch_size)`` keep tokens, labels, documents and row-local kwargs."""
    dataclasses.replace(group)  # re-validates the derived batch
    stop = start + group.batch_size
    group_doc = doc_ids[start:stop]
    assert group.sample_ids == batch.sample_ids[start:stop]
    assert torch.equal(group.input_ids, batch.input_ids[start:stop])
    assert torch.equal(group.labels, batch.labels[start:stop])
    assert torch.equal(group.hidden_mask, group_doc > 0)
    for key in ROW_LOCAL_KWARGS:
        if isinstance(collated.get(key), torch.Tensor):
            assert torch.equal(group.model_kwargs[key], collated[key][start:stop]), key
    assert not FLASH_KWARGS & set(group.model_kwargs)  # stale flat offsets are dropped, never kept
    if group.layout is not PACKED:
        return
    if group_doc.any():
        _check_packed_against_doc_ids(group, group_doc)
        if isinstance(collated.get("max_seqlen"), int):
            assert group.model_kwargs["max_seqlen"] == build_packed_sequence_metadata(group_doc)["max_seqlen"]
    # forward_kwargs rebuilds what the collator would emit for these rows alone (AutoModel's own builder).
    flash = forward_kwargs(group, backend="flash")
    reference = packed_seq_params_from_doc_ids(group_doc)
    assert torch.equal(flash["cu_seq_lens_q"], reference.cu_seqlens)
    assert flash["max_length_q"] == reference.max_seqlen


def _check_row_splits(
    batch: PuzzletronBatch, collated: dict[str, Any], doc_ids: torch.Tensor, counts: list[int] | None = None
) -> None:
    """``dp_slice`` and ``pp_microbatches`` against the collator's own map (and images, when given)."""
    splits = [
        tuple(batch.dp_slice(dp_rank=r, dp_size=n) for r in range(n)) for n in _split_sizes(batch.batch_size)
    ]
    splits += [batch.pp_microbatches(2), batch.pp_microbatches(batch.batch_size)]
    for groups in splits:
        start = 0
        for group in groups:
            _check_row_group(group, batch, collated, doc_ids, start)
            start += group.batch_size
        assert start == batch.batch_size
        if counts is not None:
            _check_row_groups_keep_images(batch, groups, counts)


def _check_cp_partition(batch: PuzzletronBatch, collated: dict[str, Any], doc_ids: torch.Tensor) -> None:
    """Load-balanced ``cp_partition`` (2 ranks): each rank's documents = the collator's map at its tokens."""
    if isinstance(collated.get("attention_mask"), torch.Tensor) and collated["attention_mask"].dim() == 4:
        with pytest.raises(BatchValidationError, match="4-D"):  # refused, not split inexactly
            batch.cp_partition(torch.arange(0, batch.sequence_length, 2), cp_rank=0, cp_size=2)
        return
    indices = [batch_cp_indices(batch, cp_rank=r, cp_size=2) for r in range(2)]
    assert torch.equal(torch.cat(indices).sort().values, torch.arange(batch.sequence_length))
    for rank, idx in enumerate(indices):
        local = batch.cp_partition(idx, cp_rank=rank, cp_size=2)
        dataclasses.replace(local)  # re-validates
        local_doc = doc_ids[:, idx]
        assert torch.equal(local.input_ids, batch.input_ids[:, idx])
        assert torch.equal(local.labels, batch.labels[:, idx])
        assert torch.equal(local.hidden_mask, local_doc > 0)
        assert not FLASH_KWARGS & set(local.model_kwargs)
        if batch.sequence.media_counts is not None:
            _check_cp_keeps_media(batch, local, idx)
        if batch.layout is not PACKED:
            continue
        seq_ids = local.sequence.seq_ids
        assert torch.equal(seq_ids[:, 1:] != seq_ids[:, :-1], local_doc[:, 1:] != local_doc[:, :-1])
        lengths = get_seqlens_in_batch(local_doc)
        assert local.sequence.local_cu_seqlens.diff().tolist() == lengths.tolist()
        assert torch.equal(local.sequence.global_cu_seqlens, batch.sequence.global_cu_seqlens)
        metadata = build_packed_sequence_metadata(local_doc)  # what the collator emits for this layout
        if "packed_token_indices" in collated:
            assert torch.equal(local.model_kwargs["packed_token_indices"], metadata["packed_token_indices"])
        if "cu_seqlens" in collated:
            cu = local.model_kwargs["cu_seqlens"]
            width = metadata["cu_seqlens"].shape[1]
            assert torch.equal(cu[:, :width], metadata["cu_seqlens"]) and bool((cu[:, width:] == -1).all())
        if "seq_lens" in collated:
            seq_lens = local.model_kwargs["seq_lens"]
            assert seq_lens[seq_lens > 0].tolist() == lengths.tolist()
        position_ids = collated.get("position_ids")
        flash = forward_kwargs(local, backend="flash")
        assert torch.equal(flash["cu_seq_lens_q"], packed_seq_params_from_doc_ids(local_doc).cu_seqlens)
        if isinstance(position_ids, torch.Tensor):  # the collator's positions, gathered: RoPE stays exact
            assert torch.equal(flash["position_ids"], position_ids[..., idx])
        thd = forward_kwargs(local, backend="te_thd")
        assert thd["cu_seqlens_q"].diff().tolist() == lengths.tolist()


# --- text ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["padded_varlen", PACKED])
def test_default_collater(text_samples: list[dict[str, Any]], layout: str) -> None:
    samples = copy.deepcopy(text_samples[:4])
    collated = default_collater(copy.deepcopy(samples))
    labels = collated["labels"]
    batch = _convert(collated, layout)
    assert batch.batch_size == 4
    assert int(batch.hidden_mask.sum()) == sum(_lengths(samples))
    assert batch.labels is labels  # padding already -100: untouched and not copied
    assert torch.equal(batch.ce_mask, labels != -100)
    assert batch.model_kwargs["attention_mask"] is collated["attention_mask"]
    assert "padding_mask" in batch.model_kwargs
    assert batch.modality is Modality.TEXT
    if layout == PACKED:
        assert batch.sequence.global_cu_seqlens.diff().tolist() == _lengths(samples)
    doc_ids = collated["attention_mask"].long()  # the collator's map: one document per row
    _check_labels(batch, labels, doc_ids)
    _check_row_splits(batch, collated, doc_ids)
    _check_cp_partition(batch, collated, doc_ids)


@pytest.mark.parametrize("cp_size", [1, 2])
def test_thd_packing(text_samples: list[dict[str, Any]], cp_size: int) -> None:
    packs = pack_dataset(copy.deepcopy(text_samples), split=None, packed_sequence_size=96, cp_size=cp_size)
    collated = packed_sequence_thd_collater([packs[i] for i in range(len(packs))])
    assert collated["qkv_format"] == "thd"
    labels = collated["labels"].clone()
    batch = _convert(collated, PACKED)
    seq_lens, padded = collated["seq_lens"], collated["seq_lens_padded"]
    lengths = seq_lens[seq_lens >= 0]
    assert batch.sequence.global_cu_seqlens.diff().tolist() == lengths.tolist()
    assert int(batch.hidden_mask.sum()) == sum(_lengths(text_samples))
    # Each document starts at the collator's padded offset, where its position ids restart at 0.
    starts = padded.clamp(min=0).cumsum(dim=1) - padded.clamp(min=0)
    seq_ids = batch.sequence.seq_ids
    for row in range(seq_ids.shape[0]):
        row_starts = starts[row][seq_lens[row] >= 0]
        first = torch.nonzero(seq_ids[row, 1:] != seq_ids[row, :-1]).flatten() + 1
        doc_first = torch.cat([torch.tensor([0]), first])[
            seq_ids[row, torch.cat([torch.tensor([0]), first])] >= 0
        ]
        assert doc_first.tolist() == row_starts.tolist()
        assert collated["position_ids"][row, doc_first].tolist() == [0] * len(doc_first)
    assert torch.equal(batch.labels, labels)
    assert batch.model_kwargs["qkv_format"] == "thd"
    if cp_size == 2:
        assert bool((padded >= seq_lens).all()) and bool((padded > seq_lens).any())  # CP gaps exist
    # Transformer Engine kwargs equal AutoModel's own THD conversion (real and padded cu over B*T).
    reference = process_input_for_thd(dict(collated))
    thd = forward_kwargs(batch, backend="te_thd")
    assert torch.equal(thd["cu_seqlens_q"], reference["cu_seqlens"])
    assert torch.equal(
        thd["cu_seqlens_q_padded"], reference.get("cu_seqlens_padded", reference["cu_seqlens"])
    )
    doc_ids = _thd_doc_ids(seq_lens, padded, collated["input_ids"].shape[1])
    assert int(doc_ids.max()) >= 2  # packs really hold several documents
    _check_packed_against_doc_ids(batch, doc_ids)
    _check_labels(batch, labels, doc_ids)
    _check_row_splits(batch, collated, doc_ids)
    _check_cp_partition(batch, collated, doc_ids)


@pytest.fixture(scope="module")
def neat_packs(text_samples: list[dict[str, Any]]) -> Any:
    return neat_pack_dataset(
        datasets.Dataset.from_list(copy.deepcopy(text_samples)), split=None, pack_size=96
    )


@pytest.mark.parametrize("metadata", [False, True])
@pytest.mark.parametrize("mask_type", MASK_TYPES)
def test_neat_packing_every_mask_form(
    text_samples: list[dict[str, Any]], neat_packs: Any, mask_type: str, metadata: bool
) -> None:
    collated = neat_packed_collater(
        [neat_packs[i] for i in range(len(neat_packs))], packing=Contract(mask_type, metadata)
    )
    doc_ids = collated["_packed_seq_ids"]
    assert int(doc_ids.max()) >= 2  # packs really hold several documents
    labels = collated["labels"].clone()
    batch = _convert(dict(collated), PACKED)
    _check_packed_against_doc_ids(batch, doc_ids)
    assert int(batch.hidden_mask.sum()) == sum(_lengths(text_samples))
    assert torch.equal(batch.labels, labels)
    assert "_packed_seq_ids" not in batch.model_kwargs
    if mask_type == "flash_varlen":
        assert "attention_mask" not in batch.model_kwargs
        # Every sample starts on a boundary of the collator's physical cu_seq_lens_q (flattened B*T).
        cu = batch.sequence.global_cu_seqlens.long()
        valid_positions = torch.nonzero(batch.hidden_mask.flatten()).flatten()
        sample_starts = valid_positions[cu[:-1]]
        assert bool(torch.isin(sample_starts, collated["cu_seq_lens_q"].long()).all())
    if metadata:
        cu_rows = collated["cu_seqlens"]
        per_row = [row[row >= 0].diff() for row in cu_rows]
        assert torch.cat(per_row).tolist() == batch.sequence.global_cu_seqlens.diff().tolist()
    # The same collator output without `_packed_seq_ids` parses to the same samples from the mask form.
    if mask_type != "flash_varlen" or metadata:
        stripped = {k: v for k, v in collated.items() if k != "_packed_seq_ids"}
        again = _convert(stripped, PACKED)
        assert torch.equal(again.sequence.seq_ids, batch.sequence.seq_ids)
    _check_labels(batch, labels, doc_ids)
    _check_row_splits(batch, collated, doc_ids)
    _check_cp_partition(batch, collated, doc_ids)


@pytest.mark.parametrize("mask_type", MASK_TYPES)
def test_neat_packing_with_one_document_per_pack_keeps_cu(
    text_samples: list[dict[str, Any]], mask_type: str
) -> None:
    lengths = _lengths(text_samples)
    pack_size = max(lengths) + 1
    single = [s for s in text_samples if 2 * len(s["input_ids"]) > pack_size]
    assert len(single) >= 2
    packs = neat_pack_dataset(
        datasets.Dataset.from_list(copy.deepcopy(single)), split=None, pack_size=pack_size
    )
    items = [packs[i] for i in range(len(packs))]
    collated = neat_packed_collater(copy.deepcopy(items), packing=Contract(mask_type, False))
    assert "_packed_seq_ids" not in collated  # AutoModel drops the map when no pack holds two documents
    doc_ids = torch.stack([torch.as_tensor(item["attention_mask"]) for item in items])  # the packer's map
    labels = collated["labels"].clone()
    batch = _convert(collated, PACKED)
    expected = sorted(_lengths(single))
    assert sorted(batch.sequence.global_cu_seqlens.diff().tolist()) == expected
    assert batch.sequence.seq_ids is not None
    assert int(batch.hidden_mask.sum()) == sum(expected)
    assert batch.sequence.seq_ids.amax(dim=1).tolist() == list(range(len(single)))  # one sample per row
    _check_packed_against_doc_ids(batch, doc_ids)
    _check_labels(batch, labels, doc_ids)
    _check_row_splits(batch, collated, doc_ids)
    _check_cp_partition(batch, collated, doc_ids)


# --- VLM ----------------------------------------------------------------------------------------------------


def _check_media(batch: PuzzletronBatch, counts: list[int]) -> None:
    grid = batch.model_kwargs["image_grid_thw"]
    assert batch.sequence.media_counts.tolist() == counts
    assert grid.shape[0] == sum(counts)
    assert batch.model_kwargs["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())
    assert batch.modality is Modality.MULTIMODAL


def _image_ranges(counts: list[int], grid: torch.Tensor) -> tuple[list[int], list[int]]:
    """Independent media bookkeeping: first image and first patch row of every row, plus the end."""
    image_starts = [0]
    for c in counts:
        image_starts.append(image_starts[-1] + c)
    patches = [0]
    for t, h, w in grid.tolist():
        patches.append(patches[-1] + t * h * w)
    return image_starts, [patches[i] for i in image_starts]


def _check_row_groups_keep_images(
    batch: PuzzletronBatch, groups: tuple[PuzzletronBatch, ...], counts: list[int]
) -> None:
    grid = batch.model_kwargs["image_grid_thw"]
    pixels = batch.model_kwargs["pixel_values"]
    image_starts, patch_starts = _image_ranges(counts, grid)
    row = 0
    for group in groups:
        stop = row + group.batch_size
        assert group.sample_ids == batch.sample_ids[row:stop]
        assert group.sequence.media_counts.tolist() == counts[row:stop]
        group_grid = group.model_kwargs.get("image_grid_thw")
        group_pixels = group.model_kwargs.get("pixel_values")
        n_images = image_starts[stop] - image_starts[row]
        if n_images:
            assert torch.equal(group_grid, grid[image_starts[row] : image_starts[stop]])
            assert torch.equal(group_pixels, pixels[patch_starts[row] : patch_starts[stop]])
        else:
            assert group_grid is None or group_grid.shape[0] == 0
        row = stop
    assert row == batch.batch_size


def _check_cp_keeps_media(batch: PuzzletronBatch, local: PuzzletronBatch, indices: torch.Tensor) -> None:
    """Every CP rank holds the whole media of the batch (each rank runs the vision tower)."""
    assert local.model_kwargs["pixel_values"] is batch.model_kwargs["pixel_values"]
    assert local.model_kwargs["image_grid_thw"] is batch.model_kwargs["image_grid_thw"]
    assert torch.equal(local.sequence.media_counts, batch.sequence.media_counts)
    assert torch.equal(local.input_ids, batch.input_ids[:, indices])


@pytest.mark.parametrize("collate", [default_collate_fn, qwen2_5_collate_fn], ids=["default", "qwen2_5"])
def test_vlm_collators(vlm_dataset: Any, processor: Any, collate: Any) -> None:
    examples = [vlm_dataset[i] for i in range(4)]
    counts = [e["image_count"] for e in examples]
    assert counts == list(IMAGE_COUNTS[:4])
    collated = collate(examples, processor)
    labels = collated["labels"]
    batch = _convert(dict(collated), "padded_varlen")
    _check_media(batch, counts)
    assert batch.labels is labels
    assert int(batch.hidden_mask.sum()) == int(collated["attention_mask"].sum())
    # Every image token row belongs to a row that declared images, as many merged tokens as patches / 4.
    image_tokens = (batch.input_ids == processor.image_token_id).sum(dim=1)
    per_image = (batch.model_kwargs["image_grid_thw"].prod(dim=1) // 4).tolist()
    starts, _ = _image_ranges(counts, batch.model_kwargs["image_grid_thw"])
    assert image_tokens.tolist() == [sum(per_image[starts[r] : starts[r + 1]]) for r in range(4)]
    doc_ids = collated["attention_mask"].long()
    _check_labels(batch, labels, doc_ids)
    _check_row_splits(batch, collated, doc_ids, counts)
    _check_cp_partition(batch, collated, doc_ids)


def test_vlm_pretokenized_pad_collate(vlm_dataset: Any, processor: Any) -> None:
    wrapped = PreTokenizedDatasetWrapper(vlm_dataset, processor, inject_fake_images=False)
    examples = [wrapped[i] for i in range(4, 8)]
    collated = pad_collate_fn(examples, processor)
    counts = list(IMAGE_COUNTS[4:8])
    batch = _convert(dict(collated), "padded_varlen")
    _check_media(batch, counts)
    assert torch.equal(batch.labels, collated["labels"])
    # pad_collate_fn pads to the longest sample, then drops the last column for the shift.
    longest = max(e["input_ids"].shape[0] for e in examples)
    expected = sum(min(int(e["attention_mask"].sum()), longest - 1) for e in examples)
    assert int(batch.hidden_mask.sum()) == expected
    doc_ids = collated["attention_mask"].long()
    _check_labels(batch, collated["labels"], doc_ids)
    _check_row_splits(batch, collated, doc_ids, counts)
    _check_cp_partition(batch, collated, doc_ids)


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
        wrapped, pack_size=256, get_rope_index=model.get_rope_index, ds_raw=vlm_dataset, processor=processor
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
    batch = _convert(dict(collated), PACKED)
    _check_media(batch, counts)
    _check_packed_against_doc_ids(batch, doc_ids)
    assert batch.model_kwargs["position_ids"] is collated["position_ids"]
    # Every sample of the subset is in exactly one pack (lengths after the collator's shift).
    assert len(batch.sequence.sample_offsets) == sum(len(bin_) for bin_ in packs.bins) == len(vlm_dataset)
    _check_labels(batch, labels, doc_ids)
    _check_row_splits(batch, collated, doc_ids, counts)
    _check_cp_partition(batch, collated, doc_ids)


def test_vlm_thd_packing(vlm_packs: Any, vlm_dataset: Any) -> None:
    packs, items = vlm_packs
    collated = packed_sequence_thd_vlm_collater(copy.deepcopy(items))
    assert collated["qkv_format"] == "thd"
    seq_lens = collated["seq_lens"]
    counts = [sum(vlm_dataset[i]["image_count"] for i in bin_) for bin_ in packs.bins]
    batch = _convert(dict(collated), PACKED)
    _check_media(batch, counts)
    assert batch.sequence.global_cu_seqlens.diff().tolist() == seq_lens[seq_lens >= 0].tolist()
    assert int(batch.hidden_mask.sum()) == int(seq_lens.clamp(min=0).sum())
    assert torch.equal(batch.labels, collated["labels"])
    assert batch.model_kwargs["position_ids"].dim() == 3
    doc_ids = _thd_doc_ids(seq_lens, collated["seq_lens_padded"], collated["input_ids"].shape[1])
    assert int(doc_ids.max()) >= 2  # packs really hold several documents
    _check_packed_against_doc_ids(batch, doc_ids)
    _check_labels(batch, collated["labels"], doc_ids)
    _check_row_splits(batch, collated, doc_ids, counts)
    _check_cp_partition(batch, collated, doc_ids)


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
    batches = [_convert(collated, layout) for collated in collated_batches]
    assert batches
    for collated, batch in zip(collated_batches, batches, strict=True):
        doc_ids = collated.get("_packed_seq_ids")
        if doc_ids is None:  # one document per row: the collator's 2-D mask, or the block mask's diagonal
            mask = collated["attention_mask"]
            doc_ids = (mask.diagonal(dim1=-2, dim2=-1)[:, 0] if mask.dim() == 4 else mask).long()
        assert torch.equal(batch.hidden_mask, doc_ids > 0)
        if packed:
            _check_packed_against_doc_ids(batch, doc_ids)
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

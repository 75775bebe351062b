"""Checks of `batch_from_automodel` against the real NeMo AutoModel collators, shared by
``test_collators_text.py`` and ``test_collators_vlm.py``: expected values come from the collators' own maps
(``_packed_seq_ids``, ``seq_lens``, the packer's masks, ``n_images_per_sample``) and AutoModel's own builders
(`build_packed_sequence_metadata`, `packed_seq_params_from_doc_ids`), never from the code under test. Every
collator form also goes through `dp_slice`, `pp_microbatches` and a load-balanced `cp_partition`, each part
checked against the collator's map at its rows or tokens."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from nemo_automodel.components.datasets.packed_seq import packed_seq_params_from_doc_ids
from nemo_automodel.components.datasets.packing import get_seqlens_in_batch
from nemo_automodel.components.datasets.utils import build_packed_sequence_metadata

from puzzletron.dataset import DataLayout, Modality, PuzzletronBatch, batch_from_automodel
from puzzletron.dataset.batch.cp import batch_cp_indices
from puzzletron.dataset.clients.automodel.adapter import forward_kwargs
from puzzletron.dataset.errors import BatchValidationError

__all__ = [
    "MASK_TYPES",
    "PACKED",
    "Contract",
    "check_cp_partition",
    "check_labels",
    "check_media",
    "check_packed_against_doc_ids",
    "check_row_splits",
    "convert",
    "image_ranges",
    "sample_lengths",
    "thd_doc_ids",
]

PACKED = DataLayout.PACKED_VARLEN
MASK_TYPES = ("block_causal", "document_ids", "flash_varlen")
FLASH_KWARGS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
# Row-aligned kwargs a row split must slice, never rebuild: [B, ...] tensors of the collator.
ROW_LOCAL_KWARGS = ("cu_seqlens", "packed_token_indices", "seq_lens", "seq_lens_padded")


class Contract:
    """AutoModel's structural `PackedSequenceContract` (a Protocol): which mask form the collator emits."""

    def __init__(self, packed_mask_type: str, requires_packed_sequence_metadata: bool) -> None:
        self.packed_mask_type = packed_mask_type
        self.requires_packed_sequence_metadata = requires_packed_sequence_metadata


def sample_lengths(samples: list[dict[str, Any]]) -> list[int]:
    return [len(s["input_ids"]) for s in samples]


def convert(collated: dict[str, Any], layout: DataLayout | str) -> PuzzletronBatch:
    rows = collated["input_ids"].shape[0]
    return batch_from_automodel(
        collated, sample_ids=[f"row-{i}" for i in range(rows)], source_metadata={"test": True}, layout=layout
    )


def check_packed_against_doc_ids(batch: PuzzletronBatch, doc_ids: torch.Tensor) -> None:
    """Boundaries, validity and lengths agree with a collator's 1-based per-row document map."""
    seq_ids = batch.sequence.seq_ids
    assert torch.equal(seq_ids >= 0, doc_ids > 0)
    assert torch.equal(batch.hidden_mask, doc_ids > 0)
    # A new sample starts exactly where the collator's document index changes inside a row.
    assert torch.equal(seq_ids[:, 1:] != seq_ids[:, :-1], doc_ids[:, 1:] != doc_ids[:, :-1])
    lengths = get_seqlens_in_batch(doc_ids)  # AutoModel's own per-document lengths, batch-major
    assert batch.sequence.global_cu_seqlens.diff().tolist() == lengths.tolist()
    assert batch.sequence.max_seqlen == int(lengths.max())


def thd_doc_ids(seq_lens: torch.Tensor, seq_lens_padded: torch.Tensor, length: int) -> torch.Tensor:
    """The THD collator's own map, written out: document k fills ``seq_lens[k]`` tokens of its span."""
    rows = []
    for lens, spans in zip(seq_lens.tolist(), seq_lens_padded.tolist(), strict=True):
        row = []
        for k, (n, span) in enumerate(zip(lens, spans, strict=True)):
            if n >= 0:
                row += [k + 1] * n + [0] * (span - n)
        rows.append(row + [0] * (length - len(row)))
    return torch.tensor(rows)


def check_labels(batch: PuzzletronBatch, labels_before: torch.Tensor, doc_ids: torch.Tensor) -> None:
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
        check_packed_against_doc_ids(group, group_doc)
        if isinstance(collated.get("max_seqlen"), int):
            assert group.model_kwargs["max_seqlen"] == build_packed_sequence_metadata(group_doc)["max_seqlen"]
    # forward_kwargs rebuilds what the collator would emit for these rows alone (AutoModel's own builder).
    flash = forward_kwargs(group, backend="flash")
    reference = packed_seq_params_from_doc_ids(group_doc)
    assert torch.equal(flash["cu_seq_lens_q"], reference.cu_seqlens)
    assert flash["max_length_q"] == reference.max_seqlen


def check_row_splits(
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


def check_cp_partition(batch: PuzzletronBatch, collated: dict[str, Any], doc_ids: torch.Tensor) -> None:
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


def check_media(batch: PuzzletronBatch, counts: list[int]) -> None:
    grid = batch.model_kwargs["image_grid_thw"]
    assert batch.sequence.media_counts.tolist() == counts
    assert grid.shape[0] == sum(counts)
    assert batch.model_kwargs["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())
    assert batch.modality is Modality.MULTIMODAL


def image_ranges(counts: list[int], grid: torch.Tensor) -> tuple[list[int], list[int]]:
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
    image_starts, patch_starts = image_ranges(counts, grid)
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

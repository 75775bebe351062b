"""Hypothesis strategies for random valid `PuzzletronBatch`es (shared by the tests under ``tests/batch/``),
and the plain-Python references the properties compare the library against.

Ids, cu, media offsets and AutoModel's per-row packing kwargs are built here by plain Python from drawn
lengths (not by the code under test), so the property tests compare the library against an independent
construction. What a batch may hold:

- layouts fixed / padded / packed (packed rows: samples, padding gaps between them, trailing padding);
- ``position_ids`` ``[B, T]`` or mRoPE ``[3, B, T]``; ``inputs_embeds`` ``[B, T, H]``; ``seq_idx``;
- packed: ``cu_seqlens`` flat ``[n+1]`` or AutoModel per-row ``[B, D+1]`` (-1 after the last boundary),
  ``packed_token_indices`` ``[B, T]``, THD ``seq_lens``/``seq_lens_padded`` ``[B, D]`` (-1000), an int
  ``max_seqlen``, flash ``cu_seq_lens_q/k`` + ``max_length_q/k`` (dropped by every split);
- images: ``pixel_values`` one row per image or flat patches with ``image_grid_thw``;
- videos: ``pixel_values_videos`` (one row per video or flat patches with ``video_grid_thw``),
  ``second_per_grid_ts`` (a list), per-row ``n_videos_per_sample`` (a tensor or a list);
- per-row counts passed along with the rows: ``num_patches`` ``[B]``, ``n_images_per_sample`` (a tuple).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from hypothesis import strategies as st

from puzzletron.dataset import DataLayout, PackedSequenceMetadata, PuzzletronBatch
from puzzletron.dataset.batch import FLAT_BACKEND_KWARGS

__all__ = [
    "THD_SENTINEL",
    "assert_token_kwargs_match_layout",
    "batches",
    "documents",
    "flash_kwargs",
    "per_row_cu",
    "revalidated",
    "thd_lengths",
    "token_indices",
]

THD_SENTINEL = -1000


def revalidated(b: PuzzletronBatch) -> PuzzletronBatch:
    """Run every construction rule on a (derived) batch."""
    return dataclasses.replace(b)


# -- plain-Python references ------------------------------------------------------------------------


def documents(row: list[int]) -> list[tuple[int, int]]:
    """``(first position, valid length)`` of every maximal run of equal ids >= 0 in one row of ``seq_ids``."""
    docs: list[tuple[int, int]] = []
    for pos, value in enumerate(row):
        if value < 0:
            continue
        if pos > 0 and row[pos - 1] == value:
            docs[-1] = (docs[-1][0], docs[-1][1] + 1)
        else:
            docs.append((pos, 1))
    return docs


def per_row_cu(rows: list[list[int]], width: int) -> list[list[int]]:
    """AutoModel's per-row ``cu_seqlens``: row-local cumulative valid lengths, ``-1`` after the last one."""
    out = []
    for row in rows:
        cu = [0, *itertools.accumulate(length for _, length in documents(row))]
        assert len(cu) <= width
        out.append(cu + [-1] * (width - len(cu)))
    return out


def thd_lengths(rows: list[list[int]], width: int) -> tuple[list[list[int]], list[list[int]]]:
    """THD ``seq_lens`` and ``seq_lens_padded`` (spans from a document to the next one or the row end); a
    row starting with padding gets a zero-length first document spanning it. Padded with -1000."""
    lengths, spans = [], []
    for row in rows:
        docs = documents(row)
        if docs and docs[0][0] > 0:
            docs = [(0, 0), *docs]
        starts = [start for start, _ in docs] + [len(row)]
        row_lengths = [length for _, length in docs]
        row_spans = [b - a for a, b in itertools.pairwise(starts)]
        assert len(docs) <= width
        lengths.append(row_lengths + [THD_SENTINEL] * (width - len(docs)))
        spans.append(row_spans + [THD_SENTINEL] * (width - len(docs)))
    return lengths, spans


def token_indices(rows: list[list[int]]) -> list[list[int]]:
    """``packed_token_indices``: the row-local position of every valid token, ``-1`` on padding."""
    return [[pos if value >= 0 else -1 for pos, value in enumerate(row)] for row in rows]


def flash_kwargs(rows: list[list[int]]) -> dict[str, Any]:
    """HF flash ``cu_seq_lens_q/k`` over the flattened batch (padding runs are segments too)."""
    flat = [value for row in rows for value in row]
    starts = [p for p in range(len(flat)) if p == 0 or flat[p] != flat[p - 1] or p % len(rows[0]) == 0]
    cu = [*starts, len(flat)]
    longest = max(b - a for a, b in itertools.pairwise(cu))
    cu_t = torch.tensor(cu, dtype=torch.int32)
    return {
        "cu_seq_lens_q": cu_t,
        "cu_seq_lens_k": cu_t.clone(),
        "max_length_q": longest,
        "max_length_k": longest,
    }


def assert_token_kwargs_match_layout(original: PuzzletronBatch, part: PuzzletronBatch) -> None:
    """The per-row packing kwargs of ``part`` describe its own ``seq_ids`` (after a token split)."""
    rows = part.sequence.seq_ids.tolist()
    kw, orig = part.model_kwargs, original.model_kwargs
    cu = orig.get("cu_seqlens")
    local = part.sequence.local_cu_seqlens
    own_cu = local if local is not None else part.sequence.global_cu_seqlens
    if isinstance(cu, torch.Tensor):
        if cu.dim() == 1:
            assert torch.equal(kw["cu_seqlens"], own_cu)
        elif original.batch_size > 1:
            assert kw["cu_seqlens"].tolist() == per_row_cu(rows, cu.shape[1])
        else:
            # One row: the per-row form is the row's cu; -1 padding (when the original had some) is kept.
            want = own_cu.tolist()
            padded = cu.shape[1] > original.sequence.global_cu_seqlens.numel()
            assert kw["cu_seqlens"].tolist() == [want + [-1] * (cu.shape[1] - len(want) if padded else 0)]
        assert kw["cu_seqlens"].dtype == cu.dtype
    if "packed_token_indices" in orig:
        assert kw["packed_token_indices"].tolist() == token_indices(rows)
    if "seq_lens" in orig:
        lengths, spans = thd_lengths(rows, orig["seq_lens"].shape[1])
        assert kw["seq_lens"].tolist() == lengths
        assert kw["seq_lens_padded"].tolist() == spans
    if "max_seqlen" in orig:
        assert kw["max_seqlen"] == max(own_cu.diff().tolist(), default=0)
    if "seq_idx" in orig:
        assert torch.equal(kw["seq_idx"], part.sequence.seq_ids.to(orig["seq_idx"].dtype))
    assert not set(FLAT_BACKEND_KWARGS) & set(kw)


# -- the strategy -----------------------------------------------------------------------------------


def _media(
    draw: st.DrawFn, B: int, kind: str, item_value: float
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Per-row counts, ``[M, 3]`` grids and pixels (one row per item, or flat patches); a pixel row's value is
    ``item_value`` + its item number."""
    counts = [draw(st.integers(0, 2)) for _ in range(B)]
    M = sum(counts)
    grid = torch.tensor(
        [[draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))] for _ in range(M)]
    )
    grid = grid.reshape(M, 3)
    items = torch.arange(M, dtype=torch.float32) + item_value
    if kind == "per_item":
        pixels = items.reshape(M, 1).repeat(1, 3)
    else:
        per_item = grid.prod(dim=1) if M else torch.zeros(0, dtype=torch.long)
        pixels = items.repeat_interleave(per_item).reshape(-1, 1).repeat(1, 3)
    return counts, grid, pixels


@st.composite
def batches(
    draw: st.DrawFn,
    *,
    layouts: tuple[DataLayout, ...] = tuple(DataLayout),
    media: tuple[str, ...] = ("none", "per_image", "flat"),
    videos: bool = True,
    max_rows: int = 5,
) -> PuzzletronBatch:
    layout = draw(st.sampled_from(layouts))
    B = draw(st.integers(1, max_rows))
    T = draw(st.integers(2, 12))
    valid_rows: list[list[int]] = []  # per row: sample id (global, row-major) per token, -1 padding
    lengths: list[int] = []
    for _ in range(B):
        row: list[int] = []
        if layout is DataLayout.PACKED_VARLEN:
            while len(row) < T and draw(st.booleans()):
                if row and draw(st.integers(0, 4)) == 0:
                    row.append(-1)  # a padding gap between samples
                    continue
                n = draw(st.integers(1, T - len(row)))
                row += [len(lengths)] * n
                lengths.append(n)
        elif layout is DataLayout.PADDED_VARLEN:
            row = [0] * draw(st.integers(0, T))
        else:
            row = [0] * T
        valid_rows.append(row + [-1] * (T - len(row)))
    if layout is DataLayout.PACKED_VARLEN and not lengths:
        valid_rows[0][0] = 0  # cu needs at least one sample
        lengths.append(1)
    ids = torch.tensor(valid_rows)
    hidden = ids >= 0
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    labels = torch.randint(0, 1000, (B, T), generator=gen).masked_fill(~hidden, -100)
    ce = hidden & (torch.rand(B, T, generator=gen) < 0.7)
    kwargs: dict[str, Any] = {
        "input_ids": torch.randint(0, 1000, (B, T), generator=gen),
        "attention_mask": hidden.long(),
    }
    if draw(st.booleans()):
        kwargs["position_ids"] = torch.randint(0, T, (3, B, T), generator=gen)  # mRoPE
    elif draw(st.booleans()):
        kwargs["position_ids"] = torch.arange(T).repeat(B, 1)
    if draw(st.booleans()):
        kwargs["inputs_embeds"] = torch.randn(B, T, 2, generator=gen)
    seq_kwargs: dict[str, Any] = {}
    if layout is DataLayout.PACKED_VARLEN:
        cu = [0, *itertools.accumulate(lengths)]
        cu_t = torch.tensor(cu, dtype=torch.int32)
        seq_kwargs = {"global_cu_seqlens": cu_t, "seq_ids": ids}
        if draw(st.booleans()):
            seq_kwargs["max_seqlen"] = max(lengths)
        if draw(st.booleans()):
            seq_kwargs["sample_offsets"] = tuple(itertools.pairwise(cu))
        docs_per_row = max(len(documents(row)) for row in valid_rows)
        cu_form = draw(st.sampled_from(("none", "flat", "per_row")))
        if cu_form == "flat":
            kwargs["cu_seqlens"] = cu_t.clone()
        elif cu_form == "per_row":
            width = docs_per_row + 1 + draw(st.integers(0, 1))  # AutoModel pads to the batch's max docs
            kwargs["cu_seqlens"] = torch.tensor(per_row_cu(valid_rows, width), dtype=torch.int32)
        if draw(st.booleans()):
            kwargs["max_seqlen"] = max(lengths)
        if draw(st.booleans()):
            kwargs["seq_idx"] = ids.to(torch.int32)
        if draw(st.booleans()):
            kwargs["packed_token_indices"] = torch.tensor(token_indices(valid_rows))
        if draw(st.booleans()):
            seq_lens, seq_lens_padded = thd_lengths(
                valid_rows, max(docs_per_row, 1) + draw(st.integers(0, 1))
            )
            kwargs["seq_lens"] = torch.tensor(seq_lens)
            kwargs["seq_lens_padded"] = torch.tensor(seq_lens_padded)
        if draw(st.booleans()):
            kwargs.update(flash_kwargs(valid_rows))
    kind = draw(st.sampled_from(media))
    if kind != "none":
        counts, grid, pixels = _media(draw, B, "per_item" if kind == "per_image" else "flat", 0.0)
        kwargs["pixel_values"] = pixels
        kwargs["image_grid_thw"] = grid
        seq_kwargs["media_counts"] = torch.tensor(counts)
        seq_kwargs["media_offsets"] = torch.tensor([0, *itertools.accumulate(counts)])
        if draw(st.booleans()):
            kwargs["n_images_per_sample"] = tuple(counts)  # a per-row tuple: sliced with the rows
    has_video = videos and draw(st.integers(0, 3)) == 0
    if has_video:
        counts, grid, pixels = _media(draw, B, draw(st.sampled_from(("per_item", "flat"))), 1000.0)
        kwargs["pixel_values_videos"] = pixels
        kwargs["video_grid_thw"] = grid
        kwargs["second_per_grid_ts"] = [0.5 * (i + 1) for i in range(len(grid))]
        kwargs["n_videos_per_sample"] = torch.tensor(counts) if draw(st.booleans()) else counts
    if draw(st.booleans()):
        kwargs["num_patches"] = torch.randint(0, 9, (B,), generator=gen)
    sample_ids = tuple(f"s{i}" for i in range(B)) if draw(st.booleans()) else ()
    return PuzzletronBatch(
        model_kwargs=kwargs,
        labels=labels,
        ce_mask=ce,
        kd_mask=ce.clone(),
        hidden_mask=hidden,
        sequence=PackedSequenceMetadata(**seq_kwargs),
        sample_ids=sample_ids,
        source_metadata={"dataset": "synthetic", "revision": "r1"},
        modality="multimodal" if kind != "none" or has_video else "text",
        layout=layout,
    )

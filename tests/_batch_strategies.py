"""Hypothesis strategies for random valid `PuzzletronBatch`es (shared by the batch and parallel tests).

Ids, cu and media offsets are built here by plain Python from drawn lengths (not by the code under test), so
the property tests compare the library against an independent construction.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from hypothesis import strategies as st

from puzzletron.dataset import DataLayout, PackedSequenceMetadata, PuzzletronBatch

__all__ = ["batches", "revalidated"]


def revalidated(b: PuzzletronBatch) -> PuzzletronBatch:
    """Run every construction rule on a (derived) batch."""
    return dataclasses.replace(b)


@st.composite
def batches(
    draw: st.DrawFn,
    *,
    layouts: tuple[DataLayout, ...] = tuple(DataLayout),
    media: tuple[str, ...] = ("none", "per_image", "flat"),
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
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        seq_kwargs = {
            "global_cu_seqlens": cu_t,
            "seq_ids": ids,
            "max_seqlen": max(lengths),
            "sample_offsets": tuple(itertools.pairwise(cu)),
        }
        kwargs["cu_seqlens"] = cu_t.clone()
        kwargs["seq_idx"] = ids.to(torch.int32)
    kind = draw(st.sampled_from(media))
    if kind != "none":
        counts = [draw(st.integers(0, 2)) for _ in range(B)]
        M = sum(counts)
        grid = torch.tensor(
            [[1, draw(st.integers(1, 2)), draw(st.integers(1, 2))] for _ in range(M)]
        ).reshape(M, 3)
        if kind == "per_image":
            pixels = torch.arange(M, dtype=torch.float32).reshape(M, 1).repeat(1, 3)
        else:
            per_image = grid.prod(dim=1) if M else torch.zeros(0, dtype=torch.long)
            pixels = (
                torch.arange(M, dtype=torch.float32).repeat_interleave(per_image).reshape(-1, 1).repeat(1, 3)
            )
        kwargs["pixel_values"] = pixels
        kwargs["image_grid_thw"] = grid
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        seq_kwargs["media_counts"] = torch.tensor(counts)
        seq_kwargs["media_offsets"] = torch.tensor(offsets)
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
        modality="multimodal" if kind != "none" else "text",
        layout=layout,
    )

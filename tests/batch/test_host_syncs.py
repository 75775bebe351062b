"""Contract 3.1 **Better:** host syncs. Constructing a batch reads tensor values into Python (a
device-to-host sync on an accelerator) a small constant number of times whatever its size, ``to()`` and
padding never do, each split a constant number per output batch; 0/1 float masks ride on the same single
read. Measured on the CPU by a `TorchFunctionMode` that records every value read, and with CUDA's sync debug
mode where an accelerator is present."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from _batch_builders import media_batch, two_by_three
from _batch_strategies import revalidated
from _host_reads import host_reads
from puzzletron.dataset import PackedSequenceMetadata, PuzzletronBatch, parallel
from puzzletron.dataset.batch import segments as _segments


def big_packed_fields(B: int, T: int, docs: int, images: int) -> dict[str, Any]:
    """Fields of a packed VLM batch: ``docs`` samples per row (+ trailing padding), ``images`` per row (flat
    patches), mRoPE positions, per-row cu, token indices, THD lengths, ``seq_idx``."""
    gen = torch.Generator().manual_seed(B * T + docs)
    used = T - T // 8
    rows = []
    for _ in range(B):
        cuts = (torch.randperm(used - 1, generator=gen)[: docs - 1].sort().values + 1).tolist()
        bounds = [0, *cuts, used]
        rows.append([i for i, (a, b) in enumerate(itertools.pairwise(bounds)) for _ in range(a, b)])
    canon = _segments.canonical_packed_ids(torch.tensor([r + [-1] * (T - used) for r in rows]))
    ids, hidden = canon.seq_ids, canon.seq_ids >= 0
    lengths, spans = _segments.row_document_lengths(ids, docs)
    counts = torch.full((B,), images)
    return {
        "model_kwargs": {
            "input_ids": torch.randint(0, 100, (B, T), generator=gen),
            "attention_mask": hidden.long(),
            "position_ids": torch.zeros(3, B, T, dtype=torch.long),
            "cu_seqlens": _segments.row_cu_from_seq_ids(ids, docs + 1).int(),
            "packed_token_indices": torch.where(hidden, torch.arange(T).expand(B, T), -1),
            "seq_lens": torch.where(lengths >= 0, lengths, -1000),
            "seq_lens_padded": torch.where(spans >= 0, spans, -1000),
            "seq_idx": ids.int(),
            "pixel_values": torch.zeros(4 * B * images, 8),
            "image_grid_thw": torch.tensor([[1, 2, 2]] * (B * images)).reshape(-1, 3),
        },
        "labels": torch.zeros(B, T, dtype=torch.long).masked_fill(~hidden, -100),
        "ce_mask": hidden.clone(),
        "kd_mask": hidden.clone(),
        "hidden_mask": hidden,
        "sequence": PackedSequenceMetadata(
            global_cu_seqlens=canon.cu_seqlens,
            seq_ids=ids,
            max_seqlen=canon.max_seqlen,
            sample_offsets=canon.sample_offsets,
            media_counts=counts,
            media_offsets=_segments.media_offsets_from_counts(counts),
        ),
        "sample_ids": [f"r{i}" for i in range(B)],
        "layout": "packed_varlen",
        "modality": "multimodal",
    }


def test_host_reads_are_a_small_constant_independent_of_B_T_and_samples() -> None:
    """Contract 3.1 **Better:** on CPU (no accelerator needed): constructing a batch reads tensor values
    into Python a fixed number of times, whatever its size; ``to()`` and padding never do; each split does a
    constant number of reads per output batch (data-dependent sizes: cu, offsets), never one per row,
    token, sample or image."""
    sizes = [(2, 16, 2, 1), (16, 4096, 40, 3)]  # (B, T, samples per row, images per row)
    per_size = []
    for B, T, docs, images in sizes:
        fields = big_packed_fields(B, T, docs, images)
        b = PuzzletronBatch(**fields)
        row = PuzzletronBatch(**{**big_packed_fields(1, T, docs, 0), "modality": "text"})
        idx = parallel.batch_cp_indices(b, cp_rank=1, cp_size=2)
        reads = {
            "construct": host_reads(lambda f=fields: PuzzletronBatch(**f)),
            "to": host_reads(lambda b=b: b.to(torch.bfloat16)),
            "pad": host_reads(lambda b=b: b.pad_batch_to_multiple(3)),
            "cp_partition": host_reads(lambda b=b, i=idx: b.cp_partition(i, cp_rank=1, cp_size=2)),
            "dp_slice rows": host_reads(lambda b=b: b.dp_slice(dp_rank=1, dp_size=2)),
            "dp_slice packed row": host_reads(lambda r=row: r.dp_slice(dp_rank=1, dp_size=2)),
            "pp_microbatches(2)": host_reads(lambda b=b: b.pp_microbatches(2)),
        }
        per_size.append(reads)
    small, large = per_size
    assert small == large  # the same calls, in the same order, for 64 tokens and for 65,536
    assert large["construct"] == ["cpu", "__bool__"]  # one copy of the stacked checks, one read of the copy
    assert large["to"] == [] and large["pad"] == []
    assert all(len(reads) <= 6 for name, reads in large.items() if name != "pp_microbatches(2)")
    assert len(large["pp_microbatches(2)"]) <= 2 * 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an accelerator")
def test_on_cuda_construction_syncs_once_and_derived_batches_do_not_validate() -> None:
    import warnings

    b = media_batch().to("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            revalidated(b)
        construction_syncs = len(caught)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            b.to(torch.bfloat16)
            b.pad_batch_to_multiple(4)
        derived_syncs = len(caught)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert construction_syncs == 1
    assert derived_syncs == 0


def test_float_masks_of_zeros_and_ones_are_accepted_and_counted_once() -> None:
    hidden = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    b = PuzzletronBatch(**two_by_three(hidden_mask=hidden, ce_mask=hidden.clone()))
    assert b.hidden_mask is not None and b.hidden_mask.dtype == torch.float32
    # the extra value rules ride on the one host sync of construction
    assert host_reads(
        lambda: PuzzletronBatch(
            **two_by_three(hidden_mask=hidden, labels=torch.where(hidden.bool(), 0, -100))
        )
    ) == host_reads(lambda: PuzzletronBatch(**two_by_three(hidden_mask=hidden.bool())))


def test_float_inputs_are_checked_for_nan_and_inf_on_the_one_read_of_construction() -> None:
    ids = torch.ones(2, 3, dtype=torch.long)
    floats = {"inputs_embeds": torch.randn(2, 3, 8), "position_ids": torch.arange(3.0).expand(2, 3)}
    assert host_reads(lambda: PuzzletronBatch(model_kwargs={"input_ids": ids, **floats})) == host_reads(
        lambda: PuzzletronBatch(model_kwargs={"input_ids": ids})
    )

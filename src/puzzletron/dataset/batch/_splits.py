"""The operations behind the `PuzzletronBatch` methods: move, token partition (CP), row slices (DP, PP),
one packed row split by whole samples (DP), and padding rows (PP).

Each takes a valid batch and returns a batch derived from it by a rule that keeps it valid (built through
`_tables.assemble`, not validated again). `_core` decides *what* to do (argument checks, layout choices);
this module does it.
"""

from __future__ import annotations

from typing import Any

import torch

from puzzletron.dataset.batch import segments as _segments
from puzzletron.dataset.batch._keys import MASK_FIELDS, PER_IMAGE_KWARGS, VIDEO_KWARGS, TensorPath
from puzzletron.dataset.batch._media import media_slices
from puzzletron.dataset.batch._metadata import TENSOR_FIELDS
from puzzletron.dataset.batch._rebuild import canonical_updates, cu_kwarg_updates, token_layout_updates
from puzzletron.dataset.batch._tables import (
    assemble,
    batch_axis_tensors,
    derive,
    derive_metadata,
    fill_rows,
    map_tensors,
    media_len,
    packed_seq_ids,
    per_row_sequences,
    sequence_axis_tensors,
)
from puzzletron.dataset.batch._view import B
from puzzletron.dataset.errors import BatchValidationError

__all__ = ["dp_slice_packed_row", "moved", "padded", "rows", "token_partition"]


def moved(
    b: B,
    device: torch.device | None,
    dtype: torch.dtype | None,
    non_blocking: bool,
    *,
    copy: bool = False,
) -> B:
    """``b`` with every tensor moved to ``device``; ``dtype`` converts floating and complex tensors only;
    ``copy`` gives every tensor fresh storage even where nothing had to move (as ``Tensor.to(copy=True)``)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() or t.is_complex():
            return t.to(device=device, dtype=dtype, non_blocking=non_blocking, copy=copy)
        return t.to(device=device, non_blocking=non_blocking, copy=copy)

    seq = b.sequence
    moved_seq = derive_metadata(
        seq, **{name: move(getattr(seq, name)) for name in TENSOR_FIELDS if getattr(seq, name) is not None}
    )
    return derive(
        b,
        model_kwargs={key: map_tensors(value, move) for key, value in b.model_kwargs.items()},
        sequence=moved_seq,
        **{name: move(getattr(b, name)) for name in ("labels", *MASK_FIELDS) if getattr(b, name) is not None},
    )


def token_partition(b: B, idx: torch.Tensor, cp_rank: int, cp_size: int) -> B:
    """The tokens ``idx`` ``[L]`` (checked) of every row as CP rank ``cp_rank`` of ``cp_size``."""
    seq_ids = packed_seq_ids(b, "cp_partition")
    gathered = {path: t.index_select(dim, idx) for path, (t, dim) in sequence_axis_tensors(b).items()}
    if seq_ids is not None:
        gathered[("seq", "seq_ids")] = seq_ids.index_select(1, idx)
    local_cu, local_max = None, None
    cu = b.sequence.global_cu_seqlens
    if cu is not None:
        counts = _segments.counts_per_sample(gathered[("seq", "seq_ids")], cu.numel() - 1)
        local_cu = _segments.cu_from_counts(counts[counts > 0])
        local_max = _segments.max_segment_length(local_cu)
    elif b.sequence.max_seqlen is not None:
        local_max = int(idx.numel())
    kwargs_updates = cu_kwarg_updates(b, local_cu, local_max, "cp_partition")
    kwargs_updates.update(token_layout_updates(b, gathered.get(("seq", "seq_ids")), "cp_partition"))
    return assemble(
        b,
        gathered,
        kwargs_updates=kwargs_updates,
        sequence_updates={
            "local_cu_seqlens": local_cu,
            "max_seqlen": local_max,
            "cp_rank": cp_rank,
            "cp_size": cp_size,
        },
    )


def rows(b: B, start: int, stop: int) -> B:
    """Rows ``[start, stop)`` with their media; packed ids re-canonicalised (not for CP partitions)."""
    seq_ids = packed_seq_ids(b, "row split")
    sliced = {path: t.narrow(dim, start, stop - start) for path, (t, dim) in batch_axis_tensors(b).items()}
    kwargs_updates, seq_updates = media_slices(b, start, stop)
    kwargs_updates.update({key: value[start:stop] for key, value in per_row_sequences(b).items()})
    if b.sequence.global_cu_seqlens is None:
        kwargs_updates.update(cu_kwarg_updates(b, None, None, "row split"))  # refuses a stale flat cu
    if seq_ids is not None:
        ids, canon_seq, canon_kwargs = canonical_updates(b, seq_ids[start:stop], "row split")
        sliced[("seq", "seq_ids")] = ids
        seq_updates.update(canon_seq if b.sequence.global_cu_seqlens is not None else {})
        kwargs_updates.update(canon_kwargs if b.sequence.global_cu_seqlens is not None else {})
    return assemble(
        b,
        sliced,
        kwargs_updates=kwargs_updates,
        sequence_updates=seq_updates,
        sample_ids=b.sample_ids[start:stop],
    )


def dp_slice_packed_row(b: B, dp_rank: int, dp_size: int) -> B:
    seq = b.sequence
    if seq.cp_size > 1:
        raise BatchValidationError("dp_slice: slice the packed row before cp_partition, not after")
    counts = seq.media_counts
    media_keys = [
        k for k in ("pixel_values", *PER_IMAGE_KWARGS, *VIDEO_KWARGS) if media_len(b.model_kwargs.get(k))
    ]
    if media_keys or (counts is not None and int(counts.sum()) > 0):
        raise BatchValidationError(
            "dp_slice: cannot split one packed row that holds media by samples; shard multimodal samples "
            "across DP ranks in the sampler"
        )
    cu = seq.global_cu_seqlens
    n = cu.numel() - 1
    if n < dp_size:
        raise BatchValidationError(
            f"dp_slice: the packed row holds {n} samples, fewer than dp_size {dp_size}; every rank needs one"
        )
    base, extra = divmod(n, dp_size)
    first = dp_rank * base + min(dp_rank, extra)
    last = first + base + (dp_rank < extra)  # samples [first, last)
    seq_ids = packed_seq_ids(b, "dp_slice")
    # Canonical ids are numbered in token order, so samples [first, last) occupy one span of the row: from
    # the first token of `first` to the last token of `last - 1` (padding before or after it is dropped).
    row = seq_ids[0]
    positions = torch.nonzero((row >= first) & (row < last)).reshape(-1)
    tok0, tok1 = int(positions[0]), int(positions[-1]) + 1
    span = tok1 - tok0
    sliced: dict[TensorPath, torch.Tensor] = {}
    for path, (t, dim) in sequence_axis_tensors(b).items():
        if path == ("kw", "attention_mask") and t.dim() == 4:
            t = t.narrow(2, tok0, span)  # [B, 1, T, T] block mask: query and key axes both
        sliced[path] = t.narrow(dim, tok0, span)
    row_ids = seq_ids.narrow(1, tok0, span)
    new_ids = torch.where(row_ids >= 0, row_ids - first, row_ids)
    sliced[("seq", "seq_ids")] = new_ids
    new_cu = (cu[first : last + 1] - cu[first]).to(cu.dtype)
    new_max = _segments.max_segment_length(new_cu)
    kwargs_updates = cu_kwarg_updates(b, new_cu, new_max, "dp_slice")
    seq_idx = b.model_kwargs.get("seq_idx")
    if isinstance(seq_idx, torch.Tensor):
        kwargs_updates["seq_idx"] = new_ids.to(dtype=seq_idx.dtype, device=seq_idx.device)
    kwargs_updates.update(token_layout_updates(b, new_ids, "dp_slice"))
    sample_id = b.sample_ids[0] if b.sample_ids else "packed-row"
    return assemble(
        b,
        sliced,
        kwargs_updates=kwargs_updates,
        sequence_updates={
            "global_cu_seqlens": new_cu,
            "local_cu_seqlens": None,
            "max_seqlen": new_max,
            "sample_offsets": _segments.sample_offsets_from_cu(new_cu),
            "media_counts": None if counts is None else counts.new_zeros(1),
            "media_offsets": None if counts is None else counts.new_zeros(2),
            "cp_rank": 0,
            "cp_size": 1,
        },
        sample_ids=(f"{sample_id}:dp-{dp_rank}",),
        source_metadata={
            **b.source_metadata,
            "dp_packed_sample_range": [first, last],
            "dp_rank": dp_rank,
            "dp_size": dp_size,
        },
    )


def padded(b: B, extra: int) -> B:
    """``b`` with ``extra`` fully masked rows appended (media shared, not copied)."""
    seq_ids = packed_seq_ids(b, "pad_batch_to_multiple")
    tensors = batch_axis_tensors(b)
    if seq_ids is not None:
        tensors[("seq", "seq_ids")] = (seq_ids, 0)
    grown = {
        path: torch.cat([t, fill_rows(path, t, dim, extra)], dim=dim) for path, (t, dim) in tensors.items()
    }
    kwargs_updates = {
        key: type(value)([*value, *([0] * extra)]) for key, value in per_row_sequences(b).items()
    }
    seq_updates: dict[str, Any] = {}
    counts = b.sequence.media_counts
    if counts is not None:
        new_counts = torch.cat([counts, counts.new_zeros(extra)])
        seq_updates["media_counts"] = new_counts
        seq_updates["media_offsets"] = _segments.media_offsets_from_counts(new_counts).to(
            b.sequence.media_offsets.dtype if b.sequence.media_offsets is not None else torch.long
        )
    sample_ids = b.sample_ids
    if sample_ids:
        sample_ids = (*sample_ids, *(f"__pp_padding_{i}" for i in range(extra)))
    return assemble(
        b, grown, kwargs_updates=kwargs_updates, sequence_updates=seq_updates, sample_ids=sample_ids
    )

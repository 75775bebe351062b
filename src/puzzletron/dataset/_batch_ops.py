"""Tensor plumbing behind the `PuzzletronBatch` methods: which tensors have a batch or token axis, how row
and token splits slice them, and how derived batches are put back together without validating again.

Every function takes a valid batch and returns parts (or a batch) derived from it by a rule that keeps it
valid; the tests re-validate every derived batch through the public constructor. Nothing here hashes a
tensor, and nothing compares layouts: `batch.py` decides *what* to do, this module does it.
"""

from __future__ import annotations

import dataclasses
import itertools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from puzzletron.dataset import _segments
from puzzletron.dataset._batch_keys import (
    FIELD_FILL,
    FLAT_BACKEND_KWARGS,
    MASK_FIELDS,
    PER_IMAGE_KWARGS,
    PER_ROW_KWARGS,
    PER_VIDEO_KWARGS,
    ROW_FILL,
    ROW_KWARGS,
    SEQUENCE_KWARGS,
    THD_SENTINEL,
    TOKEN_INDEX_KWARGS,
    VIDEO_KWARGS,
    TensorPath,
)
from puzzletron.dataset._validation import is_int, video_counts
from puzzletron.dataset.errors import BatchValidationError

if TYPE_CHECKING:
    from puzzletron.dataset.batch import PackedSequenceMetadata, PuzzletronBatch

__all__ = [
    "assemble",
    "batch_axis_tensors",
    "cu_kwarg_updates",
    "derive",
    "derive_metadata",
    "dp_slice_packed_row",
    "moved",
    "padded",
    "rows",
    "sequence_axis_tensors",
    "token_layout_updates",
    "token_partition",
]


# -- operations (one per PuzzletronBatch method) -------------------------------------------------------------


def moved(
    b: PuzzletronBatch,
    device: torch.device | None,
    dtype: torch.dtype | None,
    non_blocking: bool,
    *,
    copy: bool = False,
) -> PuzzletronBatch:
    """``b`` with every tensor moved to ``device``; ``dtype`` converts floating and complex tensors only;
    ``copy`` gives every tensor fresh storage even where nothing had to move (as ``Tensor.to(copy=True)``)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() or t.is_complex():
            return t.to(device=device, dtype=dtype, non_blocking=non_blocking, copy=copy)
        return t.to(device=device, non_blocking=non_blocking, copy=copy)

    seq = b.sequence
    seq_tensors = ("global_cu_seqlens", "local_cu_seqlens", "seq_ids", "media_counts", "media_offsets")
    moved_seq = derive_metadata(
        seq, **{name: move(getattr(seq, name)) for name in seq_tensors if getattr(seq, name) is not None}
    )
    return derive(
        b,
        model_kwargs={key: map_tensors(value, move) for key, value in b.model_kwargs.items()},
        sequence=moved_seq,
        **{name: move(getattr(b, name)) for name in ("labels", *MASK_FIELDS) if getattr(b, name) is not None},
    )


def token_partition(b: PuzzletronBatch, idx: torch.Tensor, cp_rank: int, cp_size: int) -> PuzzletronBatch:
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


def rows(b: PuzzletronBatch, start: int, stop: int) -> PuzzletronBatch:
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


def dp_slice_packed_row(b: PuzzletronBatch, dp_rank: int, dp_size: int) -> PuzzletronBatch:
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


def padded(b: PuzzletronBatch, extra: int) -> PuzzletronBatch:
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


# -- tensor tables -------------------------------------------------------------------------------------------


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, tuple):
        return (
            type(value)(*(map_tensors(v, fn) for v in value))
            if hasattr(value, "_fields")
            else tuple(map_tensors(v, fn) for v in value)
        )
    return value


def sequence_axis_tensors(b: PuzzletronBatch) -> dict[TensorPath, tuple[torch.Tensor, int]]:
    """Every tensor with a token axis and that axis (``seq_ids`` excluded: callers add it)."""
    out: dict[TensorPath, tuple[torch.Tensor, int]] = {}
    for key in (*SEQUENCE_KWARGS, "position_ids"):
        t = b.model_kwargs.get(key)
        if isinstance(t, torch.Tensor):
            out[("kw", key)] = (t, t.dim() - 1)
    emb = b.model_kwargs.get("inputs_embeds")
    if isinstance(emb, torch.Tensor):
        out[("kw", "inputs_embeds")] = (emb, 1)
    for key in TOKEN_INDEX_KWARGS:
        t = b.model_kwargs.get(key)
        if isinstance(t, torch.Tensor) and tuple(t.shape) == (b.batch_size, b.sequence_length):
            out[("kw", key)] = (t, 1)
    for name in ("labels", *MASK_FIELDS):
        t = getattr(b, name)
        if t is not None:
            out[("field", name)] = (t, 1)
    return out


def batch_axis_tensors(b: PuzzletronBatch) -> dict[TensorPath, tuple[torch.Tensor, int]]:
    """Every tensor with a batch axis and that axis (``seq_ids`` and media excluded: callers handle them)."""
    out: dict[TensorPath, tuple[torch.Tensor, int]] = {}
    for key in (*SEQUENCE_KWARGS, *TOKEN_INDEX_KWARGS, *ROW_KWARGS, "inputs_embeds"):
        t = b.model_kwargs.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            out[("kw", key)] = (t, 0)
    pos = b.model_kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor):
        out[("kw", "position_ids")] = (pos, pos.dim() - 2)
    cu = b.model_kwargs.get("cu_seqlens")
    if is_per_row_cu(cu, b.batch_size):
        out[("kw", "cu_seqlens")] = (cu, 0)
    for key in PER_ROW_KWARGS:
        t = b.model_kwargs.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == b.batch_size:
            out[("kw", key)] = (t, 0)
    for name in ("labels", *MASK_FIELDS):
        t = getattr(b, name)
        if t is not None:
            out[("field", name)] = (t, 0)
    return out


def _fill_value(path: TensorPath) -> Any:
    kind, name = path
    if kind == "kw":
        return ROW_FILL.get(name, 0)
    return FIELD_FILL[name]


def fill_rows(path: TensorPath, t: torch.Tensor, dim: int, extra: int) -> torch.Tensor:
    """``extra`` padding rows shaped like ``t`` on ``dim`` (a per-row cu row is ``[0, -1, ...]``)."""
    shape = list(t.shape)
    shape[dim] = extra
    if path == ("kw", "cu_seqlens"):
        rows = torch.full(shape, -1, dtype=t.dtype, device=t.device)
        rows[:, 0] = 0
        return rows
    return torch.full(shape, _fill_value(path), dtype=t.dtype, device=t.device)


def is_per_row_cu(cu: Any, batch_size: int) -> bool:
    """AutoModel's per-row ``cu_seqlens`` ``[B, D+1]`` (for B == 1 it equals the flat form)."""
    return isinstance(cu, torch.Tensor) and cu.dim() == 2 and cu.shape[0] == batch_size


def per_row_sequences(b: PuzzletronBatch) -> dict[str, Sequence[Any]]:
    """``PER_ROW_KWARGS`` held as lists/tuples of B entries (tensors are in ``batch_axis_tensors``)."""
    return {
        key: value
        for key in PER_ROW_KWARGS
        if isinstance(value := b.model_kwargs.get(key), list | tuple) and len(value) == b.batch_size
    }


def renumbered_token_indices(t: torch.Tensor) -> torch.Tensor:
    """Row-local token positions of a new layout: ``arange(T)`` where ``t >= 0``, ``-1`` elsewhere."""
    positions = torch.arange(t.shape[-1], dtype=t.dtype, device=t.device).expand_as(t)
    return torch.where(t >= 0, positions, torch.full_like(t, -1))


# -- derived batches -----------------------------------------------------------------------------------------


def derive_metadata(seq: PackedSequenceMetadata, **changes: Any) -> PackedSequenceMetadata:
    """A copy of ``seq`` with ``changes`` (host-side checks only, like the public constructor)."""
    return dataclasses.replace(seq, **changes) if changes else seq


def derive(b: PuzzletronBatch, **changes: Any) -> PuzzletronBatch:
    """A batch with ``changes`` applied, built WITHOUT validation: callers pass parts they derived from a
    valid batch by a rule that keeps it valid (tests re-validate every derived batch)."""
    out = object.__new__(type(b))
    for f in dataclasses.fields(b):
        value = changes.pop(f.name, getattr(b, f.name))
        if f.name in ("model_kwargs", "source_metadata") and not isinstance(value, types.MappingProxyType):
            value = types.MappingProxyType(dict(value))
        object.__setattr__(out, f.name, value)
    if changes:
        raise TypeError(f"unknown PuzzletronBatch fields: {sorted(changes)}")
    return out


def assemble(
    b: PuzzletronBatch,
    tensors: Mapping[TensorPath, torch.Tensor],
    *,
    kwargs_updates: Mapping[str, Any] | None = None,
    sequence_updates: Mapping[str, Any] | None = None,
    **field_changes: Any,
) -> PuzzletronBatch:
    """Put the tensors of a ``sequence_axis_tensors``/``batch_axis_tensors`` table back into a batch.

    Every caller derives a split or padded batch, so ``FLAT_BACKEND_KWARGS`` are dropped (unless given in
    ``kwargs_updates``) and ``packed_token_indices`` are renumbered to the new positions."""
    kwargs = dict(b.model_kwargs)
    seq_changes = dict(sequence_updates or {})
    for (kind, name), t in tensors.items():
        if kind == "kw":
            kwargs[name] = t
        elif kind == "field":
            field_changes[name] = t
        else:
            seq_changes[name] = t
    kwargs.update(kwargs_updates or {})
    for key in FLAT_BACKEND_KWARGS:  # every caller splits or pads: flat-batch offsets are stale
        if key not in (kwargs_updates or {}):
            kwargs.pop(key, None)
    for key in TOKEN_INDEX_KWARGS:
        if ("kw", key) in tensors:
            kwargs[key] = renumbered_token_indices(kwargs[key])
    return derive(
        b, model_kwargs=kwargs, sequence=derive_metadata(b.sequence, **seq_changes), **field_changes
    )


# -- kwargs and metadata rebuilt for a new layout ------------------------------------------------------------


def packed_seq_ids(b: PuzzletronBatch, op: str) -> torch.Tensor | None:
    """``seq_ids`` of a packed batch; derived from cu for one row when absent; ``None`` when unpacked."""
    seq = b.sequence
    if seq.seq_ids is not None:
        return seq.seq_ids
    cu = seq.global_cu_seqlens
    if cu is None:
        return None
    if b.batch_size == 1 and seq.cp_size == 1:
        valid = b.hidden_mask[0].bool() if b.hidden_mask is not None else None  # padding may sit anywhere
        return _segments.seq_ids_from_cu(cu, b.sequence_length, valid=valid).reshape(1, -1)
    raise BatchValidationError(f"{op}: a packed batch with B > 1 needs sequence.seq_ids to align its samples")


def cu_kwarg_updates(
    b: PuzzletronBatch, cu: torch.Tensor | None, max_seqlen: int | None, op: str
) -> dict[str, Any]:
    """Rebuilt flat ``cu_seqlens`` (1-D, or ``[1, n+1]``; a one-row ``[1, D+1]`` padded with -1 keeps its
    width) and int ``max_seqlen`` kwargs.

    A per-row ``[B, D+1]`` ``cu_seqlens`` with B > 1 is left alone: row splits slice it, token splits rebuild
    it with ``token_layout_updates``. Without ``cu`` (a batch with no global cu) a flat one is an error: it
    cannot be rebuilt and would go stale.
    """
    updates: dict[str, Any] = {}
    old = b.model_kwargs.get("cu_seqlens")
    per_row = is_per_row_cu(old, b.batch_size) and b.batch_size > 1  # row-local: sliced or rebuilt per row
    if isinstance(old, torch.Tensor) and cu is None and not per_row:
        # A flat cu spans the whole batch: kept as is it would describe tokens or rows the result lacks.
        raise BatchValidationError(
            f"{op}: model_kwargs['cu_seqlens'] of shape {tuple(old.shape)} covers the whole batch, and "
            "without sequence.global_cu_seqlens it cannot be rebuilt for the result; use layout "
            "'packed_varlen' with packing metadata, or a per-row [B, D+1] form"
        )
    if isinstance(old, torch.Tensor) and cu is not None:
        if old.dim() == 1:
            updates["cu_seqlens"] = cu.to(device=old.device, dtype=old.dtype)
        elif old.dim() == 2 and old.shape[0] == 1:
            new = cu.to(device=old.device, dtype=old.dtype).reshape(1, -1)
            global_cu = b.sequence.global_cu_seqlens
            if global_cu is not None and old.shape[1] > max(global_cu.numel(), new.shape[1]):
                # AutoModel's per-row form of one row, -1 after its last boundary (a row of a larger batch):
                # keep its width, so a split and its inverse give back the same tensor.
                new = torch.cat([new, new.new_full((1, old.shape[1] - new.shape[1]), -1)], dim=1)
            updates["cu_seqlens"] = new
        elif not is_per_row_cu(old, b.batch_size):
            raise BatchValidationError(
                f"{op}: model_kwargs['cu_seqlens'] of shape {tuple(old.shape)} is neither flat nor per-row "
                f"[B={b.batch_size}, D+1]"
            )
    if is_int(b.model_kwargs.get("max_seqlen")) and max_seqlen is not None:
        updates["max_seqlen"] = max_seqlen
    return updates


def token_layout_updates(b: PuzzletronBatch, row_ids: torch.Tensor | None, op: str) -> dict[str, Any]:
    """Per-row kwargs rebuilt for a new token layout (``cp_partition``, ``dp_slice`` of a packed row, the
    inverse of CP) from its ``seq_ids`` ``row_ids`` ``[B, L]``: a per-row ``cu_seqlens`` (B > 1) and THD
    ``seq_lens``/``seq_lens_padded``, each keeping its width, dtype and device. Loop-free and sync-free."""
    kwargs = b.model_kwargs
    old_cu = kwargs.get("cu_seqlens")
    per_row_cu = is_per_row_cu(old_cu, b.batch_size) and b.batch_size > 1
    thd = [key for key in ROW_KWARGS if isinstance(kwargs.get(key), torch.Tensor)]
    if not (per_row_cu or thd):
        return {}
    if row_ids is None:
        keys = ["cu_seqlens"] * per_row_cu + thd
        raise BatchValidationError(f"{op}: rebuilding model_kwargs {keys} needs sequence.seq_ids")
    updates: dict[str, Any] = {}
    if per_row_cu:
        cu = _segments.row_cu_from_seq_ids(row_ids, old_cu.shape[1])
        updates["cu_seqlens"] = cu.to(device=old_cu.device, dtype=old_cu.dtype)
    if thd:
        width = kwargs[thd[0]].shape[-1]
        lengths, spans = _segments.row_document_lengths(row_ids, width)
        # A row that starts with padding (after cp_partition) gets a zero-length first document spanning it;
        # that row lacks at least its first document, so the shift never pushes one out of `width`.
        valid = row_ids >= 0
        if valid.shape[1]:  # a CP rank may hold no token at all (T < 2 * cp_size)
            lead = ~valid[:, :1] & valid.any(dim=1, keepdim=True)
            lead_span = valid.long().argmax(dim=1, keepdim=True)
            lengths = torch.where(lead, torch.cat([torch.zeros_like(lead_span), lengths[:, :-1]], 1), lengths)
            spans = torch.where(lead, torch.cat([lead_span, spans[:, :-1]], 1), spans)
        for key, value in (("seq_lens", lengths), ("seq_lens_padded", spans)):
            old = kwargs.get(key)
            if isinstance(old, torch.Tensor):
                new = torch.where(value >= 0, value, torch.full_like(value, THD_SENTINEL))
                updates[key] = new.to(device=old.device, dtype=old.dtype).reshape((*old.shape[:-1], -1))
    return updates


def canonical_updates(
    b: PuzzletronBatch, seq_ids: torch.Tensor, op: str
) -> tuple[torch.Tensor, dict[str, Any], dict[str, Any]]:
    """Re-canonicalise ``seq_ids`` of a row group: (ids, sequence updates, kwargs updates)."""
    canon = _segments.canonical_packed_ids(seq_ids)
    cu = (
        canon.cu_seqlens.to(b.sequence.global_cu_seqlens.dtype)
        if b.sequence.global_cu_seqlens is not None
        else (canon.cu_seqlens)
    )
    # A group of padding rows only keeps cu ``[0]`` (zero samples), max 0 and no offsets.
    seq_updates = {
        "global_cu_seqlens": cu,
        "local_cu_seqlens": None,
        "max_seqlen": canon.max_seqlen if b.sequence.max_seqlen is not None else None,
        "sample_offsets": canon.sample_offsets if b.sequence.sample_offsets else (),
    }
    kwargs_updates = cu_kwarg_updates(b, cu, canon.max_seqlen, op)
    seq_idx = b.model_kwargs.get("seq_idx")
    if isinstance(seq_idx, torch.Tensor):
        kwargs_updates["seq_idx"] = canon.seq_ids.to(dtype=seq_idx.dtype, device=seq_idx.device)
    return canon.seq_ids.to(seq_ids.dtype), seq_updates, kwargs_updates


def media_slices(b: PuzzletronBatch, start: int, stop: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(kwargs updates, sequence updates) giving rows ``[start, stop)`` exactly their images and videos."""
    if start == 0 and stop == b.batch_size:
        return {}, {}
    updates, seq_updates = _image_slices(b, start, stop)
    updates.update(_video_slices(b, start, stop))
    return updates, seq_updates


def _image_slices(b: PuzzletronBatch, start: int, stop: int) -> tuple[dict[str, Any], dict[str, Any]]:
    kwargs = b.model_kwargs
    counts = b.sequence.media_counts
    if counts is None:
        if any(media_len(kwargs.get(k)) > 0 for k in ("pixel_values", *PER_IMAGE_KWARGS)):
            raise BatchValidationError(
                "cannot split image media by rows without sequence.media_counts (images per row)"
            )
        return {}, {}
    offsets = _segments.media_offsets_from_counts(counts).tolist()  # one host read: [B + 1]
    updates = _aligned_media(kwargs, offsets, start, stop, "pixel_values", "image_grid_thw", PER_IMAGE_KWARGS)
    new_counts = counts[start:stop]
    seq_updates = {
        "media_counts": new_counts,
        "media_offsets": _segments.media_offsets_from_counts(new_counts).to(
            b.sequence.media_offsets.dtype if b.sequence.media_offsets is not None else torch.long
        ),
    }
    return updates, seq_updates


def _video_slices(b: PuzzletronBatch, start: int, stop: int) -> dict[str, Any]:
    """Rows own videos through a per-row count kwarg (sliced with the rows by ``per_row_sequences`` or
    ``batch_axis_tensors``); the video kwargs follow it like the image ones follow ``media_counts``."""
    kwargs = b.model_kwargs
    present = [k for k in VIDEO_KWARGS if media_len(kwargs.get(k)) > 0]
    if not present:
        return {}
    counts = video_counts(kwargs, b.batch_size)
    if counts is None:
        raise BatchValidationError(
            f"cannot split video media {present} by rows without per-row video counts: pass "
            f"model_kwargs['n_videos_per_sample'] with B={b.batch_size} entries, or keep the batch whole"
        )
    offsets = [0, *itertools.accumulate(counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
    return _aligned_media(
        kwargs, offsets, start, stop, "pixel_values_videos", "video_grid_thw", PER_VIDEO_KWARGS
    )


def _aligned_media(
    kwargs: Mapping[str, Any],
    offsets: Sequence[int],
    start: int,
    stop: int,
    pixel_key: str,
    grid_key: str,
    per_item_keys: Sequence[str],
) -> dict[str, Any]:
    """Slices of one media family (images or videos) owned by rows ``[start, stop)``.

    ``offsets`` ``[B + 1]`` are the host media offsets of the rows. Per-item kwargs are sliced by media
    range; pixels by media range when they hold one entry per item, else by the flat patch ranges of the
    grid (``0, cumsum(t*h*w)``), else it is an error.
    """
    m0, m1, total = offsets[start], offsets[stop], offsets[-1]
    updates: dict[str, Any] = {}
    for key in per_item_keys:
        if kwargs.get(key) is not None:
            updates[key] = kwargs[key][m0:m1]
    pixels = kwargs.get(pixel_key)
    if pixels is None:
        return updates
    grid = kwargs.get(grid_key)
    if not isinstance(pixels, torch.Tensor) or pixels.shape[0] == total:
        updates[pixel_key] = pixels[m0:m1]
    elif isinstance(grid, torch.Tensor):
        patches = _segments.patch_offsets_from_grid(grid).tolist()
        if patches[-1] != pixels.shape[0]:
            raise BatchValidationError(
                f"{pixel_key} has {pixels.shape[0]} rows but {grid_key} describes {patches[-1]} "
                f"patches of {total} items"
            )
        updates[pixel_key] = pixels[patches[m0] : patches[m1]]
    else:
        raise BatchValidationError(
            f"cannot align flat {pixel_key} without {grid_key} ({pixels.shape[0]} rows for {total} items)"
        )
    return updates


def media_len(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else 1
    try:
        return len(value)
    except TypeError:
        return 1

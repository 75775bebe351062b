"""Kwargs and metadata rebuilt for a new layout: a flat or per-row ``cu_seqlens``, an int ``max_seqlen``, THD
``seq_lens``/``seq_lens_padded``, ``seq_idx``, and re-canonicalised packed ids of a row group.

Loop-free over samples and rows; each function returns updates for `_tables.assemble`.
"""

from __future__ import annotations

from typing import Any

import torch

from puzzletron.dataset._checks import is_int
from puzzletron.dataset.batch import segments as _segments
from puzzletron.dataset.batch._keys import ROW_KWARGS, THD_SENTINEL
from puzzletron.dataset.batch._tables import is_per_row_cu
from puzzletron.dataset.batch._view import BatchView
from puzzletron.dataset.errors import BatchValidationError

__all__ = ["canonical_updates", "cu_kwarg_updates", "token_layout_updates"]


def cu_kwarg_updates(
    b: BatchView, cu: torch.Tensor | None, max_seqlen: int | None, op: str
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


def token_layout_updates(b: BatchView, row_ids: torch.Tensor | None, op: str) -> dict[str, Any]:
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
    b: BatchView, seq_ids: torch.Tensor, op: str
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

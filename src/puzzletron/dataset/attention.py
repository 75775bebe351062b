"""From a packed `PuzzletronBatch` (also after `cp_partition`) to the attention kwargs of a model backend.

This is the one place that derives kwargs over the flattened batch: every split of a batch
(``cp_partition``, ``dp_slice``, ``pp_microbatches``, ``pad_batch_to_multiple``) drops a collator's flash
``cu_seq_lens_q/k`` and ``max_length_q/k`` rather than keep them stale, so call it on the split batch.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from puzzletron.dataset.batch import DataLayout, PuzzletronBatch
from puzzletron.dataset.batch._segments import run_starts
from puzzletron.dataset.errors import BatchValidationError, ConfigError

__all__ = ["forward_kwargs"]


def _valid_cu(valid: torch.Tensor, doc_first: torch.Tensor) -> torch.Tensor:
    """cu ``[D+1]`` int32 over the valid tokens ``valid`` ``[N]`` of the documents starting at ``doc_first``
    ``[D]`` (flat positions; the valid tokens between two starts are the first document's run)."""
    rank = valid.cumsum(0, dtype=torch.int32)  # valid tokens up to and including each token
    cu = torch.zeros(doc_first.numel() + 1, dtype=torch.int32, device=valid.device)
    if doc_first.numel():
        cu[1:-1] = rank[doc_first[1:]] - 1  # valid tokens before each later document
        cu[-1] = rank[-1]
    return cu


def forward_kwargs(batch: PuzzletronBatch, *, backend: Literal["flash", "te_thd"]) -> dict[str, Any]:
    """Attention kwargs for a packed batch ``[B, T]`` (global, or local after `cp_partition`).

    - ``"flash"`` (HF ``flash_attn_varlen``, no attention mask): ``cu_seq_lens_q/k`` int32 over the flattened
      B*T tokens with every padding run its own segment (HF flattens the whole batch; AutoModel's
      ``packed_seq_params_from_doc_ids`` convention), ``max_length_q/k`` and ``position_ids``.
    - ``"te_thd"`` (Transformer Engine ``DotProductAttention``, ``qkv_format="thd"``): ``cu_seqlens_q/kv``
      int32 over valid tokens ("without offset" in TE's words) and ``cu_seqlens_q/kv_padded`` the physical
      start of every document in the flat buffer plus its end ("with offset": a document's span runs to the
      next document, so the padding after it is inside its span), ``max_seqlen_q/kv``,
      ``attn_mask_type="padding_causal"`` and ``position_ids``. Without padding both cu are equal.

    ``position_ids`` are the batch's own ``model_kwargs["position_ids"]`` when it has them (``[B, T]``, or
    mRoPE ``[R, B, T]``; `cp_partition` gathers them, so RoPE keeps each token's position in its document),
    else derived: ``[B, T]`` restarting at 0 in every run of ``seq_ids``. A CP-local batch without them gets
    no ``position_ids`` key: a rank's tokens of a document need not be its first ones (load-balanced indices
    give rank 0 of 2 tokens ``0, 1, 6, 7`` of an 8-token document), so positions derived from local runs
    would be wrong; put ``position_ids`` into the full batch (``replace_model_kwargs``) before partitioning.

    After `cp_partition` the kwargs are *local*: each document is the tokens of it this rank holds, in order
    (the rank's own block of causal attention). Transformer Engine's built-in context parallelism (a
    ``cp_group`` on the attention module) wants the *global* ``cu_seqlens*`` instead and divides them by
    ``cp_size`` itself: take those from the batch before partitioning.

    Use it after any split: the batch methods drop a collator's flash kwargs (their offsets cover the whole
    flattened batch) rather than keep them stale, and this function rebuilds them from ``seq_ids``.

    Raises when a document is split into several runs or the runs disagree with the batch's cu
    (`cp_partition` with unsorted indices would do that): a boundary is never dropped silently.
    """
    if backend not in ("flash", "te_thd"):
        raise ConfigError(f"forward_kwargs: backend must be 'flash' or 'te_thd', got {backend!r}")
    sequence = batch.sequence
    seq_ids = sequence.seq_ids
    if seq_ids is None or sequence.global_cu_seqlens is None:
        raise BatchValidationError(
            "forward_kwargs needs a packed batch with sequence.seq_ids and global_cu_seqlens "
            f"(layout={batch.layout.value if isinstance(batch.layout, DataLayout) else batch.layout})"
        )
    expected_cu = sequence.local_cu_seqlens if sequence.cp_size > 1 else sequence.global_cu_seqlens
    # Documents and padding runs, rows never merging (AutoModel's ``packed_seq_params_from_doc_ids``).
    starts = run_starts(seq_ids).reshape(-1)
    flat = seq_ids.reshape(-1)
    total = flat.numel()
    valid = flat >= 0
    doc_first = torch.nonzero(starts & valid).reshape(-1)  # [D] flat first token of every document
    n_docs = doc_first.numel()
    cu_valid = _valid_cu(valid, doc_first)
    if expected_cu is None or not torch.equal(cu_valid, expected_cu.to(cu_valid)):
        raise BatchValidationError(
            f"forward_kwargs: the token runs of sequence.seq_ids give cu {cu_valid.tolist()} but the batch "
            f"says {None if expected_cu is None else expected_cu.tolist()}; a document is split or merged "
            "(was cp_partition given unsorted indices?)"
        )
    segment_starts = torch.nonzero(starts).reshape(-1)
    position_ids = batch.model_kwargs.get("position_ids")
    if not isinstance(position_ids, torch.Tensor) and sequence.cp_size == 1:
        segment = starts.cumsum(0).sub_(1)  # [N] run of every token
        positions = torch.arange(total, device=flat.device) - segment_starts[segment]
        position_ids = positions.reshape(seq_ids.shape)  # restart at 0 in every run
    position_kwargs = {} if position_ids is None else {"position_ids": position_ids}
    if backend == "flash":
        cu = torch.cat([segment_starts, segment_starts.new_tensor([total])]).to(torch.int32)
        max_length = int(cu.diff().max()) if cu.numel() > 1 else 0
        return {
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max_length,
            "max_length_k": max_length,
            **position_kwargs,
        }
    # te_thd
    if n_docs and int(doc_first[0]) != 0:
        raise BatchValidationError(
            "forward_kwargs(te_thd): the flat buffer starts with padding; THD needs every padding run "
            "to follow a document"
        )
    cu_padded = torch.cat([doc_first, doc_first.new_tensor([total])]).to(torch.int32)
    max_seqlen = int(cu_valid.diff().max()) if n_docs else 0
    return {
        "qkv_format": "thd",
        "attn_mask_type": "padding_causal",
        "cu_seqlens_q": cu_valid,
        "cu_seqlens_kv": cu_valid,
        "cu_seqlens_q_padded": cu_padded,
        "cu_seqlens_kv_padded": cu_padded,
        "max_seqlen_q": max_seqlen,
        "max_seqlen_kv": max_seqlen,
        **position_kwargs,
    }

"""From a `PuzzletronBatch` (also after a split or `cp_partition`) to what a model's forward needs.

- `forward_kwargs(batch, backend=...)`: the attention kwargs of one backend: Hugging Face ``"sdpa"`` and
  ``"eager"`` (position ids restarting per document, ``use_cache=False``, a 4-D block-causal mask when
  asked or when position ids cannot mark the documents), HF ``"flash"`` (varlen ``cu_seq_lens_q/k``),
  Transformer Engine ``"te_thd"`` and Megatron-Core ``"megatron"`` (the fields of ``PackedSeqParams``).
- `model_inputs(batch, model=model)`: the complete keyword dict of an HF causal-LM or VLM forward, labels
  included, so ``model(**model_inputs(batch, model=model)).loss`` is the right loss (the backend and the
  mask dtype read from the model's config, padding rows without a NaN).

This is the one place that derives kwargs over the flattened batch: every split of a batch
(``cp_partition``, ``dp_slice``, ``pp_microbatches``, ``pad_batch_to_multiple``) drops a collator's flash
``cu_seq_lens_q/k`` and ``max_length_q/k`` rather than keep them stale, so call it on the split batch.

Labels are already shifted (``labels[t]`` is the target of ``input_ids[t]``, docs/batch-contract.md §1).
HF's causal-LM loss shifts ``labels`` itself unless it gets ``shift_labels``; `model_inputs` passes both
(``shift_labels`` = the batch's labels, ``labels`` = the same targets moved one token right), so a model
whose loss honours ``shift_labels`` and one that shifts ``labels`` compute the same, never-twice-shifted loss.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from puzzletron.dataset._checks import require_int
from puzzletron.dataset.batch import (
    FLAT_BACKEND_KWARGS,
    IGNORE_INDEX,
    PER_IMAGE_KWARGS,
    PER_ROW_KWARGS,
    ROW_KWARGS,
    TOKEN_INDEX_KWARGS,
    VIDEO_KWARGS,
    DataLayout,
    Modality,
    PuzzletronBatch,
)
from puzzletron.dataset.batch.segments import run_starts
from puzzletron.dataset.clients.hf_model import model_backend, model_dtype
from puzzletron.dataset.errors import BatchValidationError, ConfigError
from puzzletron.dataset.tokenize import normalized_pixels

__all__ = ["Backend", "MaskMode", "forward_kwargs", "model_inputs"]

Backend = Literal["sdpa", "eager", "flash", "te_thd", "megatron"]
MaskMode = Literal["auto", "block_causal", "none"]
_BACKENDS = ("sdpa", "eager", "flash", "te_thd", "megatron")
_DENSE = ("sdpa", "eager")  # HF attention that takes an attention_mask
_HF = ("sdpa", "eager", "flash")  # what `model_inputs` feeds
_MASK_MODES = ("auto", "block_causal", "none")
# Megatron-Core `PackedSeqParams` fields (megatron/core/packed_seq_params.py) this function fills.
_MEGATRON_FIELDS = (
    "qkv_format",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
)
# Batch kwargs `model_inputs` never forwards: attention and packing metadata of some collator (replaced by
# `forward_kwargs`), AutoModel's padding mask, and image/video counts that HF forwards do not take.
_NOT_FORWARDED = (
    "attention_mask",
    "padding_mask",
    "cu_seqlens",
    "max_seqlen",
    "qkv_format",
    *FLAT_BACKEND_KWARGS,
    *ROW_KWARGS,
    *TOKEN_INDEX_KWARGS,
    *(key for key in PER_ROW_KWARGS if key != "num_patches"),  # image / video counts per row
)
_MEDIA = ("pixel_values", "pixel_values_videos")
# Media kwargs: dropped when a split left none (a DP rank or microbatch of text rows; HF vision towers
# cannot take zero images).
_MEDIA_KWARGS = ("pixel_values", *PER_IMAGE_KWARGS, *VIDEO_KWARGS)


def _valid_cu(valid: torch.Tensor, doc_first: torch.Tensor) -> torch.Tensor:
    """cu ``[D+1]`` int32 over the valid tokens ``valid`` ``[N]`` of the documents starting at ``doc_first``
    ``[D]`` (flat positions; the valid tokens between two starts are the first document's run)."""
    rank = valid.cumsum(0, dtype=torch.int32)  # valid tokens up to and including each token
    cu = torch.zeros(doc_first.numel() + 1, dtype=torch.int32, device=valid.device)
    if doc_first.numel():
        cu[1:-1] = rank[doc_first[1:]] - 1  # valid tokens before each later document
        cu[-1] = rank[-1]
    return cu


def _packed_seq_ids(batch: PuzzletronBatch) -> torch.Tensor:
    """``seq_ids`` ``[B, T]`` of a packed batch, checked against its (local) cu: every document one run."""
    sequence = batch.sequence
    seq_ids = sequence.seq_ids
    if seq_ids is None or sequence.global_cu_seqlens is None:
        raise BatchValidationError(
            "forward_kwargs needs a packed batch with sequence.seq_ids and global_cu_seqlens "
            f"(layout={batch.layout.value if isinstance(batch.layout, DataLayout) else batch.layout})"
        )
    expected_cu = sequence.local_cu_seqlens if sequence.cp_size > 1 else sequence.global_cu_seqlens
    flat = seq_ids.reshape(-1)
    valid = flat >= 0
    doc_first = torch.nonzero(run_starts(seq_ids).reshape(-1) & valid).reshape(-1)
    cu_valid = _valid_cu(valid, doc_first)
    if expected_cu is None or not torch.equal(cu_valid, expected_cu.to(cu_valid)):
        raise BatchValidationError(
            f"forward_kwargs: the token runs of sequence.seq_ids give cu {cu_valid.tolist()} but the batch "
            f"says {None if expected_cu is None else expected_cu.tolist()}; a document is split or merged "
            "(was cp_partition given unsorted indices?)"
        )
    return seq_ids


def _run_positions(ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` positions restarting at 0 in every run of ``ids`` (documents and padding runs)."""
    starts = run_starts(ids).reshape(-1)
    segment_starts = torch.nonzero(starts).reshape(-1)
    segment = starts.cumsum(0).sub_(1)  # [N] run of every token
    return (torch.arange(ids.numel(), device=ids.device) - segment_starts[segment]).reshape(ids.shape)


def _positions(batch: PuzzletronBatch, seq_ids: torch.Tensor) -> torch.Tensor | None:
    """The batch's own ``position_ids`` (``[B, T]`` or mRoPE ``[R, B, T]``), else derived per run (full
    batch only: a CP rank's tokens of a document need not be its first ones), else None."""
    position_ids = batch.model_kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor):
        return position_ids
    return _run_positions(seq_ids) if batch.sequence.cp_size == 1 else None


def _varlen(batch: PuzzletronBatch, backend: str) -> dict[str, Any]:
    """``flash``, ``te_thd`` and ``megatron`` kwargs of a packed batch (see `forward_kwargs`)."""
    seq_ids = _packed_seq_ids(batch)
    starts = run_starts(seq_ids).reshape(-1)
    flat = seq_ids.reshape(-1)
    total = flat.numel()
    valid = flat >= 0
    doc_first = torch.nonzero(starts & valid).reshape(-1)  # [D] flat first token of every document
    positions = _positions(batch, seq_ids)
    position_kwargs = {} if positions is None else {"position_ids": positions}
    if backend == "flash":
        segment_starts = torch.nonzero(starts).reshape(-1)
        cu = torch.cat([segment_starts, segment_starts.new_tensor([total])]).to(torch.int32)
        max_length = int(cu.diff().max()) if cu.numel() > 1 else 0
        return {
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max_length,
            "max_length_k": max_length,
            **position_kwargs,
        }
    if doc_first.numel() and int(doc_first[0]) != 0:
        raise BatchValidationError(
            f"forward_kwargs({backend}): the flat buffer starts with padding; THD needs every padding run "
            "to follow a document"
        )
    cu_valid = _valid_cu(valid, doc_first)
    cu_padded = torch.cat([doc_first, doc_first.new_tensor([total])]).to(torch.int32)
    max_seqlen = int(cu_valid.diff().max()) if doc_first.numel() else 0
    thd = {
        "qkv_format": "thd",
        "cu_seqlens_q": cu_valid,
        "cu_seqlens_kv": cu_valid,
        "cu_seqlens_q_padded": cu_padded,
        "cu_seqlens_kv_padded": cu_padded,
        "max_seqlen_q": max_seqlen,
        "max_seqlen_kv": max_seqlen,
    }
    if backend == "megatron":
        return {name: thd[name] for name in _MEGATRON_FIELDS}
    return {**thd, "attn_mask_type": "padding_causal", **position_kwargs}


def _block_causal(ids: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``[B, 1, T, T]``: token i may see token j <= i of its own document (``ids`` ``[B, T]``, -1 padding);
    a padding token sees itself only (no row is fully masked, so no NaN). Bool (True = attend) when
    ``dtype`` is None, else additive: 0 where allowed, ``finfo(dtype).min`` elsewhere."""
    length = ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril_()
    allowed = (ids[:, :, None] == ids[:, None, :]) & causal & (ids >= 0)[:, :, None]
    allowed |= torch.eye(length, dtype=torch.bool, device=ids.device)
    allowed = allowed[:, None]
    if dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )


def _positions_mark_documents(position_ids: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether HF finds exactly these documents from ``position_ids`` alone (one host sync).

    HF (``masking_utils.find_packed_sequence_indices``) starts a new sequence wherever a position is not
    its left neighbour + 1, and only for 2-D position ids. Every valid token at column >= 1 must start a
    sequence there iff it starts a document; padding may join anything (no valid token sees a later one).
    """
    if position_ids.dim() != 2:
        hf_starts = torch.zeros_like(ids[:, 1:], dtype=torch.bool)  # mRoPE: HF infers nothing
    else:
        hf_starts = position_ids[:, 1:] - position_ids[:, :-1] != 1
    doc_starts = ids[:, 1:] != ids[:, :-1]
    return not bool(((hf_starts != doc_starts) & (ids[:, 1:] >= 0)).any())


def _dense(batch: PuzzletronBatch, backend: str, mask: str, dtype: torch.dtype | None) -> dict[str, Any]:
    """``sdpa`` / ``eager`` kwargs (see `forward_kwargs`)."""
    packed = DataLayout(batch.layout) is DataLayout.PACKED_VARLEN
    if packed:
        ids = _packed_seq_ids(batch)
        positions = _positions(batch, ids)
        if positions is None:
            raise BatchValidationError(
                f"forward_kwargs({backend}): a CP-local batch needs position_ids (put them into the full "
                "batch with replace_model_kwargs before cp_partition); HF would number the local tokens "
                "0, 1, 2, ... and RoPE would be wrong"
            )
        if "position_ids" not in batch.model_kwargs and Modality(batch.modality) is Modality.MULTIMODAL:
            raise BatchValidationError(
                f"forward_kwargs({backend}): a packed multimodal batch needs its collator's position_ids "
                "(mRoPE models number image tokens by their grid); put 1-D position_ids into the batch "
                "with replace_model_kwargs if the model uses plain RoPE"
            )
        needs_mask = not _positions_mark_documents(positions, ids)
    else:
        valid = batch.hidden_mask if batch.hidden_mask is not None else torch.ones_like(batch.input_ids)
        valid = valid.bool()
        ids = torch.arange(batch.batch_size, device=valid.device)[:, None].expand_as(valid)
        ids = ids.masked_fill(~valid, -1)
        positions = batch.model_kwargs.get("position_ids")
        # Padding before a valid token: HF's default positions (0, 1, ...) and a causal mask are wrong then.
        needs_mask = bool((valid[:, 1:] & ~valid[:, :-1]).any())
        if needs_mask and not isinstance(positions, torch.Tensor):
            raise BatchValidationError(
                f"forward_kwargs({backend}): a row has padding before a valid token and the batch has no "
                "position_ids"
            )
    if needs_mask and mask == "none":
        raise BatchValidationError(
            f"forward_kwargs({backend}, mask='none'): the position ids do not mark the documents (mRoPE "
            "positions, a CP-local batch, or padding before a token), so without a mask tokens would "
            "attend across documents; use mask='auto' or 'block_causal'"
        )
    out: dict[str, Any] = {"use_cache": False}
    if isinstance(positions, torch.Tensor):
        out["position_ids"] = positions
    if mask == "block_causal" or (packed and needs_mask and mask == "auto"):
        if backend == "eager" and dtype is None:
            raise ConfigError(
                "forward_kwargs(eager): eager attention adds the mask to its scores, so the mask must be "
                "additive in the model's dtype: pass dtype=model.dtype (a bool mask would add 1/0, silently)"
            )
        out["attention_mask"] = _block_causal(ids, dtype)
    elif not packed and mask == "auto":
        out["attention_mask"] = ids.ge(0).long()  # HF's own 2-D padding mask: one sample per row
    return out


def forward_kwargs(
    batch: PuzzletronBatch,
    *,
    backend: Backend,
    mask: MaskMode = "auto",
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Attention kwargs for a batch ``[B, T]`` (global, or local after `cp_partition`).

    - ``"sdpa"`` / ``"eager"`` (HF ``attn_implementation``, any layout): ``use_cache=False`` (with a KV
      cache, or ``config.use_cache=True`` and no kwarg, HF ignores packed position ids and attends across
      documents), ``position_ids`` and, per ``mask``:

      * ``"auto"`` (default): for a packed batch no mask when HF recovers the documents from the position
        ids (they restart at 0 in every document: HF then builds the block-causal mask itself), else an
        explicit 4-D mask ``[B, 1, T, T]``: mRoPE positions ``[3, B, T]``, a CP-local batch (positions jump
        inside a document), positions that do not restart. For an unpacked batch, HF's 2-D padding mask
        ``[B, T]`` (int64, 1 = token) from ``hidden_mask``.
      * ``"block_causal"``: always the 4-D mask (memory ``B*T*T`` elements): a token sees the earlier
        tokens of its own document; a padding token sees only itself.
      * ``"none"``: no mask; an error when the position ids do not mark the documents.

      The 4-D mask is bool (True = attend) with ``dtype=None``, else additive in ``dtype`` (0 / min).
      ``eager`` *adds* the mask to its scores, so it needs ``dtype=model.dtype`` (a bool mask would add
      1/0, silently wrong); for ``sdpa`` pass ``dtype`` only equal to the model's (torch's CPU SDPA
      misreads a float mask of another dtype).
    - ``"flash"`` (HF ``flash_attn_varlen``, packed, no attention mask): ``cu_seq_lens_q/k`` int32 over the
      flattened B*T tokens with every padding run its own segment (HF flattens the whole batch; AutoModel's
      ``packed_seq_params_from_doc_ids`` convention), ``max_length_q/k`` and ``position_ids``.
    - ``"te_thd"`` (Transformer Engine ``DotProductAttention``, ``qkv_format="thd"``, packed):
      ``cu_seqlens_q/kv`` int32 over valid tokens ("without offset" in TE's words) and
      ``cu_seqlens_q/kv_padded`` the physical start of every document in the flat buffer plus its end ("with
      offset": a document's span runs to the next document, so the padding after it is inside its span),
      ``max_seqlen_q/kv`` (int), ``attn_mask_type="padding_causal"`` and ``position_ids``. Without padding
      both cu are equal.
    - ``"megatron"``: exactly the fields of Megatron-Core's ``PackedSeqParams`` (``PackedSeqParams(**kw)``):
      the ``te_thd`` values of ``qkv_format``, ``cu_seqlens_q/kv``, ``cu_seqlens_q/kv_padded`` and
      ``max_seqlen_q/kv`` (an int; releases before the ``_padded`` fields took a tensor). Position ids go to
      the model's forward, from ``batch.model_kwargs`` or ``forward_kwargs(batch, backend="te_thd")``.

    ``position_ids`` are the batch's own ``model_kwargs["position_ids"]`` when it has them (``[B, T]``, or
    mRoPE ``[R, B, T]``; `cp_partition` gathers them, so RoPE keeps each token's position in its document),
    else derived: ``[B, T]`` restarting at 0 in every run of ``seq_ids``. A CP-local batch without them gets
    no ``position_ids`` key from the varlen backends and an error from sdpa/eager: a rank's tokens of a
    document need not be its first ones (load-balanced indices give rank 0 of 2 tokens ``0, 1, 6, 7`` of an
    8-token document); put ``position_ids`` into the full batch (``replace_model_kwargs``) before
    partitioning. A packed multimodal batch without them is an error for sdpa/eager (mRoPE models).

    After `cp_partition` the kwargs are *local*: each document is the tokens of it this rank holds, in order
    (the rank's own block of causal attention). Transformer Engine's built-in context parallelism (a
    ``cp_group`` on the attention module, also Megatron-Core's) wants the *global* ``cu_seqlens*`` instead
    and divides them by ``cp_size`` itself: take those from the batch before partitioning.

    Raises `ConfigError` for an unknown backend or option, and `BatchValidationError` when a document is
    split into several runs or the runs disagree with the batch's cu (`cp_partition` with unsorted indices
    would do that): a boundary is never dropped silently.
    """
    if backend not in _BACKENDS:
        raise ConfigError(f"forward_kwargs: backend must be one of {', '.join(_BACKENDS)}; got {backend!r}")
    if mask not in _MASK_MODES:
        raise ConfigError(f"forward_kwargs: mask must be one of {', '.join(_MASK_MODES)}; got {mask!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"forward_kwargs: dtype must be a floating torch.dtype or None; got {dtype!r}")
    if backend not in _DENSE:
        if mask != "auto" or dtype is not None:
            raise ConfigError(f"forward_kwargs({backend}): mask= and dtype= are for sdpa and eager only")
        return _varlen(batch, backend)
    return _dense(batch, backend, mask, dtype)


def _refuse_text_model(batch: PuzzletronBatch, model: Any) -> None:
    """`ConfigError` for a multimodal batch and a model whose config has no ``vision_config`` (no vision
    tower): it would end in a rotary-embedding shape error deep inside the model (mRoPE ``[3, B, T]``)."""
    config = getattr(model, "config", None)
    if Modality(batch.modality) is Modality.MULTIMODAL and getattr(config, "vision_config", None) is None:
        kind = getattr(config, "model_type", None) or "no model_type"
        raise ConfigError(
            f"model_inputs: a multimodal batch (images, [3, B, T] positions) for {type(model).__name__} "
            f"({kind}), a model without a vision tower (its config has no vision_config): feed it text "
            "batches (build_batches), or give this batch to the VLM its store was built for"
        )


def _for_model(model: Any, backend: str | None, dtype: torch.dtype | None) -> tuple[str, torch.dtype | None]:
    """``(backend, dtype)`` for ``model`` (`model_backend`, `model_dtype`): given values must agree."""
    theirs = model_backend(model)
    if backend is not None and backend != theirs:
        raise ConfigError(
            f"model_inputs(backend={backend!r}) but the model's text layers run {theirs!r} attention: its "
            "kwargs would be silently wrong there (an eager model adds a bool mask to its scores); leave "
            "backend out when you pass model="
        )
    native = model_dtype(model)
    if dtype is not None and dtype != native:
        raise ConfigError(
            f"model_inputs(dtype={dtype}) but the model is {native}: a mask must be in the model's dtype "
            "(eager adds it to its scores; torch's CPU SDPA misreads a float mask of another dtype)"
        )
    return theirs, native if theirs == "eager" else dtype


def model_inputs(
    batch: PuzzletronBatch,
    *,
    backend: Literal["sdpa", "eager", "flash"] | None = None,
    mask: MaskMode = "auto",
    dtype: torch.dtype | None = None,
    model: Any = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> dict[str, Any]:
    """The keyword dict of an HF causal-LM / VLM forward: ``model(**model_inputs(batch, model=model)).loss``
    is right.

    ``model`` (recommended): the HF model the inputs are for. ``backend`` is then read from its config (the
    attention its text layers run) and ``dtype`` is its dtype for an eager mask; a ``backend`` or ``dtype``
    given as well must agree (`ConfigError` otherwise: a bool mask on an eager model, or a float32 mask on a
    float64 one, is silently wrong); a multimodal batch for a model without a vision tower is refused,
    naming both. Without ``model``, ``backend`` defaults to ``"sdpa"``.

    Holds the batch's ``model_kwargs`` (``input_ids`` ``[B, T]``, or ``inputs_embeds`` ``[B, T, H]``
    instead when the batch has them, then without media; media such as ``pixel_values`` ``[patches, C*P*P]``,
    ``image_grid_thw`` ``[images, 3]``, ``mm_token_type_ids``; any other kwarg) without the attention and
    packing metadata of a collator (``attention_mask``, ``padding_mask``, ``cu_seqlens``, THD ``seq_lens*``,
    flash ``cu_seq_lens_*``, image counts; media a split left empty), then `forward_kwargs` of ``backend``
    (``mask`` and ``dtype`` as there), ``use_cache=False``, and the labels when the batch has them:

    - ``shift_labels`` ``[B, T]`` int64: the batch's (already shifted) labels, ``-100`` outside
      ``ce_mask``: HF's loss uses them as they are (``loss_utils.ForCausalLMLoss``);
    - ``labels`` ``[B, T]``: the same targets moved one token right (``-100`` first), as HF expects unshifted
      labels. HF computes a loss only when ``labels`` is given, and with ``shift_labels`` present ignores
      its values; a loss that ignores ``shift_labels`` shifts ``labels`` back to the same targets, exactly
      when ``shift_labels[:, -1]`` is -100 (a packed row's last token ends a document or is padding).

    - ``num_items_in_batch``: what HF divides the summed cross-entropy by. Default: the supervised tokens of
      this batch, at least 1 (a tensor; no host sync), so the loss is their mean and a batch without any
      (the padding rows ``pad_batch_to_multiple`` adds, a padding batch of the sampler) contributes exactly
      zero loss and zero gradient instead of a NaN. Give the count of the whole step (the batch before
      ``pp_microbatches``, or every gradient-accumulation batch) and the microbatches' losses *add up* to the
      step's mean: ``sum(model(**model_inputs(m, model=model, num_items_in_batch=n)).loss for m in micros)``
      with ``n = (batch.labels != -100).sum()`` (``batch.ce_mask`` applied) equals the unsplit batch's loss.

    The loss is then the mean cross-entropy over the supervised tokens; HF computes it in float32. A
    CP-local multimodal batch without ``inputs_embeds`` is an error (its image tokens are split across
    ranks while ``pixel_values`` stay whole): embed the full batch first (token embeddings with the image
    features scattered in, ``[B, T, H]``), put them in with ``replace_model_kwargs(inputs_embeds=...)``,
    then `cp_partition`.
    """
    if backend is not None and backend not in _HF:
        raise ConfigError(
            f"model_inputs: backend must be one of {', '.join(_HF)} (HF attention); got {backend!r}; use "
            "forward_kwargs for te_thd and megatron"
        )
    if model is not None:
        _refuse_text_model(batch, model)
        backend, dtype = _for_model(model, backend, dtype)
    backend = backend or "sdpa"
    kwargs = batch.model_kwargs
    embedded = "inputs_embeds" in kwargs
    if batch.sequence.cp_size > 1 and not embedded and any(kwargs.get(k) is not None for k in _MEDIA):
        raise BatchValidationError(
            "model_inputs: a CP-local batch holds only some tokens of its images while pixel_values stay "
            "whole; compute inputs_embeds on the full batch (replace_model_kwargs) before cp_partition"
        )
    # Embeddings already hold the images: no input_ids (HF takes exactly one of the two), no media.
    skip = {*_NOT_FORWARDED, "input_ids", *_MEDIA_KWARGS} if embedded else set(_NOT_FORWARDED)
    media = {k: kwargs[k] for k in _MEDIA_KWARGS if isinstance(kwargs.get(k), torch.Tensor | list | tuple)}
    skip.update(k for k, v in media.items() if len(v) == 0)  # a split left it empty (a list: decoded images)
    out = {key: value for key, value in kwargs.items() if key not in skip}
    out = normalized_pixels(out, batch.source_metadata, model_dtype(model) if model is not None else None)
    out.update(forward_kwargs(batch, backend=backend, mask=mask, dtype=dtype))
    if batch.sequence.cp_size > 1 and "position_ids" not in out:
        raise BatchValidationError(
            "model_inputs: a CP-local batch needs position_ids (put them into the full batch with "
            "replace_model_kwargs before cp_partition); HF would number the local tokens 0, 1, 2, ..."
        )
    out["use_cache"] = False
    if batch.labels is not None:
        targets = batch.labels
        if batch.ce_mask is not None:
            targets = targets.masked_fill(~batch.ce_mask.bool(), IGNORE_INDEX)
        out["labels"] = torch.nn.functional.pad(targets, (1, 0), value=IGNORE_INDEX)[:, :-1]
        out["shift_labels"] = targets
        if num_items_in_batch is None:
            num_items_in_batch = targets.ne(IGNORE_INDEX).sum().clamp_min(1)
        elif not isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = require_int(
                num_items_in_batch, "model_inputs: num_items_in_batch", minimum=1, error=ConfigError
            )
        out["num_items_in_batch"] = num_items_in_batch
    return out

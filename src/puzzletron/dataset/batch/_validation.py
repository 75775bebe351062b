"""The construction rules of `PuzzletronBatch` (``docs/batch-contract.md``, "Validation"), and the checks of
token indices and per-row video counts its methods share.

Shape rules are host-side facts (``.shape``, ``.dtype``) and raise at once. Value rules are tensor
reductions on the device the batch lives on, stacked into one boolean vector and read with a single host
sync, so a batch built on an accelerator costs one sync, whatever its size or the number of rules. Every
message names the field. Derived batches (``to``, splits, padding) never come through here: they are built
from already valid parts by the split modules.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from puzzletron.dataset._checks import is_int
from puzzletron.dataset.batch import segments as _segments
from puzzletron.dataset.batch._keys import IGNORE_INDEX, MASK_FIELDS, SEQUENCE_KWARGS, VIDEO_COUNT_KWARGS
from puzzletron.dataset.batch._metadata import TENSOR_FIELDS
from puzzletron.dataset.batch._view import BatchView
from puzzletron.dataset.batch.segments import is_integer_dtype
from puzzletron.dataset.errors import BatchValidationError

__all__ = ["check_token_indices", "validate", "video_counts"]


def validate(b: BatchView, *, packed: bool) -> None:
    """The construction rules for ``b`` (``packed``: its layout is ``packed_varlen``; enums already coerced).

    Shape rules raise immediately; value rules are batched into one host sync.
    """
    ids = b.model_kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise BatchValidationError(f"model_kwargs['input_ids'] must be a 2-D tensor [B, T]; got {got}")
    B, T = ids.shape
    if b.sample_ids and len(b.sample_ids) != B:
        raise BatchValidationError(f"sample_ids must have B={B} entries; got {len(b.sample_ids)}")
    for name in ("labels", *MASK_FIELDS):
        t = getattr(b, name)
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, T)):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise BatchValidationError(f"{name} must have shape [B, T] = [{B}, {T}]; got {got}")
    for key in SEQUENCE_KWARGS:
        t = b.model_kwargs.get(key)
        if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[-1] != T):
            raise BatchValidationError(
                f"model_kwargs[{key!r}] must have the sequence length T={T} as last dim; got {tuple(t.shape)}"
            )
    pos = b.model_kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor) and not (
        (pos.dim() == 2 and tuple(pos.shape) == (B, T)) or (pos.dim() == 3 and tuple(pos.shape[1:]) == (B, T))
    ):
        raise BatchValidationError(
            f"model_kwargs['position_ids'] must be [B, T] = [{B}, {T}] or mRoPE [R, {B}, {T}]; "
            f"got {tuple(pos.shape)}"
        )
    emb = b.model_kwargs.get("inputs_embeds")
    if isinstance(emb, torch.Tensor) and (emb.dim() != 3 or tuple(emb.shape[:2]) != (B, T)):
        raise BatchValidationError(
            f"model_kwargs['inputs_embeds'] must be [B, T, H] with B={B}, T={T}; got {tuple(emb.shape)}"
        )
    _check_tensor_kinds(b)

    checks = _token_value_rules(b)
    hidden = b.hidden_mask.bool() if b.hidden_mask is not None else None
    if hidden is not None:
        for name in ("ce_mask", "kd_mask"):
            mask = getattr(b, name)
            if mask is not None:
                checks.append((~(mask.bool() & ~hidden).any(), f"{name} must be a subset of hidden_mask"))
        if b.labels is not None:
            checks.append(
                (~((b.labels != -100) & ~hidden).any(), "labels must be -100 wherever hidden_mask is False")
            )

    seq = b.sequence
    seq_ids = seq.seq_ids
    if seq_ids is not None:
        if tuple(seq_ids.shape) != (B, T) or not is_integer_dtype(seq_ids):
            raise BatchValidationError(
                f"sequence.seq_ids must be an integer tensor [B, T] = [{B}, {T}]; "
                f"got {seq_ids.dtype} {tuple(seq_ids.shape)}"
            )
        checks.append(((seq_ids >= -1).all(), "sequence.seq_ids must be >= 0 on tokens and -1 on padding"))
        if hidden is not None:
            checks.append(((seq_ids >= 0).eq(hidden).all(), "sequence.seq_ids >= 0 must equal hidden_mask"))

    if seq.global_cu_seqlens is not None:
        _check_cu_values(b, B, T, checks, packed=packed)
    elif seq.local_cu_seqlens is not None:
        _check_cu_shape(seq.local_cu_seqlens, "sequence.local_cu_seqlens", minimum=1)
        checks += _increasing(seq.local_cu_seqlens, "sequence.local_cu_seqlens")

    counts = seq.media_counts
    if counts is not None:
        if counts.dim() != 1 or counts.numel() != B or not is_integer_dtype(counts):
            raise BatchValidationError(
                f"sequence.media_counts must be an integer tensor [B] with B={B}; "
                f"got {counts.dtype} {tuple(counts.shape)}"
            )
        checks.append(((counts >= 0).all(), "sequence.media_counts must be >= 0"))
        want = _segments.media_offsets_from_counts(counts)
        if seq.media_offsets is not None:
            if tuple(seq.media_offsets.shape) != (B + 1,):
                raise BatchValidationError(
                    f"sequence.media_offsets must have B+1={B + 1} entries; "
                    f"got {tuple(seq.media_offsets.shape)}"
                )
            checks.append(
                (
                    seq.media_offsets.to(want.device).long().eq(want).all(),
                    "sequence.media_offsets must be 0, cumsum(media_counts)",
                )
            )
        grid = b.model_kwargs.get("image_grid_thw")
        if isinstance(grid, torch.Tensor):
            checks.append(
                (
                    want[-1].eq(grid.shape[0]),
                    f"sequence.media_counts must sum to the {grid.shape[0]} rows of image_grid_thw",
                )
            )
    elif seq.media_offsets is not None:
        raise BatchValidationError("sequence.media_offsets needs sequence.media_counts")
    _check_video_counts(b.model_kwargs, B, checks)

    if checks:
        # The one host sync of validation (to CPU, whichever device the checks ran on).
        device = checks[0][0].device
        ok = torch.stack([c.reshape(()).to(device) for c, _ in checks]).cpu()
        if not bool(ok.all()):
            failed = int((~ok).nonzero()[0])
            raise BatchValidationError(checks[failed][1])


def _tensors(b: BatchView) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``b`` with the name an error should give it (top-level kwargs, fields, metadata)."""
    for key, value in b.model_kwargs.items():
        if isinstance(value, torch.Tensor):
            yield f"model_kwargs[{key!r}]", value
    for name in ("labels", *MASK_FIELDS):
        if isinstance(getattr(b, name), torch.Tensor):
            yield name, getattr(b, name)
    for name in TENSOR_FIELDS:
        if getattr(b.sequence, name) is not None:
            yield f"sequence.{name}", getattr(b.sequence, name)


def _check_tensor_kinds(b: BatchView) -> None:
    """Host-side facts: dense tensors with data (no sparse, nested or meta tensor: they have no exact
    split or value to check), integer token ids and labels, 0/1 masks of a real dtype."""
    for name, t in _tensors(b):
        if t.layout != torch.strided or t.is_nested:
            kind = "nested" if t.is_nested else str(t.layout)
            raise BatchValidationError(f"{name} must be a dense (strided) tensor; got a {kind} tensor")
        if t.device.type == "meta":
            raise BatchValidationError(f"{name} is on the meta device (it holds no data); move it first")
    for name, t in (("model_kwargs['input_ids']", b.input_ids), ("labels", b.labels)):
        if t is not None and not is_integer_dtype(t):
            raise BatchValidationError(f"{name} must hold integer token ids; got dtype {t.dtype}")
    for name in MASK_FIELDS:
        mask = getattr(b, name)
        if mask is not None and mask.dtype.is_complex:
            raise BatchValidationError(f"{name} must be a bool (or 0/1) mask; got dtype {mask.dtype}")
    _video_counts_are_counts(b)


def _token_value_rules(b: BatchView) -> list[tuple[torch.Tensor, str]]:
    """Value rules on ids, labels and masks, as (ok scalar, message) pairs for the one host sync."""
    rules = [((b.input_ids >= 0).all(), "model_kwargs['input_ids'] must be token ids >= 0")]
    if b.labels is not None:
        supervised = b.labels != IGNORE_INDEX
        valid_labels = ((b.labels >= 0) | ~supervised).all()
        rules.append((valid_labels, f"labels must be token ids >= 0 or {IGNORE_INDEX}"))
    for name in MASK_FIELDS:
        mask = getattr(b, name)
        if mask is not None and mask.dtype != torch.bool:  # NaN and inf are neither 0 nor 1
            rules.append((((mask == 0) | (mask == 1)).all(), f"{name} must hold only 0 and 1 (or bools)"))
    return rules


def _video_counts_are_counts(b: BatchView) -> None:
    """Per-row video counts given as a list must be ints >= 0 (a tensor is checked with the value rules)."""
    counts = video_counts(b.model_kwargs, b.batch_size)
    if isinstance(counts, list | tuple) and any(c < 0 for c in counts):
        raise BatchValidationError(f"per-row video counts must be >= 0; got {list(counts)}")


def video_counts(kwargs: Mapping[str, Any], batch_size: int) -> torch.Tensor | Sequence[int] | None:
    """The first of ``VIDEO_COUNT_KWARGS`` holding one count per row (a ``[B]`` tensor or B ints)."""
    for key in VIDEO_COUNT_KWARGS:
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == batch_size:
            return value
        if isinstance(value, list | tuple) and len(value) == batch_size and all(is_int(v) for v in value):
            return value
    return None


def _check_video_counts(kwargs: Mapping[str, Any], B: int, checks: list[tuple[torch.Tensor, str]]) -> None:
    """Per-row video counts (what row splits align videos by) must cover the ``video_grid_thw`` rows."""
    grid = kwargs.get("video_grid_thw")
    counts = video_counts(kwargs, B)
    if not isinstance(grid, torch.Tensor) or counts is None:
        return
    key = next(k for k in VIDEO_COUNT_KWARGS if kwargs.get(k) is counts)
    message = f"model_kwargs[{key!r}] (videos per row) must sum to the {grid.shape[0]} rows of video_grid_thw"
    if isinstance(counts, torch.Tensor):
        checks.append(((counts >= 0).all(), f"model_kwargs[{key!r}] (videos per row) must be >= 0"))
        checks.append((counts.sum().eq(grid.shape[0]), message))
    elif sum(counts) != grid.shape[0]:
        raise BatchValidationError(message)


def _check_cu_shape(cu: torch.Tensor, name: str, *, minimum: int) -> None:
    if cu.dim() != 1 or cu.numel() < minimum or not is_integer_dtype(cu):
        raise BatchValidationError(
            f"{name} must be a 1-D integer tensor with at least {minimum} entries; "
            f"got {cu.dtype} {tuple(cu.shape)}"
        )


def _increasing(cu: torch.Tensor, name: str) -> list[tuple[torch.Tensor, str]]:
    checks = [(cu[0].eq(0), f"{name} must start at 0")]
    if cu.numel() > 1:
        checks.append(((cu.diff() > 0).all(), f"{name} must be strictly increasing"))
    return checks


def _check_cu_values(
    b: BatchView, B: int, T: int, checks: list[tuple[torch.Tensor, str]], *, packed: bool
) -> None:
    seq = b.sequence
    cu = seq.global_cu_seqlens
    if not packed:
        raise BatchValidationError(
            f"sequence.global_cu_seqlens requires layout 'packed_varlen'; got layout {b.layout.value!r}"
        )
    # ``[0]`` is a packed batch of zero samples (only padding rows): the end rule below then needs zero valid
    # tokens, so a packed layout always carries cu and seq_ids, also when every row is padding.
    _check_cu_shape(cu, "sequence.global_cu_seqlens", minimum=1)
    checks += _increasing(cu, "sequence.global_cu_seqlens")
    n = cu.numel() - 1
    if seq.seq_ids is not None:
        valid = (seq.seq_ids >= 0).sum()
        source = "seq_ids >= 0"
    elif b.hidden_mask is not None:
        valid = b.hidden_mask.bool().sum()
        source = "hidden_mask"
    else:
        valid = torch.tensor(B * T)
        source = "B*T"
    valid = valid.to(cu.device)
    if seq.cp_size == 1:
        checks.append(
            (cu[-1].eq(valid), f"sequence.global_cu_seqlens must end at the valid-token count ({source})")
        )
        if seq.max_seqlen is not None:
            global_max = cu.diff().max() if cu.numel() > 1 else cu.new_zeros(())
            checks.append(
                (
                    global_max.eq(seq.max_seqlen),
                    "sequence.max_seqlen must equal the largest segment of cu",
                )
            )
        if seq.seq_ids is not None:
            ids = seq.seq_ids.to(cu.device)
            checks.append(
                ((ids < n).all(), f"sequence.seq_ids must be -1 or ids 0..{n - 1} (n from global_cu_seqlens)")
            )
            counts = _segments.counts_per_sample(ids, n)
            checks.append(
                (
                    counts.eq(cu.diff()).all(),
                    "sequence.seq_ids token counts must equal the global_cu_seqlens lengths",
                )
            )
            # Canonical order: valid ids never decrease in row-major order (cummax catches any step down).
            flat = ids.reshape(-1)
            running = torch.cummax(flat, 0).values
            checks.append(
                (
                    ((flat >= running) | (flat < 0)).all(),
                    "sequence.seq_ids must be numbered in row-major token order (canonical ids)",
                )
            )
            # One run per sample: with the counts and the order above, this makes the ids exactly canonical
            # (docs/batch-contract.md, "Canonical packed ids"), so no split can cut a sample that crosses a
            # row end or a padding gap.
            checks.append(
                (
                    _segments.run_starts(ids, ids >= 0).sum().eq(n),
                    "sequence.seq_ids must hold every sample as one contiguous run inside one row",
                )
            )
    else:
        local = seq.local_cu_seqlens
        if local is None:
            raise BatchValidationError("sequence.local_cu_seqlens is required when sequence.cp_size > 1")
        _check_cu_shape(local, "sequence.local_cu_seqlens", minimum=1)
        checks += _increasing(local, "sequence.local_cu_seqlens")
        checks.append(
            (
                local[-1].eq(valid),
                f"sequence.local_cu_seqlens must end at the local valid-token count ({source})",
            )
        )
        if seq.max_seqlen is not None:
            local_max = local.diff().max() if local.numel() > 1 else local.new_zeros(())
            checks.append(
                (local_max.eq(seq.max_seqlen), "sequence.max_seqlen must equal the largest local segment")
            )
    if seq.sample_offsets:
        if len(seq.sample_offsets) != n:
            raise BatchValidationError(
                f"sequence.sample_offsets must have one pair per sample ({n}); got {len(seq.sample_offsets)}"
            )
        want = torch.stack([cu[:-1], cu[1:]], dim=1).long()
        got = torch.tensor(seq.sample_offsets, dtype=torch.long, device=cu.device)
        checks.append((got.eq(want).all(), "sequence.sample_offsets must equal the global_cu_seqlens pairs"))


def check_token_indices(token_indices: Any, length: int, device: torch.device) -> torch.Tensor:
    """``token_indices`` as int64 on ``device``, checked: 1-D, in ``[0, length)``, unique (one host sync)."""
    idx = token_indices
    if not isinstance(idx, torch.Tensor):
        raise BatchValidationError(f"token_indices must be a torch.Tensor; got {type(idx).__name__}")
    if idx.dim() != 1 or not is_integer_dtype(idx):
        raise BatchValidationError(
            f"token_indices must be a 1-D integer tensor; got {idx.dtype} {tuple(idx.shape)}"
        )
    idx = idx.to(device=device, dtype=torch.long)
    if idx.numel():
        ordered = idx.sort().values
        ok = torch.stack([ordered[0] >= 0, ordered[-1] < length, (ordered.diff() > 0).all()]).cpu()
        if not bool(ok[0] and ok[1]):
            raise BatchValidationError(f"token_indices must lie in [0, T={length})")
        if not bool(ok[2]):
            raise BatchValidationError("token_indices must be unique")
    return idx

"""The construction rules of `PuzzletronBatch` (``docs/batch-contract.md``, "Validation"), and the checks of
token indices and per-row video counts its methods share.

Shape rules are host-side facts (``.shape``, ``.dtype``) and raise at once. Value rules are tensor
reductions on the device the batch lives on, read with a single host sync, so a batch built on an
accelerator costs one sync, whatever its size or the number of rules. They run twice over: first
`batch._fast.values_ok`, the same rules computed with as few passes over the tokens as possible (one
answer: ok or not); only when it says no are the rules below evaluated one by one (`_Checks`, lazily) to
name the field that breaks, so a valid batch pays only the fast pass. Every message names the field.
Derived batches (``to``, splits, padding) never come through here: they are built from already valid
parts by the split modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from puzzletron.dataset._checks import is_int
from puzzletron.dataset.batch import _fast
from puzzletron.dataset.batch import segments as _segments
from puzzletron.dataset.batch._floats import float_rules
from puzzletron.dataset.batch._keys import IGNORE_INDEX, MASK_FIELDS, SEQUENCE_KWARGS, VIDEO_COUNT_KWARGS
from puzzletron.dataset.batch._metadata import TENSOR_FIELDS
from puzzletron.dataset.batch._view import BatchView
from puzzletron.dataset.batch.segments import is_integer_dtype
from puzzletron.dataset.errors import BatchValidationError

__all__ = ["check_token_indices", "tensor_versions", "validate", "video_counts"]

TOKEN_DTYPES = (
    torch.int32,
    torch.int64,
)  # token ids and labels (int8/uint8 cannot hold -100 or a vocabulary)
GRID_KWARGS = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


class _Checks:
    """Value rules as ``(lazy ok scalar, message, fast)``. A rule with ``fast=True`` is one `_fast`
    computes in a stronger combined form; the others (small tensors: cu, media, grids) run in both passes."""

    def __init__(self) -> None:
        self.rules: list[tuple[Callable[[], torch.Tensor], str, bool]] = []

    def add(self, rule: Callable[[], torch.Tensor], message: str, *, fast: bool = False) -> None:
        self.rules.append((rule, message, fast))

    def passes(self, b: BatchView, *, packed: bool) -> bool:
        """Whether every rule holds: the small rules and `_fast.token_rules`, one host sync."""
        values = [rule() for rule, _, fast in self.rules if not fast] + _fast.token_rules(b, packed=packed)
        if not values:
            return True
        device = values[0].device
        ok = torch.stack([v if v.device == device else v.to(device) for v in values])
        return bool(ok.all().cpu())  # the one host sync of a valid batch

    def first_failure(self) -> str | None:
        """The message of the first rule that fails (every rule evaluated on its own, one host sync)."""
        if not self.rules:
            return None
        values = [rule().reshape(()) for rule, _, _ in self.rules]
        device = values[0].device
        ok = torch.stack([v.to(device) for v in values]).cpu()
        if bool(ok.all()):
            return None
        return self.rules[int((~ok).nonzero()[0])][1]


def validate(b: BatchView, *, packed: bool) -> None:
    """The construction rules for ``b`` (``packed``: its layout is ``packed_varlen``; enums already coerced).

    Shape rules raise immediately; value rules are batched into one host sync.
    """
    ids = b.model_kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor) and (ids.is_nested or ids.layout != torch.strided):
        kind = "nested" if ids.is_nested else str(ids.layout)
        raise BatchValidationError(
            f"model_kwargs['input_ids'] must be a dense (strided) tensor [B, T]; got a {kind} tensor (pad "
            "the rows to one length, or pack them: layout packed_varlen)"
        )
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
    checks = _Checks()
    _token_value_rules(b, checks)
    hidden = b.hidden_mask
    if hidden is not None:
        for name in ("ce_mask", "kd_mask"):
            mask = getattr(b, name)
            if mask is not None:
                checks.add(
                    lambda mask=mask: ~(mask.bool() & ~hidden.bool()).any(),
                    f"{name} must be a subset of hidden_mask",
                    fast=True,
                )
        if b.labels is not None:
            checks.add(
                lambda: ~((b.labels != -100) & ~hidden.bool()).any(),
                "labels must be -100 wherever hidden_mask is False",
                fast=True,
            )

    seq = b.sequence
    seq_ids = seq.seq_ids
    if seq_ids is not None:
        if tuple(seq_ids.shape) != (B, T) or not is_integer_dtype(seq_ids):
            raise BatchValidationError(
                f"sequence.seq_ids must be an integer tensor [B, T] = [{B}, {T}]; "
                f"got {seq_ids.dtype} {tuple(seq_ids.shape)}"
            )
        checks.add(
            lambda: (seq_ids >= -1).all(),
            "sequence.seq_ids must be >= 0 on tokens and -1 on padding",
            fast=True,
        )
        if hidden is not None:
            checks.add(
                lambda: (seq_ids >= 0).eq(hidden.bool()).all(),
                "sequence.seq_ids >= 0 must equal hidden_mask",
                fast=True,
            )

    if seq.global_cu_seqlens is not None:
        _check_cu_values(b, B, T, checks, packed=packed)
    elif seq.local_cu_seqlens is not None:
        _check_cu_shape(seq.local_cu_seqlens, "sequence.local_cu_seqlens", minimum=1)
        _increasing(seq.local_cu_seqlens, "sequence.local_cu_seqlens", checks)

    counts = seq.media_counts
    if counts is not None:
        if counts.dim() != 1 or counts.numel() != B or not is_integer_dtype(counts):
            raise BatchValidationError(
                f"sequence.media_counts must be an integer tensor [B] with B={B}; "
                f"got {counts.dtype} {tuple(counts.shape)}"
            )
        checks.add(lambda: (counts >= 0).all(), "sequence.media_counts must be >= 0")
        if seq.media_offsets is not None:
            if tuple(seq.media_offsets.shape) != (B + 1,):
                raise BatchValidationError(
                    f"sequence.media_offsets must have B+1={B + 1} entries; "
                    f"got {tuple(seq.media_offsets.shape)}"
                )
            checks.add(
                lambda: (
                    seq.media_offsets.to(counts.device)
                    .long()
                    .eq(_segments.media_offsets_from_counts(counts))
                    .all()
                ),
                "sequence.media_offsets must be 0, cumsum(media_counts)",
            )
        grid = b.model_kwargs.get("image_grid_thw")
        if isinstance(grid, torch.Tensor):
            checks.add(
                lambda: counts.sum().eq(grid.shape[0]),
                f"sequence.media_counts must sum to the {grid.shape[0]} rows of image_grid_thw",
            )
    elif seq.media_offsets is not None:
        raise BatchValidationError("sequence.media_offsets needs sequence.media_counts")
    _check_video_counts(b.model_kwargs, B, checks)
    _check_grids(b.model_kwargs, checks)
    float_rules(b.model_kwargs, checks.add)

    if checks.passes(b, packed=packed):
        return
    failure = checks.first_failure()  # only for a batch that breaks a rule: name it
    if failure is not None:
        raise BatchValidationError(failure)


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


def tensor_versions(b: BatchView) -> tuple[tuple[str, int], ...]:
    """``(name, in-place version counter)`` of every tensor of ``b`` (no host sync: a Python counter)."""
    return tuple((name, t._version) for name, t in _tensors(b))


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
        if t is not None and t.dtype not in TOKEN_DTYPES:
            raise BatchValidationError(
                f"{name} must hold integer token ids of dtype int32 or int64; got {t.dtype} (8-bit ids "
                "cannot hold a vocabulary or -100, torch has no comparisons for wider unsigned ones)"
            )
    for name in MASK_FIELDS:
        mask = getattr(b, name)
        if mask is not None and mask.dtype.is_complex:
            raise BatchValidationError(f"{name} must be a bool (or 0/1) mask; got dtype {mask.dtype}")
    _video_counts_are_counts(b)


def _token_value_rules(b: BatchView, checks: _Checks) -> None:
    """Value rules on ids, labels and masks (lazy, see `_Checks`)."""
    checks.add(
        lambda: (b.input_ids >= 0).all(), "model_kwargs['input_ids'] must be token ids >= 0", fast=True
    )
    if b.labels is not None:
        checks.add(
            lambda: ((b.labels >= 0) | (b.labels == IGNORE_INDEX)).all(),
            f"labels must be token ids >= 0 or {IGNORE_INDEX}",
            fast=True,
        )
    for name in MASK_FIELDS:
        mask = getattr(b, name)
        if mask is not None and mask.dtype != torch.bool:  # NaN and inf are neither 0 nor 1
            checks.add(
                lambda mask=mask: ((mask == 0) | (mask == 1)).all(),
                f"{name} must hold only 0 and 1 (or bools)",
            )


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


def _check_video_counts(kwargs: Mapping[str, Any], B: int, checks: _Checks) -> None:
    """Per-row video counts (what row splits align videos by) must cover the ``video_grid_thw`` rows."""
    grid = kwargs.get("video_grid_thw")
    counts = video_counts(kwargs, B)
    if not isinstance(grid, torch.Tensor) or counts is None:
        return
    key = next(k for k in VIDEO_COUNT_KWARGS if kwargs.get(k) is counts)
    message = f"model_kwargs[{key!r}] (videos per row) must sum to the {grid.shape[0]} rows of video_grid_thw"
    if isinstance(counts, torch.Tensor):
        checks.add(lambda: (counts >= 0).all(), f"model_kwargs[{key!r}] (videos per row) must be >= 0")
        checks.add(lambda: counts.sum().eq(grid.shape[0]), message)
    elif sum(counts) != grid.shape[0]:
        raise BatchValidationError(message)


def _check_grids(kwargs: Mapping[str, Any], checks: _Checks) -> None:
    """``image_grid_thw`` / ``video_grid_thw``: integer ``[N, 3]`` of positive (t, h, w); their pixels hold
    one entry per item or exactly the ``t*h*w`` patch rows the grid describes (what row splits cut by)."""
    for pixel_key, grid_key in GRID_KWARGS:
        grid, pixels = kwargs.get(grid_key), kwargs.get(pixel_key)
        if not isinstance(grid, torch.Tensor):
            continue
        if grid.dim() != 2 or grid.shape[1] != 3 or (grid.numel() and not is_integer_dtype(grid)):
            raise BatchValidationError(
                f"model_kwargs[{grid_key!r}] must be an integer tensor [N, 3] of (t, h, w); "
                f"got {grid.dtype} {tuple(grid.shape)}"
            )
        checks.add(lambda grid=grid: (grid > 0).all(), f"model_kwargs[{grid_key!r}] must hold (t, h, w) > 0")
        if isinstance(pixels, torch.Tensor) and pixels.dim() >= 1 and pixels.shape[0] != grid.shape[0]:
            rows = pixels.shape[0]
            checks.add(
                lambda grid=grid, rows=rows: grid.long().prod(dim=1).sum().eq(rows),
                f"model_kwargs[{pixel_key!r}] has {rows} rows: neither one per item of {grid_key} "
                f"({grid.shape[0]}) nor the t*h*w patches it describes",
            )


def _check_cu_shape(cu: torch.Tensor, name: str, *, minimum: int) -> None:
    if cu.dim() != 1 or cu.numel() < minimum or not is_integer_dtype(cu):
        raise BatchValidationError(
            f"{name} must be a 1-D integer tensor with at least {minimum} entries; "
            f"got {cu.dtype} {tuple(cu.shape)}"
        )


def _increasing(cu: torch.Tensor, name: str, checks: _Checks) -> None:
    checks.add(lambda: cu[0].eq(0), f"{name} must start at 0")
    if cu.numel() > 1:
        checks.add(lambda: (cu.diff() > 0).all(), f"{name} must be strictly increasing")


def _check_cu_values(b: BatchView, B: int, T: int, checks: _Checks, *, packed: bool) -> None:
    seq = b.sequence
    cu = seq.global_cu_seqlens
    if not packed:
        raise BatchValidationError(
            f"sequence.global_cu_seqlens requires layout 'packed_varlen'; got layout {b.layout.value!r}"
        )
    # ``[0]`` is a packed batch of zero samples (only padding rows): the end rule below then needs zero valid
    # tokens, so a packed layout always carries cu and seq_ids, also when every row is padding.
    _check_cu_shape(cu, "sequence.global_cu_seqlens", minimum=1)
    _increasing(cu, "sequence.global_cu_seqlens", checks)
    n = cu.numel() - 1
    if seq.seq_ids is not None:
        source = "seq_ids >= 0"

        def valid() -> torch.Tensor:
            return (seq.seq_ids >= 0).sum().to(cu.device)

    elif b.hidden_mask is not None:
        source = "hidden_mask"

        def valid() -> torch.Tensor:
            return b.hidden_mask.bool().sum().to(cu.device)

    else:
        source = "B*T"

        def valid() -> torch.Tensor:
            return torch.tensor(B * T, device=cu.device)

    if seq.cp_size == 1:
        checks.add(
            lambda: cu[-1].eq(valid()),
            f"sequence.global_cu_seqlens must end at the valid-token count ({source})",
            fast=True,
        )
        if seq.max_seqlen is not None:
            checks.add(
                lambda: (cu.diff().max() if cu.numel() > 1 else cu.new_zeros(())).eq(seq.max_seqlen),
                "sequence.max_seqlen must equal the largest segment of cu",
            )
        if seq.seq_ids is not None:
            ids = seq.seq_ids.to(cu.device)
            checks.add(
                lambda: (ids < n).all(),
                f"sequence.seq_ids must be -1 or ids 0..{n - 1} (n from global_cu_seqlens)",
                fast=True,
            )
            checks.add(
                lambda: _segments.counts_per_sample(ids, n).eq(cu.diff()).all(),
                "sequence.seq_ids token counts must equal the global_cu_seqlens lengths",
                fast=True,
            )
            # Canonical order: valid ids never decrease in row-major order (cummax catches any step down).
            checks.add(
                lambda: (
                    (ids.reshape(-1) >= torch.cummax(ids.reshape(-1), 0).values) | (ids.reshape(-1) < 0)
                ).all(),
                "sequence.seq_ids must be numbered in row-major token order (canonical ids)",
                fast=True,
            )
            # One run per sample: with the counts and the order above, this makes the ids exactly canonical
            # (docs/batch-contract.md, "Canonical packed ids"), so no split can cut a sample that crosses a
            # row end or a padding gap.
            checks.add(
                lambda: _segments.run_starts(ids, ids >= 0).sum().eq(n),
                "sequence.seq_ids must hold every sample as one contiguous run inside one row",
                fast=True,
            )
    else:
        local = seq.local_cu_seqlens
        if local is None:
            raise BatchValidationError("sequence.local_cu_seqlens is required when sequence.cp_size > 1")
        _check_cu_shape(local, "sequence.local_cu_seqlens", minimum=1)
        _increasing(local, "sequence.local_cu_seqlens", checks)
        checks.add(
            lambda: local[-1].eq(valid()),
            f"sequence.local_cu_seqlens must end at the local valid-token count ({source})",
        )
        if seq.max_seqlen is not None:
            checks.add(
                lambda: (local.diff().max() if local.numel() > 1 else local.new_zeros(())).eq(seq.max_seqlen),
                "sequence.max_seqlen must equal the largest local segment",
            )
    if seq.sample_offsets:
        if len(seq.sample_offsets) != n:
            raise BatchValidationError(
                f"sequence.sample_offsets must have one pair per sample ({n}); got {len(seq.sample_offsets)}"
            )
        got = torch.tensor(seq.sample_offsets, dtype=torch.long, device=cu.device)
        checks.add(
            lambda: got.eq(torch.stack([cu[:-1], cu[1:]], dim=1).long()).all(),
            "sequence.sample_offsets must equal the global_cu_seqlens pairs",
        )


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

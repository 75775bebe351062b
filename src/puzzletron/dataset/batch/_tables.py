"""Which tensors of a batch have a batch or a token axis, and how derived batches are put back together.

Every split reads its tensors from `sequence_axis_tensors` / `batch_axis_tensors` (decided by key, see
`_keys`), slices them, and hands the pieces to `assemble`, which builds the derived batch through `derive`
*without validating again*: callers pass parts derived from a valid batch by a rule that keeps it valid
(the tests re-validate every derived batch through the public constructor). Nothing here hashes a tensor.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from puzzletron.dataset.batch import segments as _segments
from puzzletron.dataset.batch._keys import (
    FIELD_FILL,
    FLAT_BACKEND_KWARGS,
    MASK_FIELDS,
    PER_ROW_KWARGS,
    ROW_FILL,
    ROW_KWARGS,
    SEQUENCE_KWARGS,
    TOKEN_INDEX_KWARGS,
    TensorPath,
)
from puzzletron.dataset.batch._metadata import PackedSequenceMetadata
from puzzletron.dataset.batch._view import B, BatchView
from puzzletron.dataset.errors import BatchValidationError

__all__ = [
    "assemble",
    "batch_axis_tensors",
    "derive",
    "derive_metadata",
    "fill_rows",
    "from_fields",
    "is_per_row_cu",
    "map_tensors",
    "media_len",
    "packed_seq_ids",
    "per_row_sequences",
    "seq_ids_or_derived",
    "sequence_axis_tensors",
]


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


def sequence_axis_tensors(b: BatchView) -> dict[TensorPath, tuple[torch.Tensor, int]]:
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
    return {**out, **_target_tensors(b, 1)}


def _target_tensors(b: BatchView, dim: int) -> dict[TensorPath, tuple[torch.Tensor, int]]:
    """``labels`` and the masks present, each with ``dim`` (their batch axis is 0, their token axis 1)."""
    fields = ((name, getattr(b, name)) for name in ("labels", *MASK_FIELDS))
    return {("field", name): (t, dim) for name, t in fields if t is not None}


def batch_axis_tensors(b: BatchView) -> dict[TensorPath, tuple[torch.Tensor, int]]:
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
    return {**out, **_target_tensors(b, 0)}


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


def per_row_sequences(b: BatchView) -> dict[str, Sequence[Any]]:
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


def derive_metadata(seq: PackedSequenceMetadata, **changes: Any) -> PackedSequenceMetadata:
    """A copy of ``seq`` with ``changes`` (host-side checks only, like the public constructor)."""
    return dataclasses.replace(seq, **changes) if changes else seq


def from_fields(cls: type[B], values: Mapping[str, Any]) -> B:
    """An instance of the batch dataclass ``cls`` holding ``values`` (one per field), built WITHOUT
    validation; mappings become read-only. Used by `derive` and by unpickling (a pickled batch was valid)."""
    out = object.__new__(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = values[f.name]
        if f.name in ("model_kwargs", "source_metadata") and not isinstance(value, types.MappingProxyType):
            value = types.MappingProxyType(dict(value))
        object.__setattr__(out, f.name, value)
    return out


def derive(b: B, **changes: Any) -> B:
    """``b`` with ``changes`` applied, built WITHOUT validation: callers pass parts they derived from a
    valid batch by a rule that keeps it valid (tests re-validate every derived batch)."""
    names = [f.name for f in dataclasses.fields(b)]  # type: ignore[arg-type]
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise TypeError(f"unknown PuzzletronBatch fields: {unknown}")
    return from_fields(type(b), {name: changes.get(name, getattr(b, name)) for name in names})


def assemble(
    b: B,
    tensors: Mapping[TensorPath, torch.Tensor],
    *,
    kwargs_updates: Mapping[str, Any] | None = None,
    sequence_updates: Mapping[str, Any] | None = None,
    **field_changes: Any,
) -> B:
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


def seq_ids_or_derived(b: BatchView) -> torch.Tensor | None:
    """``sequence.seq_ids``; for one packed row given by cu alone, the ids derived from cu (over
    ``hidden_mask``'s valid tokens: padding may sit anywhere); else ``None``."""
    seq = b.sequence
    if seq.seq_ids is not None:
        return seq.seq_ids
    cu = seq.global_cu_seqlens
    if cu is None or b.batch_size != 1 or seq.cp_size != 1:
        return None
    valid = b.hidden_mask[0].bool() if b.hidden_mask is not None else None
    return _segments.seq_ids_from_cu(cu, b.sequence_length, valid=valid).reshape(1, -1)


def packed_seq_ids(b: BatchView, op: str) -> torch.Tensor | None:
    """``seq_ids`` of a packed batch (see `seq_ids_or_derived`); ``None`` when unpacked; an error naming
    ``op`` when a packed batch's samples cannot be aligned (B > 1 without ``seq_ids``)."""
    ids = seq_ids_or_derived(b)
    if ids is None and b.sequence.global_cu_seqlens is not None:
        raise BatchValidationError(
            f"{op}: a packed batch with B > 1 needs sequence.seq_ids to align its samples"
        )
    return ids


def media_len(value: Any) -> int:
    """Entries on a media kwarg's first axis (0 for None, 1 for a scalar)."""
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else 1
    try:
        return len(value)
    except TypeError:
        return 1

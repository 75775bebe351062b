"""`PuzzletronBatch`: the one model-input contract shared by Puzzletron stages, and its exact splits.

A batch holds ``model_kwargs`` (whatever the model forward takes; ``input_ids`` ``[B, T]`` is required),
token-level targets (``labels``, ``ce_mask``, ``kd_mask``, ``hidden_mask``, all ``[B, T]``), the packing and
media boundaries in :class:`PackedSequenceMetadata`, and provenance (``sample_ids``, ``source_metadata``).

Which tensors have a batch or sequence axis is decided by *key*, never by a shape coincidence:

==========================  ==============================  ========================================
key                         batch axis (row ops)            sequence axis (``cp_partition``)
==========================  ==============================  ========================================
input_ids, attention_mask,  dim 0 (when 2-D or more)         last dim (a 4-D ``attention_mask`` is
cache_position, seq_idx,                                     refused: it cannot be split exactly)
mm_token_type_ids,
padding_mask, token_type_ids
position_ids                dim 0 of ``[B, T]``, dim 1 of    last dim
                            mRoPE ``[R, B, T]``
inputs_embeds               dim 0 of ``[B, T, H]``          dim 1
packed_token_indices        dim 0 (pad rows: -1)            last dim, then renumbered to the new
                                                            positions (``arange`` where valid)
seq_lens, seq_lens_padded   dim 0 (THD ``[B, max_docs]``,   rebuilt per row from the new ``seq_ids``
                            pad rows: -1000)
cu_seqlens                  per-row ``[B, D+1]`` (-1 after   per-row: rebuilt per row from the new
                            the last boundary): dim 0 (pad   ``seq_ids``; flat: the local cu
                            rows ``[0, -1, ...]``); flat
                            ``[n+1]``: rebuilt per group
n_videos_per_sample,        dim 0 when it has B entries      --
num_patches (+ image
counts)
labels, masks, seq_ids      dim 0                           dim 1
==========================  ==============================  ========================================

A 2-D ``cu_seqlens`` with B rows is AutoModel's per-row form (row-local offsets over each row's valid
tokens); a 1-D one (or ``[1, n+1]`` when B > 1) is flat over the whole batch. For one row both coincide.
Rebuilt THD ``seq_lens_padded`` spans run from a document's first token to the next document (or the row
end); a row that starts with padding (possible after ``cp_partition``) gets a leading zero-length document
spanning that padding, so the physical offsets stay exact.

Backend kwargs over the flattened batch (HF flash ``cu_seq_lens_q/k``, ``max_length_q/k``) are *dropped* by
every split (``cp_partition``, ``dp_slice``, ``pp_microbatches``, ``pad_batch_to_multiple``):
`puzzletron.dataset.automodel.forward_kwargs` is the one place that derives them, from ``seq_ids``.

Media is per image: ``image_grid_thw``, ``image_position_ids``, ``image_sizes`` have one row per image, and
``pixel_values`` has either one entry per image or the flat patches of every image
(``sum(t*h*w)`` rows, aligned through ``image_grid_thw``); ``sequence.media_counts`` ``[B]`` says how many
images each row owns. Any other tensor kwarg is passed through *unchanged* by every row or token operation.

Validation runs once, in ``__init__``: shape rules on the host, value rules as tensor reductions stacked
into one boolean vector and read with a single host sync (so a batch built on an accelerator costs one sync,
not one per rule). Batches derived by ``to``, ``cp_partition``, ``dp_slice``, ``pp_microbatches`` and
``pad_batch_to_multiple`` are built from already valid parts through a private path that does not validate
again. ``fingerprint`` (SHA-256 of the content) is computed on first access only and cached.

Equality and hashing are by content: ``a == b`` iff their fingerprints are equal, ``hash(a)`` hashes the
fingerprint. Both therefore hash every tensor on first use (a device-to-host copy on an accelerator).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import pairwise
from typing import Any

import torch

from puzzletron.dataset import _segments
from puzzletron.dataset._fingerprint import fingerprint_of
from puzzletron.dataset.errors import BatchValidationError

__all__ = ["DataLayout", "Modality", "PackedSequenceMetadata", "PuzzletronBatch"]


class DataLayout(str, Enum):
    """How the tokens of a batch are laid out: ``[B, T]`` rows of one sample each, or packed samples."""

    FIXED = "fixed"
    PADDED_VARLEN = "padded_varlen"
    PACKED_VARLEN = "packed_varlen"


class Modality(str, Enum):
    TEXT = "text"
    MULTIMODAL = "multimodal"


# Tensors whose last dim is the token axis T (contract 3.1 rule 4, plus HF's token_type_ids).
SEQUENCE_KWARGS = (
    "input_ids",
    "attention_mask",
    "cache_position",
    "seq_idx",
    "mm_token_type_ids",
    "padding_mask",
    "token_type_ids",
)
# AutoModel neat-packing metadata: row-local token positions [B, T], -1 on padding. Gathered like a sequence
# tensor, then renumbered to the positions of the new layout (so it stays arange(T) where valid).
TOKEN_INDEX_KWARGS = ("packed_token_indices",)
# THD per-row document lengths [B, max_docs], padded with AutoModel's sentinel.
ROW_KWARGS = ("seq_lens", "seq_lens_padded")
# One entry per row ([B] tensor, list or tuple): sliced with the rows when they have B entries, else passed
# through (batch_from_automodel consumes the image counts; a batch built by hand may still carry them).
PER_ROW_KWARGS = (
    "n_images_per_sample",
    "num_images_per_sample",
    "n_videos_per_sample",
    "num_videos_per_sample",
    "num_patches",
)
# HF flash-varlen kwargs over the flattened B*T tokens: dropped by every split (their offsets cover the whole
# batch); rebuild them with `puzzletron.dataset.automodel.forward_kwargs(batch, backend="flash")`.
FLAT_BACKEND_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
PER_IMAGE_KWARGS = ("image_grid_thw", "image_position_ids", "image_sizes")
VIDEO_KWARGS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
THD_SENTINEL = -1000
_ROW_FILL = {
    "seq_idx": -1,
    "padding_mask": True,
    "seq_lens": THD_SENTINEL,
    "seq_lens_padded": THD_SENTINEL,
    "packed_token_indices": -1,
}
_FIELD_FILL = {"labels": -100, "ce_mask": False, "kd_mask": False, "hidden_mask": False, "seq_ids": -1}
_MASK_FIELDS = ("ce_mask", "kd_mask", "hidden_mask")

# A tensor location inside a batch: ("kw", key) for model_kwargs, ("field", name) for labels/masks,
# ("seq", "seq_ids") for the metadata.
_Path = tuple[str, str]


def _coerce_enum(enum_cls: type[Enum], value: Any, name: str) -> Any:
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)
        raise BatchValidationError(f"{name} must be one of {allowed}; got {value!r}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(value: Any, name: str, *, minimum: int) -> int:
    if not _is_int(value) or value < minimum:
        raise BatchValidationError(f"{name} must be an int >= {minimum}; got {value!r}")
    return value


def _require_tensor(value: Any, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise BatchValidationError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    return value


def _is_integer_dtype(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


@dataclass(frozen=True, eq=False)
class PackedSequenceMetadata:
    """Sequence and media boundaries retained across distributed partitions.

    - ``global_cu_seqlens`` ``[n + 1]``: cumulative valid-token lengths of every packed sample of the batch
      (``[0]`` for a packed batch of padding rows only).
    - ``local_cu_seqlens``: the same over the tokens this CP rank holds (set by ``cp_partition``).
    - ``max_seqlen``: longest segment in tokens (the local one when ``cp_size > 1``).
    - ``seq_ids`` ``[B, T]``: global sample id per token (``0..n-1``, row-major), ``-1`` on padding.
    - ``sample_offsets``: ``((cu[0], cu[1]), (cu[1], cu[2]), ...)``.
    - ``media_counts`` ``[B]`` images per row; ``media_offsets`` ``[B + 1]`` = ``0, cumsum(media_counts)``.

    Only host-side facts are checked here; tensor rules are checked by ``PuzzletronBatch``. Equality and
    hashing are by content fingerprint (tensors make field-wise ``==`` ambiguous).
    """

    global_cu_seqlens: torch.Tensor | None = None
    local_cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    seq_ids: torch.Tensor | None = None
    sample_offsets: tuple[tuple[int, int], ...] = ()
    media_counts: torch.Tensor | None = None
    media_offsets: torch.Tensor | None = None
    cp_rank: int = 0
    cp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("global_cu_seqlens", "local_cu_seqlens", "seq_ids", "media_counts", "media_offsets"):
            value = getattr(self, name)
            if value is not None:
                _require_tensor(value, f"sequence.{name}")
        if self.max_seqlen is not None:
            _require_int(self.max_seqlen, "sequence.max_seqlen", minimum=0)
        cp_size = _require_int(self.cp_size, "sequence.cp_size", minimum=1)
        cp_rank = _require_int(self.cp_rank, "sequence.cp_rank", minimum=0)
        if cp_rank >= cp_size:
            raise BatchValidationError(f"sequence.cp_rank must be < cp_size ({cp_size}); got {cp_rank}")
        try:
            offsets = tuple((int(a), int(b)) for a, b in self.sample_offsets)
        except (TypeError, ValueError):
            raise BatchValidationError(
                f"sequence.sample_offsets must be pairs of ints (start, stop); got {self.sample_offsets!r}"
            ) from None
        object.__setattr__(self, "sample_offsets", offsets)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedSequenceMetadata):
            return NotImplemented
        return self is other or fingerprint_of(self) == fingerprint_of(other)

    def __hash__(self) -> int:
        return hash(fingerprint_of(self))


@dataclass(frozen=True, eq=False)
class PuzzletronBatch:
    """The only model-input contract shared by Puzzletron stages.

    The batch remains backend-neutral: descriptor/stage adapters decide which validated model_kwargs are
    consumed by a particular model forward.

    Shapes: ``model_kwargs["input_ids"]`` ``[B, T]``; ``labels``/``ce_mask``/``kd_mask``/``hidden_mask``
    ``[B, T]``; see the module docstring for the other kwargs. ``model_kwargs`` and ``source_metadata`` are
    stored as read-only mappings over private copies.
    """

    model_kwargs: Mapping[str, Any]
    labels: torch.Tensor | None = None
    ce_mask: torch.Tensor | None = None
    kd_mask: torch.Tensor | None = None
    hidden_mask: torch.Tensor | None = None
    sequence: PackedSequenceMetadata = field(default_factory=PackedSequenceMetadata)
    sample_ids: tuple[str, ...] = ()
    source_metadata: Mapping[str, Any] = field(default_factory=dict)
    modality: Modality = Modality.TEXT
    layout: DataLayout = DataLayout.FIXED

    def __post_init__(self) -> None:
        if not isinstance(self.model_kwargs, Mapping):
            raise BatchValidationError(
                f"model_kwargs must be a mapping; got {type(self.model_kwargs).__name__}"
            )
        if not isinstance(self.source_metadata, Mapping):
            raise BatchValidationError(
                f"source_metadata must be a mapping; got {type(self.source_metadata).__name__}"
            )
        if not isinstance(self.sequence, PackedSequenceMetadata):
            raise BatchValidationError(
                f"sequence must be a PackedSequenceMetadata; got {type(self.sequence).__name__}"
            )
        if isinstance(self.sample_ids, str | bytes) or not isinstance(self.sample_ids, Sequence):
            raise BatchValidationError(
                f"sample_ids must be a sequence of str (one per row); got {type(self.sample_ids).__name__}"
            )
        # Coerce first: every rule below compares enums, never raw strings.
        object.__setattr__(self, "modality", _coerce_enum(Modality, self.modality, "modality"))
        object.__setattr__(self, "layout", _coerce_enum(DataLayout, self.layout, "layout"))
        object.__setattr__(self, "sample_ids", tuple(str(s) for s in self.sample_ids))
        object.__setattr__(self, "model_kwargs", types.MappingProxyType(dict(self.model_kwargs)))
        object.__setattr__(self, "source_metadata", types.MappingProxyType(dict(self.source_metadata)))
        _validate(self)

    # -- derived facts -------------------------------------------------------------------------------

    @property
    def input_ids(self) -> torch.Tensor:
        """Token ids ``[B, T]`` (``model_kwargs["input_ids"]``)."""
        return self.model_kwargs["input_ids"]

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def sequence_length(self) -> int:
        return int(self.input_ids.shape[1])

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 hex digest of the content; computed on first access (tensors copied to host then)."""
        return fingerprint_of(
            {
                "model_kwargs": self.model_kwargs,
                "labels": self.labels,
                "ce_mask": self.ce_mask,
                "kd_mask": self.kd_mask,
                "hidden_mask": self.hidden_mask,
                "sequence": self.sequence,
                "sample_ids": self.sample_ids,
                "source_metadata": self.source_metadata,
                "modality": self.modality,
                "layout": self.layout,
            },
            where="PuzzletronBatch",
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PuzzletronBatch):
            return NotImplemented
        return self is other or self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __reduce__(self) -> tuple[Callable[..., PuzzletronBatch], tuple[dict[str, Any]]]:
        """Pickle support (DataLoader workers return batches): the fields, mappings as plain dicts.

        Unpickling rebuilds the read-only mappings without validating again (the batch was valid when it
        was pickled; pickles are trusted input anyway) and without the cached fingerprint, which is
        recomputed on first access and equals the original one.
        """
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        state["model_kwargs"] = dict(self.model_kwargs)
        state["source_metadata"] = dict(self.source_metadata)
        return (_unpickle_batch, (state,))

    def __repr__(self) -> str:
        return (
            f"PuzzletronBatch(B={self.batch_size}, T={self.sequence_length}, layout={self.layout.value}, "
            f"modality={self.modality.value}, kwargs={sorted(self.model_kwargs)}, "
            f"cp={self.sequence.cp_rank}/{self.sequence.cp_size}, sample_ids={self.sample_ids[:4]!r}"
            f"{'...' if len(self.sample_ids) > 4 else ''})"
        )

    # -- methods -------------------------------------------------------------------------------------

    def replace_model_kwargs(self, **updates: Any) -> PuzzletronBatch:
        """A new, validated batch whose ``model_kwargs`` are these merged with ``updates``."""
        return dataclasses.replace(self, model_kwargs={**self.model_kwargs, **updates})

    def to(self, *args: Any, **kwargs: Any) -> PuzzletronBatch:
        """Move every tensor (kwargs, nested containers, labels, masks, metadata) like ``Tensor.to``.

        A dtype (given directly or through another tensor) converts floating and complex tensors only: token
        ids, masks, cu and counts keep their dtype. The moved batch is not validated again.
        """
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)

        def move(t: torch.Tensor) -> torch.Tensor:
            if t.is_floating_point() or t.is_complex():
                return t.to(device=device, dtype=dtype, non_blocking=non_blocking)
            return t.to(device=device, non_blocking=non_blocking)

        seq = self.sequence
        moved_seq = _derive_metadata(
            seq,
            **{
                name: move(getattr(seq, name))
                for name in (
                    "global_cu_seqlens",
                    "local_cu_seqlens",
                    "seq_ids",
                    "media_counts",
                    "media_offsets",
                )
                if getattr(seq, name) is not None
            },
        )
        return _derive(
            self,
            model_kwargs={key: _map_tensors(value, move) for key, value in self.model_kwargs.items()},
            sequence=moved_seq,
            **{
                name: move(getattr(self, name))
                for name in ("labels", *_MASK_FIELDS)
                if getattr(self, name) is not None
            },
        )

    def cp_partition(self, token_indices: torch.Tensor, *, cp_rank: int, cp_size: int) -> PuzzletronBatch:
        """The tokens ``token_indices`` ``[L]`` of every row, for context-parallel rank ``cp_rank``.

        The same index vector gathers the sequence axis of every sequence-shaped tensor (see the module
        docstring), labels, masks and ``seq_ids``. Packed batches get ``local_cu_seqlens`` = cumulative local
        token counts of the global samples present (in global-id order, zero counts dropped) and
        ``max_seqlen`` = the largest local count; a flat ``cu_seqlens`` kwarg is replaced by the local cu, a
        per-row one, ``packed_token_indices`` and THD ``seq_lens*`` are rebuilt per row for the local layout,
        an int ``max_seqlen`` kwarg becomes the local max, and flash ``cu_seq_lens_q/k`` / ``max_length_q/k``
        are dropped (rebuild them with ``automodel.forward_kwargs``). Global cu and offsets stay; media stay
        whole (every rank runs the vision tower). ``puzzletron.dataset.parallel`` builds balanced indices and
        the inverse.
        """
        cp_size = _require_int(cp_size, "cp_size", minimum=1)
        cp_rank = _require_int(cp_rank, "cp_rank", minimum=0)
        if cp_rank >= cp_size:
            raise BatchValidationError(f"cp_rank must be < cp_size ({cp_size}); got {cp_rank}")
        if self.sequence.cp_size != 1:
            raise BatchValidationError(
                f"cp_partition: this batch is already CP rank {self.sequence.cp_rank} of "
                f"{self.sequence.cp_size}; partition the full batch"
            )
        idx = _check_token_indices(token_indices, self.sequence_length, self.input_ids.device)
        if cp_size == 1:
            identity = torch.arange(idx.numel(), device=idx.device)
            if idx.numel() != self.sequence_length or not bool((idx == identity).all()):
                raise BatchValidationError(
                    "token_indices: with cp_size=1 the only partition is every token in order"
                )
            return self
        mask = self.model_kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() > 2:
            raise BatchValidationError(
                f"cp_partition: cannot split a {mask.dim()}-D model_kwargs['attention_mask'] exactly; "
                "use a [B, T] mask or cu_seqlens"
            )
        seq_ids = _packed_seq_ids(self, "cp_partition")
        gathered = {path: t.index_select(dim, idx) for path, (t, dim) in _sequence_axis_tensors(self).items()}
        if seq_ids is not None:
            gathered[("seq", "seq_ids")] = seq_ids.index_select(1, idx)
        local_cu, local_max = None, None
        cu = self.sequence.global_cu_seqlens
        if cu is not None:
            counts = _segments.counts_per_sample(gathered[("seq", "seq_ids")], cu.numel() - 1)
            local_cu = _segments.cu_from_counts(counts[counts > 0])
            local_max = _segments.max_segment_length(local_cu)
        elif self.sequence.max_seqlen is not None:
            local_max = int(idx.numel())
        kwargs_updates = _cu_kwarg_updates(self, local_cu, local_max, "cp_partition")
        kwargs_updates.update(_token_layout_updates(self, gathered.get(("seq", "seq_ids")), "cp_partition"))
        return _assemble(
            self,
            gathered,
            kwargs_updates=kwargs_updates,
            sequence_updates={
                "local_cu_seqlens": local_cu,
                "max_seqlen": local_max,
                "cp_rank": cp_rank,
                "cp_size": cp_size,
            },
        )

    def dp_slice(self, *, dp_rank: int, dp_size: int) -> PuzzletronBatch:
        """Return one disjoint contiguous DP shard without duplicating samples/media.

        ``dp_size == 1`` returns ``self``. Otherwise ``B`` must divide by ``dp_size`` and rank ``r`` gets the
        ``r``-th block of ``B / dp_size`` rows with their media. One packed row (packed layout, ``B == 1``,
        cu present) is split by whole samples instead: samples are dealt contiguously, the first
        ``n % dp_size`` ranks get one more, and the rank keeps the token span of its samples with ids
        renumbered from 0 and its own cu (THD ``seq_lens*``, ``packed_token_indices`` rebuilt for the span)::

            tokens   a a a b b b c c d d d d          cu [0, 3, 6, 8, 12], dp_size 2
            rank 0   a a a b b b                      seq_ids [0,0,0,1,1,1]  cu [0, 3, 6]
            rank 1               c c d d d d          seq_ids [0,0,1,1,1,1]  cu [0, 2, 6]
        """
        dp_size = _require_int(dp_size, "dp_size", minimum=1)
        dp_rank = _require_int(dp_rank, "dp_rank", minimum=0)
        if dp_rank >= dp_size:
            raise BatchValidationError(f"dp_rank must be < dp_size ({dp_size}); got {dp_rank}")
        if dp_size == 1:
            return self
        if (
            self.layout is DataLayout.PACKED_VARLEN
            and self.batch_size == 1
            and self.sequence.global_cu_seqlens is not None
        ):
            return _dp_slice_packed_row(self, dp_rank, dp_size)
        if self.batch_size % dp_size:
            raise BatchValidationError(
                f"dp_slice: batch_size {self.batch_size} is not divisible by dp_size {dp_size}; shard "
                "samples across DP ranks in the sampler (or pad_batch_to_multiple) instead"
            )
        rows = self.batch_size // dp_size
        return _rows(self, dp_rank * rows, (dp_rank + 1) * rows)

    def pad_batch_to_multiple(self, multiple: int) -> PuzzletronBatch:
        """Append fully masked rows for a static PP schedule without copying media.

        Adds ``(-B) % multiple`` rows: kwargs padded on their batch axis with 0 (``seq_idx`` and
        ``packed_token_indices`` with -1, ``padding_mask`` with True, THD ``seq_lens*`` with -1000, a per-row
        ``cu_seqlens`` with ``[0, -1, ...]``, mRoPE ``[R, B, T]`` on dim 1, per-row counts such as
        ``n_videos_per_sample`` with 0), labels -100, masks False, ``seq_ids`` -1, ``media_counts`` 0. Media
        tensors are the same objects, global cu is untouched, flash ``cu_seq_lens_q/k`` are dropped,
        ``sample_ids`` (when given) gain ``__pp_padding_<i>``.
        """
        multiple = _require_int(multiple, "multiple", minimum=1)
        extra = (-self.batch_size) % multiple
        if extra == 0:
            return self
        seq_ids = _packed_seq_ids(self, "pad_batch_to_multiple")
        tensors = _batch_axis_tensors(self)
        if seq_ids is not None:
            tensors[("seq", "seq_ids")] = (seq_ids, 0)
        padded = {
            path: torch.cat([t, _fill_rows(path, t, dim, extra)], dim=dim)
            for path, (t, dim) in tensors.items()
        }
        kwargs_updates = {
            key: type(value)([*value, *([0] * extra)]) for key, value in _per_row_sequences(self).items()
        }
        seq_updates: dict[str, Any] = {}
        counts = self.sequence.media_counts
        if counts is not None:
            new_counts = torch.cat([counts, counts.new_zeros(extra)])
            seq_updates["media_counts"] = new_counts
            seq_updates["media_offsets"] = _segments.media_offsets_from_counts(new_counts).to(
                self.sequence.media_offsets.dtype if self.sequence.media_offsets is not None else torch.long
            )
        sample_ids = self.sample_ids
        if sample_ids:
            sample_ids = (*sample_ids, *(f"__pp_padding_{i}" for i in range(extra)))
        return _assemble(
            self, padded, kwargs_updates=kwargs_updates, sequence_updates=seq_updates, sample_ids=sample_ids
        )

    def pp_microbatches(self, n_microbatches: int) -> tuple[PuzzletronBatch, ...]:
        """Exactly ``n_microbatches`` contiguous row groups (the first ``B % n`` groups get one more row).

        Raises when ``n_microbatches > B`` (call ``pad_batch_to_multiple`` first). Each group gets its rows'
        media (per-image kwargs by media range, flat ``pixel_values`` by patch range through
        ``image_grid_thw``) and, for packed batches, re-canonicalised ``seq_ids``, cu, offsets and max (a flat
        ``cu_seqlens`` kwarg, an int ``max_seqlen`` and a ``seq_idx`` kwarg are rebuilt to match; a per-row
        ``cu_seqlens``, ``packed_token_indices``, THD ``seq_lens*`` and per-row counts are sliced with the
        rows; flash ``cu_seq_lens_q/k`` / ``max_length_q/k`` are dropped: see ``automodel.forward_kwargs``).
        """
        n = _require_int(n_microbatches, "n_microbatches", minimum=1)
        if n > self.batch_size:
            raise BatchValidationError(
                f"n_microbatches {n} exceeds batch_size {self.batch_size}: every microbatch needs a row; "
                "use pad_batch_to_multiple(n) first"
            )
        if n == 1:
            return (self,)
        base, extra = divmod(self.batch_size, n)
        bounds = [0]
        for i in range(n):
            bounds.append(bounds[-1] + base + (i < extra))
        return tuple(_rows(self, start, stop) for start, stop in pairwise(bounds))


# -- validation ---------------------------------------------------------------------------------------


def _validate(b: PuzzletronBatch) -> None:
    """Contract 3.1. Shape rules raise immediately; value rules are batched into one host sync."""
    ids = b.model_kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise BatchValidationError(f"model_kwargs['input_ids'] must be a 2-D tensor [B, T]; got {got}")
    B, T = ids.shape
    if b.sample_ids and len(b.sample_ids) != B:
        raise BatchValidationError(f"sample_ids must have B={B} entries; got {len(b.sample_ids)}")
    for name in ("labels", *_MASK_FIELDS):
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

    checks: list[tuple[torch.Tensor, str]] = []
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
        if tuple(seq_ids.shape) != (B, T) or not _is_integer_dtype(seq_ids):
            raise BatchValidationError(
                f"sequence.seq_ids must be an integer tensor [B, T] = [{B}, {T}]; "
                f"got {seq_ids.dtype} {tuple(seq_ids.shape)}"
            )
        checks.append(((seq_ids >= -1).all(), "sequence.seq_ids must be >= 0 on tokens and -1 on padding"))
        if hidden is not None:
            checks.append(((seq_ids >= 0).eq(hidden).all(), "sequence.seq_ids >= 0 must equal hidden_mask"))

    if seq.global_cu_seqlens is not None:
        _check_cu_values(b, B, T, checks)
    elif seq.local_cu_seqlens is not None:
        _check_cu_shape(seq.local_cu_seqlens, "sequence.local_cu_seqlens", minimum=1)
        checks += _increasing(seq.local_cu_seqlens, "sequence.local_cu_seqlens")

    counts = seq.media_counts
    if counts is not None:
        if counts.dim() != 1 or counts.numel() != B or not _is_integer_dtype(counts):
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

    if checks:
        # The one host sync of validation (to CPU, whichever device the checks ran on).
        device = checks[0][0].device
        ok = torch.stack([c.reshape(()).to(device) for c, _ in checks]).cpu()
        if not bool(ok.all()):
            failed = int((~ok).nonzero()[0])
            raise BatchValidationError(checks[failed][1])


def _check_cu_shape(cu: torch.Tensor, name: str, *, minimum: int) -> None:
    if cu.dim() != 1 or cu.numel() < minimum or not _is_integer_dtype(cu):
        raise BatchValidationError(
            f"{name} must be a 1-D integer tensor with at least {minimum} entries; "
            f"got {cu.dtype} {tuple(cu.shape)}"
        )


def _increasing(cu: torch.Tensor, name: str) -> list[tuple[torch.Tensor, str]]:
    checks = [(cu[0].eq(0), f"{name} must start at 0")]
    if cu.numel() > 1:
        checks.append(((cu.diff() > 0).all(), f"{name} must be strictly increasing"))
    return checks


def _check_cu_values(b: PuzzletronBatch, B: int, T: int, checks: list[tuple[torch.Tensor, str]]) -> None:
    seq = b.sequence
    cu = seq.global_cu_seqlens
    if b.layout is not DataLayout.PACKED_VARLEN:
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


def _check_token_indices(token_indices: Any, length: int, device: torch.device) -> torch.Tensor:
    idx = _require_tensor(token_indices, "token_indices")
    if idx.dim() != 1 or not _is_integer_dtype(idx):
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


# -- tensor tables ------------------------------------------------------------------------------------


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, tuple):
        return (
            type(value)(*(_map_tensors(v, fn) for v in value))
            if hasattr(value, "_fields")
            else tuple(_map_tensors(v, fn) for v in value)
        )
    return value


def _sequence_axis_tensors(b: PuzzletronBatch) -> dict[_Path, tuple[torch.Tensor, int]]:
    """Every tensor with a token axis and that axis (``seq_ids`` excluded: callers add it)."""
    out: dict[_Path, tuple[torch.Tensor, int]] = {}
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
    for name in ("labels", *_MASK_FIELDS):
        t = getattr(b, name)
        if t is not None:
            out[("field", name)] = (t, 1)
    return out


def _batch_axis_tensors(b: PuzzletronBatch) -> dict[_Path, tuple[torch.Tensor, int]]:
    """Every tensor with a batch axis and that axis (``seq_ids`` and media excluded: callers handle them)."""
    out: dict[_Path, tuple[torch.Tensor, int]] = {}
    for key in (*SEQUENCE_KWARGS, *TOKEN_INDEX_KWARGS, *ROW_KWARGS, "inputs_embeds"):
        t = b.model_kwargs.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            out[("kw", key)] = (t, 0)
    pos = b.model_kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor):
        out[("kw", "position_ids")] = (pos, pos.dim() - 2)
    cu = b.model_kwargs.get("cu_seqlens")
    if _is_per_row_cu(cu, b.batch_size):
        out[("kw", "cu_seqlens")] = (cu, 0)
    for key in PER_ROW_KWARGS:
        t = b.model_kwargs.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == b.batch_size:
            out[("kw", key)] = (t, 0)
    for name in ("labels", *_MASK_FIELDS):
        t = getattr(b, name)
        if t is not None:
            out[("field", name)] = (t, 0)
    return out


def _fill_value(path: _Path) -> Any:
    kind, name = path
    if kind == "kw":
        return _ROW_FILL.get(name, 0)
    return _FIELD_FILL[name]


def _fill_rows(path: _Path, t: torch.Tensor, dim: int, extra: int) -> torch.Tensor:
    """``extra`` padding rows shaped like ``t`` on ``dim`` (a per-row cu row is ``[0, -1, ...]``)."""
    shape = list(t.shape)
    shape[dim] = extra
    if path == ("kw", "cu_seqlens"):
        rows = torch.full(shape, -1, dtype=t.dtype, device=t.device)
        rows[:, 0] = 0
        return rows
    return torch.full(shape, _fill_value(path), dtype=t.dtype, device=t.device)


def _is_per_row_cu(cu: Any, batch_size: int) -> bool:
    """AutoModel's per-row ``cu_seqlens`` ``[B, D+1]`` (for B == 1 it equals the flat form)."""
    return isinstance(cu, torch.Tensor) and cu.dim() == 2 and cu.shape[0] == batch_size


def _per_row_sequences(b: PuzzletronBatch) -> dict[str, Sequence[Any]]:
    """``PER_ROW_KWARGS`` held as lists/tuples of B entries (tensors are in ``_batch_axis_tensors``)."""
    return {
        key: value
        for key in PER_ROW_KWARGS
        if isinstance(value := b.model_kwargs.get(key), list | tuple) and len(value) == b.batch_size
    }


def _renumbered_token_indices(t: torch.Tensor) -> torch.Tensor:
    """Row-local token positions of a new layout: ``arange(T)`` where ``t >= 0``, ``-1`` elsewhere."""
    positions = torch.arange(t.shape[-1], dtype=t.dtype, device=t.device).expand_as(t)
    return torch.where(t >= 0, positions, torch.full_like(t, -1))


# -- derived batches ----------------------------------------------------------------------------------


def _derive_metadata(seq: PackedSequenceMetadata, **changes: Any) -> PackedSequenceMetadata:
    """A copy of ``seq`` with ``changes`` (host-side checks only, like the public constructor)."""
    return dataclasses.replace(seq, **changes) if changes else seq


def _derive(b: PuzzletronBatch, **changes: Any) -> PuzzletronBatch:
    """A batch with ``changes`` applied, built WITHOUT validation: callers pass parts they derived from a
    valid batch by a rule that keeps it valid (tests re-validate every derived batch)."""
    out = object.__new__(PuzzletronBatch)
    for f in dataclasses.fields(PuzzletronBatch):
        value = changes.pop(f.name, getattr(b, f.name))
        if f.name in ("model_kwargs", "source_metadata") and not isinstance(value, types.MappingProxyType):
            value = types.MappingProxyType(dict(value))
        object.__setattr__(out, f.name, value)
    if changes:
        raise TypeError(f"unknown PuzzletronBatch fields: {sorted(changes)}")
    return out


def _unpickle_batch(state: dict[str, Any]) -> PuzzletronBatch:
    """Inverse of ``PuzzletronBatch.__reduce__`` (no validation: see there)."""
    out = object.__new__(PuzzletronBatch)
    for f in dataclasses.fields(PuzzletronBatch):
        value = state[f.name]
        if f.name in ("model_kwargs", "source_metadata"):
            value = types.MappingProxyType(dict(value))
        object.__setattr__(out, f.name, value)
    return out


def _assemble(
    b: PuzzletronBatch,
    tensors: Mapping[_Path, torch.Tensor],
    *,
    kwargs_updates: Mapping[str, Any] | None = None,
    sequence_updates: Mapping[str, Any] | None = None,
    **field_changes: Any,
) -> PuzzletronBatch:
    """Put the tensors of a ``_sequence_axis_tensors``/``_batch_axis_tensors`` table back into a batch.

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
            kwargs[key] = _renumbered_token_indices(kwargs[key])
    return _derive(
        b, model_kwargs=kwargs, sequence=_derive_metadata(b.sequence, **seq_changes), **field_changes
    )


def _packed_seq_ids(b: PuzzletronBatch, op: str) -> torch.Tensor | None:
    """``seq_ids`` of a packed batch; derived from cu for one row when absent; ``None`` when unpacked."""
    seq = b.sequence
    if seq.seq_ids is not None:
        return seq.seq_ids
    cu = seq.global_cu_seqlens
    if cu is None:
        return None
    if b.batch_size == 1 and seq.cp_size == 1:
        return _segments.seq_ids_from_cu(cu, b.sequence_length).reshape(1, -1)
    raise BatchValidationError(f"{op}: a packed batch with B > 1 needs sequence.seq_ids to align its samples")


def _cu_kwarg_updates(
    b: PuzzletronBatch, cu: torch.Tensor | None, max_seqlen: int | None, op: str
) -> dict[str, Any]:
    """Rebuilt flat ``cu_seqlens`` (1-D, or ``[1, n+1]``) and int ``max_seqlen`` kwargs.

    A per-row ``[B, D+1]`` ``cu_seqlens`` with B > 1 is left alone: row splits slice it, token splits rebuild
    it with ``_token_layout_updates``.
    """
    updates: dict[str, Any] = {}
    old = b.model_kwargs.get("cu_seqlens")
    if isinstance(old, torch.Tensor) and cu is not None:
        if old.dim() == 1:
            updates["cu_seqlens"] = cu.to(device=old.device, dtype=old.dtype)
        elif old.dim() == 2 and old.shape[0] == 1:
            updates["cu_seqlens"] = cu.to(device=old.device, dtype=old.dtype).reshape(1, -1)
        elif not _is_per_row_cu(old, b.batch_size):
            raise BatchValidationError(
                f"{op}: model_kwargs['cu_seqlens'] of shape {tuple(old.shape)} is neither flat nor per-row "
                f"[B={b.batch_size}, D+1]"
            )
    if _is_int(b.model_kwargs.get("max_seqlen")) and max_seqlen is not None:
        updates["max_seqlen"] = max_seqlen
    return updates


def _token_layout_updates(b: PuzzletronBatch, row_ids: torch.Tensor | None, op: str) -> dict[str, Any]:
    """Per-row kwargs rebuilt for a new token layout (``cp_partition``, ``dp_slice`` of a packed row, the
    inverse of CP) from its ``seq_ids`` ``row_ids`` ``[B, L]``: a per-row ``cu_seqlens`` (B > 1) and THD
    ``seq_lens``/``seq_lens_padded``, each keeping its width, dtype and device. Loop-free and sync-free."""
    kwargs = b.model_kwargs
    old_cu = kwargs.get("cu_seqlens")
    per_row_cu = _is_per_row_cu(old_cu, b.batch_size) and b.batch_size > 1
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


def _canonical_updates(
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
    kwargs_updates = _cu_kwarg_updates(b, cu, canon.max_seqlen, op)
    seq_idx = b.model_kwargs.get("seq_idx")
    if isinstance(seq_idx, torch.Tensor):
        kwargs_updates["seq_idx"] = canon.seq_ids.to(dtype=seq_idx.dtype, device=seq_idx.device)
    return canon.seq_ids.to(seq_ids.dtype), seq_updates, kwargs_updates


def _media_slices(b: PuzzletronBatch, start: int, stop: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(kwargs updates, sequence updates) giving rows ``[start, stop)`` exactly their images."""
    kwargs = b.model_kwargs
    if start == 0 and stop == b.batch_size:
        return {}, {}
    video = [k for k in VIDEO_KWARGS if _media_len(kwargs.get(k)) > 0]
    if video:
        raise BatchValidationError(
            f"cannot split video media {video} by rows: per-row video counts are not tracked; "
            "keep video batches whole (dp_size=1, one microbatch)"
        )
    counts = b.sequence.media_counts
    image_keys = [k for k in ("pixel_values", *PER_IMAGE_KWARGS) if k in kwargs and kwargs[k] is not None]
    if counts is None:
        if any(_media_len(kwargs[k]) > 0 for k in image_keys):
            raise BatchValidationError(
                "cannot split image media by rows without sequence.media_counts (images per row)"
            )
        return {}, {}
    offsets = _segments.media_offsets_from_counts(counts).tolist()
    m0, m1 = offsets[start], offsets[stop]
    updates: dict[str, Any] = {}
    for key in PER_IMAGE_KWARGS:
        if key in kwargs and kwargs[key] is not None:
            updates[key] = kwargs[key][m0:m1]
    pixels = kwargs.get("pixel_values")
    if pixels is not None:
        total = offsets[-1]
        grid = kwargs.get("image_grid_thw")
        if not isinstance(pixels, torch.Tensor) or pixels.shape[0] == total:
            updates["pixel_values"] = pixels[m0:m1]
        elif isinstance(grid, torch.Tensor):
            patches = _segments.patch_offsets_from_grid(grid).tolist()
            if patches[-1] != pixels.shape[0]:
                raise BatchValidationError(
                    f"pixel_values has {pixels.shape[0]} rows but image_grid_thw describes {patches[-1]} "
                    f"patches of {total} images"
                )
            updates["pixel_values"] = pixels[patches[m0] : patches[m1]]
        else:
            raise BatchValidationError(
                f"cannot align flat pixel_values without image_grid_thw ({pixels.shape[0]} rows for "
                f"{total} images)"
            )
    new_counts = counts[start:stop]
    seq_updates = {
        "media_counts": new_counts,
        "media_offsets": _segments.media_offsets_from_counts(new_counts).to(
            b.sequence.media_offsets.dtype if b.sequence.media_offsets is not None else torch.long
        ),
    }
    return updates, seq_updates


def _media_len(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else 1
    try:
        return len(value)
    except TypeError:
        return 1


def _rows(b: PuzzletronBatch, start: int, stop: int) -> PuzzletronBatch:
    """Rows ``[start, stop)`` with their media; packed ids re-canonicalised."""
    if b.layout is DataLayout.PACKED_VARLEN and b.sequence.cp_size > 1:
        raise BatchValidationError(
            "cannot split the rows of a CP-partitioned packed batch; "
            "call dp_slice/pp_microbatches before cp_partition"
        )
    seq_ids = _packed_seq_ids(b, "row split")
    sliced = {path: t.narrow(dim, start, stop - start) for path, (t, dim) in _batch_axis_tensors(b).items()}
    kwargs_updates, seq_updates = _media_slices(b, start, stop)
    kwargs_updates.update({key: value[start:stop] for key, value in _per_row_sequences(b).items()})
    if seq_ids is not None:
        ids, canon_seq, canon_kwargs = _canonical_updates(b, seq_ids[start:stop], "row split")
        sliced[("seq", "seq_ids")] = ids
        seq_updates.update(canon_seq if b.sequence.global_cu_seqlens is not None else {})
        kwargs_updates.update(canon_kwargs if b.sequence.global_cu_seqlens is not None else {})
    return _assemble(
        b,
        sliced,
        kwargs_updates=kwargs_updates,
        sequence_updates=seq_updates,
        sample_ids=b.sample_ids[start:stop],
    )


def _dp_slice_packed_row(b: PuzzletronBatch, dp_rank: int, dp_size: int) -> PuzzletronBatch:
    seq = b.sequence
    if seq.cp_size > 1:
        raise BatchValidationError("dp_slice: slice the packed row before cp_partition, not after")
    counts = seq.media_counts
    media_keys = [
        k for k in ("pixel_values", *PER_IMAGE_KWARGS, *VIDEO_KWARGS) if _media_len(b.model_kwargs.get(k))
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
    seq_ids = _packed_seq_ids(b, "dp_slice")
    # Canonical ids are numbered in token order, so samples [first, last) occupy one span of the row: from
    # the first token of `first` to the last token of `last - 1` (padding before or after it is dropped).
    row = seq_ids[0]
    positions = torch.nonzero((row >= first) & (row < last)).reshape(-1)
    tok0, tok1 = int(positions[0]), int(positions[-1]) + 1
    span = tok1 - tok0
    sliced: dict[_Path, torch.Tensor] = {}
    for path, (t, dim) in _sequence_axis_tensors(b).items():
        if path == ("kw", "attention_mask") and t.dim() == 4:
            t = t.narrow(2, tok0, span)  # [B, 1, T, T] block mask: query and key axes both
        sliced[path] = t.narrow(dim, tok0, span)
    row_ids = seq_ids.narrow(1, tok0, span)
    new_ids = torch.where(row_ids >= 0, row_ids - first, row_ids)
    sliced[("seq", "seq_ids")] = new_ids
    new_cu = (cu[first : last + 1] - cu[first]).to(cu.dtype)
    new_max = _segments.max_segment_length(new_cu)
    kwargs_updates = _cu_kwarg_updates(b, new_cu, new_max, "dp_slice")
    seq_idx = b.model_kwargs.get("seq_idx")
    if isinstance(seq_idx, torch.Tensor):
        kwargs_updates["seq_idx"] = new_ids.to(dtype=seq_idx.dtype, device=seq_idx.device)
    kwargs_updates.update(_token_layout_updates(b, new_ids, "dp_slice"))
    sample_id = b.sample_ids[0] if b.sample_ids else "packed-row"
    return _assemble(
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

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
images each row owns. Videos work alike: ``video_grid_thw`` and ``second_per_grid_ts`` have one row per
video, ``pixel_values_videos`` one entry per video or the flat patches (through ``video_grid_thw``), and
``model_kwargs["n_videos_per_sample"]`` (or ``num_videos_per_sample``) ``[B]`` says how many videos each
row owns; a row split of a batch with videos needs it. Media stay whole under ``cp_partition`` (every rank
runs the vision tower). Any other tensor kwarg is passed through *unchanged* by every row or token operation.

Validation runs once, in ``__init__``: shape rules on the host, value rules as tensor reductions stacked
into one boolean vector and read with a single host sync (so a batch built on an accelerator costs one sync,
not one per rule). Batches derived by ``to``, ``cp_partition``, ``dp_slice``, ``pp_microbatches`` and
``pad_batch_to_multiple`` are built from already valid parts through a private path that does not validate
again. ``fingerprint`` (SHA-256 of the content) is computed on first access only and cached.

Layout of the code: this module holds the types and the methods as thin shells (argument checks, layout
decisions); ``_validation`` runs the construction rules, ``_batch_ops`` does the tensor plumbing, and
``_batch_keys`` holds the known-key tables re-exported here.

Equality and hashing are by content: ``a == b`` iff their fingerprints are equal, ``hash(a)`` hashes the
fingerprint. Both therefore hash every tensor on first use (a device-to-host copy on an accelerator). They
never raise: a batch holding a value with no canonical encoding (where ``fingerprint`` is a ``TypeError``)
is equal only to itself and hashes by identity.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import pairwise
from typing import Any

import torch

from puzzletron.dataset import _batch_ops, _validation
from puzzletron.dataset._batch_keys import (
    FLAT_BACKEND_KWARGS,
    PER_IMAGE_KWARGS,
    PER_ROW_KWARGS,
    PER_VIDEO_KWARGS,
    ROW_KWARGS,
    SEQUENCE_KWARGS,
    THD_SENTINEL,
    TOKEN_INDEX_KWARGS,
    VIDEO_COUNT_KWARGS,
    VIDEO_KWARGS,
)
from puzzletron.dataset._fingerprint import fingerprint_of
from puzzletron.dataset._validation import coerce_enum, require_int, require_tensor
from puzzletron.dataset.errors import BatchValidationError

__all__ = [
    "FLAT_BACKEND_KWARGS",
    "PER_IMAGE_KWARGS",
    "PER_ROW_KWARGS",
    "PER_VIDEO_KWARGS",
    "ROW_KWARGS",
    "SEQUENCE_KWARGS",
    "THD_SENTINEL",
    "TOKEN_INDEX_KWARGS",
    "VIDEO_COUNT_KWARGS",
    "VIDEO_KWARGS",
    "DataLayout",
    "Modality",
    "PackedSequenceMetadata",
    "PuzzletronBatch",
]


class DataLayout(str, Enum):
    """How the tokens of a batch are laid out: ``[B, T]`` rows of one sample each, or packed samples."""

    FIXED = "fixed"
    PADDED_VARLEN = "padded_varlen"
    PACKED_VARLEN = "packed_varlen"


class Modality(str, Enum):
    TEXT = "text"
    MULTIMODAL = "multimodal"


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
                require_tensor(value, f"sequence.{name}")
        if self.max_seqlen is not None:
            require_int(self.max_seqlen, "sequence.max_seqlen", minimum=0)
        cp_size = require_int(self.cp_size, "sequence.cp_size", minimum=1)
        cp_rank = require_int(self.cp_rank, "sequence.cp_rank", minimum=0)
        if cp_rank >= cp_size:
            raise BatchValidationError(f"sequence.cp_rank must be < cp_size ({cp_size}); got {cp_rank}")
        raw = self.sample_offsets
        if isinstance(raw, torch.Tensor):  # [n, 2]: one host read, not one per entry
            raw = raw.tolist()
        try:
            offsets = tuple((operator.index(a), operator.index(b)) for a, b in raw)
        except (TypeError, ValueError):
            raise BatchValidationError(
                f"sequence.sample_offsets must be pairs of ints (start, stop); got {self.sample_offsets!r}"
            ) from None
        object.__setattr__(self, "sample_offsets", offsets)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedSequenceMetadata):
            return NotImplemented
        return _content_equal(self, other, fingerprint_of)

    def __hash__(self) -> int:
        return _content_hash(self, fingerprint_of)


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
        object.__setattr__(self, "modality", coerce_enum(Modality, self.modality, "modality"))
        object.__setattr__(self, "layout", coerce_enum(DataLayout, self.layout, "layout"))
        object.__setattr__(self, "sample_ids", tuple(str(s) for s in self.sample_ids))
        object.__setattr__(self, "model_kwargs", types.MappingProxyType(dict(self.model_kwargs)))
        object.__setattr__(self, "source_metadata", types.MappingProxyType(dict(self.source_metadata)))
        _validation.validate(self, packed=self.layout is DataLayout.PACKED_VARLEN)

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
        return _content_equal(self, other, operator.attrgetter("fingerprint"))

    def __hash__(self) -> int:
        return _content_hash(self, operator.attrgetter("fingerprint"))

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
        ids, masks, cu and counts keep their dtype. ``copy=True`` copies tensors that need not move. The moved
        batch is not validated again.
        """
        copy = bool(kwargs.pop("copy", False))
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        return _batch_ops.moved(self, device, dtype, non_blocking, copy=copy)

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
        cp_size = require_int(cp_size, "cp_size", minimum=1)
        cp_rank = require_int(cp_rank, "cp_rank", minimum=0)
        if cp_rank >= cp_size:
            raise BatchValidationError(f"cp_rank must be < cp_size ({cp_size}); got {cp_rank}")
        if self.sequence.cp_size != 1:
            raise BatchValidationError(
                f"cp_partition: this batch is already CP rank {self.sequence.cp_rank} of "
                f"{self.sequence.cp_size}; partition the full batch"
            )
        idx = _validation.check_token_indices(token_indices, self.sequence_length, self.input_ids.device)
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
        return _batch_ops.token_partition(self, idx, cp_rank, cp_size)

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
        dp_size = require_int(dp_size, "dp_size", minimum=1)
        dp_rank = require_int(dp_rank, "dp_rank", minimum=0)
        if dp_rank >= dp_size:
            raise BatchValidationError(f"dp_rank must be < dp_size ({dp_size}); got {dp_rank}")
        if dp_size == 1:
            return self
        if (
            self.layout is DataLayout.PACKED_VARLEN
            and self.batch_size == 1
            and self.sequence.global_cu_seqlens is not None
        ):
            return _batch_ops.dp_slice_packed_row(self, dp_rank, dp_size)
        if self.batch_size % dp_size:
            raise BatchValidationError(
                f"dp_slice: batch_size {self.batch_size} is not divisible by dp_size {dp_size}; shard "
                "samples across DP ranks in the sampler (or pad_batch_to_multiple) instead"
            )
        rows = self.batch_size // dp_size
        return self._rows(dp_rank * rows, (dp_rank + 1) * rows)

    def pad_batch_to_multiple(self, multiple: int) -> PuzzletronBatch:
        """Append fully masked rows for a static PP schedule without copying media.

        Adds ``(-B) % multiple`` rows: kwargs padded on their batch axis with 0 (``seq_idx`` and
        ``packed_token_indices`` with -1, ``padding_mask`` with True, THD ``seq_lens*`` with -1000, a per-row
        ``cu_seqlens`` with ``[0, -1, ...]``, mRoPE ``[R, B, T]`` on dim 1, per-row counts such as
        ``n_videos_per_sample`` with 0), labels -100, masks False, ``seq_ids`` -1, ``media_counts`` 0. Media
        tensors are the same objects, global cu is untouched, flash ``cu_seq_lens_q/k`` are dropped,
        ``sample_ids`` (when given) gain ``__pp_padding_<i>``.
        """
        multiple = require_int(multiple, "multiple", minimum=1)
        extra = (-self.batch_size) % multiple
        if extra == 0:
            return self
        return _batch_ops.padded(self, extra)

    def pp_microbatches(self, n_microbatches: int) -> tuple[PuzzletronBatch, ...]:
        """Exactly ``n_microbatches`` contiguous row groups (the first ``B % n`` groups get one more row).

        Raises when ``n_microbatches > B`` (call ``pad_batch_to_multiple`` first). Each group gets its rows'
        media (per-image kwargs by media range, flat ``pixel_values`` by patch range through
        ``image_grid_thw``) and, for packed batches, re-canonicalised ``seq_ids``, cu, offsets and max (a flat
        ``cu_seqlens`` kwarg, an int ``max_seqlen`` and a ``seq_idx`` kwarg are rebuilt to match; a per-row
        ``cu_seqlens``, ``packed_token_indices``, THD ``seq_lens*`` and per-row counts are sliced with the
        rows; flash ``cu_seq_lens_q/k`` / ``max_length_q/k`` are dropped: see ``automodel.forward_kwargs``).
        """
        n = require_int(n_microbatches, "n_microbatches", minimum=1)
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
        return tuple(self._rows(start, stop) for start, stop in pairwise(bounds))

    def _rows(self, start: int, stop: int) -> PuzzletronBatch:
        """Rows ``[start, stop)`` with their media (packed ids re-canonicalised)."""
        if self.layout is DataLayout.PACKED_VARLEN and self.sequence.cp_size > 1:
            raise BatchValidationError(
                "cannot split the rows of a CP-partitioned packed batch; "
                "call dp_slice/pp_microbatches before cp_partition"
            )
        return _batch_ops.rows(self, start, stop)


_NO_CONTENT_KEY = object()  # cached: this object holds a value without a canonical encoding


def _content_key(obj: Any, fingerprint: Callable[[Any], str]) -> str | None:
    """The fingerprint of ``obj``, or ``None`` when it holds a value with no canonical encoding.

    ``fingerprint`` itself raises ``TypeError`` then (a ``repr()`` would make it meaningless), but ``==`` and
    ``hash`` must never crash: such an object compares by identity instead. The failure is cached so repeated
    comparisons do not hash its tensors again (``derive`` and unpickling copy fields only, never this cache).
    """
    key = obj.__dict__.get("_content_key", None)
    if key is None:
        try:
            key = fingerprint(obj)
        except TypeError:
            key = _NO_CONTENT_KEY
        object.__setattr__(obj, "_content_key", key)
    return None if key is _NO_CONTENT_KEY else key


def _content_equal(a: Any, b: Any, fingerprint: Callable[[Any], str]) -> bool:
    """By content fingerprint; by identity when either side has no canonical encoding."""
    if a is b:
        return True
    key_a, key_b = _content_key(a, fingerprint), _content_key(b, fingerprint)
    return key_a is not None and key_a == key_b


def _content_hash(obj: Any, fingerprint: Callable[[Any], str]) -> int:
    """Consistent with `_content_equal`: equal fingerprints hash alike, identity-only objects by id."""
    key = _content_key(obj, fingerprint)
    return hash(key) if key is not None else object.__hash__(obj)


def _unpickle_batch(state: dict[str, Any]) -> PuzzletronBatch:
    """Inverse of ``PuzzletronBatch.__reduce__`` (no validation: see there)."""
    out = object.__new__(PuzzletronBatch)
    for f in dataclasses.fields(PuzzletronBatch):
        value = state[f.name]
        if f.name in ("model_kwargs", "source_metadata"):
            value = types.MappingProxyType(dict(value))
        object.__setattr__(out, f.name, value)
    return out

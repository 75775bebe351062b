"""`PuzzletronBatch`: the one model-input contract shared by Puzzletron stages, and its exact splits.

A batch holds ``model_kwargs`` (whatever the model forward takes; ``input_ids`` ``[B, T]`` is required),
token-level targets (``labels``, ``ce_mask``, ``kd_mask``, ``hidden_mask``, all ``[B, T]``; labels already
shifted, AutoModel's convention), the packing and media boundaries in `PackedSequenceMetadata`, and
provenance (``sample_ids``, ``source_metadata``). The rules are in ``docs/batch-contract.md``; which kwargs
carry a batch or a token axis is the table in `_keys`.

Validation runs once, in ``__init__`` (`_validation`: one host sync whatever the batch's size). Batches
derived by ``to``, ``cp_partition``, ``dp_slice``, ``pp_microbatches`` and ``pad_batch_to_multiple`` are
built from already valid parts by `_splits` without validating again. ``fingerprint`` (SHA-256 of the
content) is computed on first access only and cached. Backend kwargs over the flattened batch (HF flash
``cu_seq_lens_q/k``, ``max_length_q/k``) are dropped by every split:
`puzzletron.dataset.clients.attention` derives them from ``seq_ids``.

Equality and hashing are by content: ``a == b`` iff their fingerprints are equal, ``hash(a)`` hashes the
fingerprint. Both therefore hash every tensor on first use (a device-to-host copy on an accelerator). They
never raise: a batch holding a value with no canonical encoding (where ``fingerprint`` is a ``TypeError``)
is equal only to itself and hashes by identity.
"""

from __future__ import annotations

import dataclasses
import operator
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch

from puzzletron.dataset._checks import coerce_enum, require_int, require_rank
from puzzletron.dataset._enums import DataLayout, Modality
from puzzletron.dataset.batch import _splits, _validation
from puzzletron.dataset.batch._fingerprint import content_equal, content_hash, fingerprint_of
from puzzletron.dataset.batch._keys import PER_IMAGE_KWARGS, VIDEO_KWARGS
from puzzletron.dataset.batch._metadata import PackedSequenceMetadata
from puzzletron.dataset.batch._tables import from_fields
from puzzletron.dataset.errors import BatchValidationError

__all__ = ["MAX_PAD_BYTES", "MAX_PAD_MULTIPLE", "MAX_PAD_TOKENS", "PuzzletronBatch", "token_targets"]

# A pipeline schedule pads to its microbatch count; anything this large is a mistake, not a schedule (and
# 2**40 padding rows would be an allocation failure deep inside torch).
MAX_PAD_MULTIPLE = 2**16
# The padding rows' tokens one call may add (about 20 bytes a token over labels, masks and kwargs: ~300 MB):
# a multiple that would pad 2 x 4,096 tokens to 2**16 rows is refused before anything is allocated.
MAX_PAD_TOKENS = 2**24
# ... and the bytes they may take: tokens alone do not bound them (2**16 rows of inputs_embeds [256, 1024]
# are 2**24 tokens and 68 GB), so the padding's bytes, counted over every tensor it grows, are bounded too.
MAX_PAD_BYTES = 2**30
_MEDIA_KWARGS = frozenset({"pixel_values", *PER_IMAGE_KWARGS, *VIDEO_KWARGS})  # never padded


@dataclass(frozen=True, eq=False)
class PuzzletronBatch:
    """The only model-input contract shared by Puzzletron stages.

    The batch remains backend-neutral: descriptor/stage adapters decide which validated model_kwargs are
    consumed by a particular model forward.

    Shapes: ``model_kwargs["input_ids"]`` ``[B, T]``; ``labels``/``ce_mask``/``kd_mask``/``hidden_mask``
    ``[B, T]``; see `_keys` for the other kwargs. ``model_kwargs`` and ``source_metadata`` are
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
        object.__setattr__(
            self, "modality", coerce_enum(Modality, self.modality, "modality", error=BatchValidationError)
        )
        object.__setattr__(
            self, "layout", coerce_enum(DataLayout, self.layout, "layout", error=BatchValidationError)
        )
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

    @property
    def fingerprint(self) -> str:
        """SHA-256 hex digest of the content; computed on first access (tensors copied to host then) and
        cached with every tensor's in-place version counter: a tensor changed in place after that (the
        cached digest would be of other content) is a `BatchValidationError` naming it on every later read
        (``docs/batch-contract.md``, "Fingerprint")."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            cached = (fingerprint_of(fields, where="PuzzletronBatch"), _validation.tensor_versions(self))
            object.__setattr__(self, "_fingerprint", cached)
        self._unchanged()
        return cached[0]

    def _unchanged(self) -> None:
        """`BatchValidationError` naming the first tensor changed in place since the fingerprint was read
        (nothing when it was not read: no hashing here, only the tensors' version counters)."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            return
        versions = _validation.tensor_versions(self)
        if cached[1] != versions:
            changed = next(name for (name, v), (_, w) in zip(cached[1], versions, strict=True) if v != w)
            raise BatchValidationError(
                f"{changed} was changed in place after the batch's fingerprint was read; a batch's tensors "
                "are not to be mutated (build a new batch: replace_model_kwargs, or clone before editing)"
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PuzzletronBatch):
            return NotImplemented
        self._unchanged()
        other._unchanged()
        return content_equal(self, other, operator.attrgetter("fingerprint"))

    def __hash__(self) -> int:
        self._unchanged()
        return content_hash(self, operator.attrgetter("fingerprint"))

    def __reduce__(self) -> tuple[Callable[..., PuzzletronBatch], tuple[type, dict[str, Any]]]:
        """Pickle support (DataLoader workers return batches): the fields, mappings as plain dicts.

        Unpickling rebuilds the read-only mappings without validating again (the batch was valid when it
        was pickled; pickles are trusted input anyway) and without the cached fingerprint, which is
        recomputed on first access and equals the original one.
        """
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        state["model_kwargs"] = dict(self.model_kwargs)
        state["source_metadata"] = dict(self.source_metadata)
        return (from_fields, (type(self), state))

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
        return _splits.moved(self, device, dtype, non_blocking, copy=copy)

    def cp_partition(self, token_indices: torch.Tensor, *, cp_rank: int, cp_size: int) -> PuzzletronBatch:
        """The tokens ``token_indices`` ``[L]`` of every row, for context-parallel rank ``cp_rank``.

        The same index vector gathers the sequence axis of every sequence-shaped tensor (see `_keys`),
        labels, masks and ``seq_ids``. Packed batches get ``local_cu_seqlens`` = cumulative local token
        counts of the global samples present (in global-id order, zero counts dropped) and ``max_seqlen`` =
        the largest local count; a flat ``cu_seqlens`` kwarg is replaced by the local cu, a per-row one,
        ``packed_token_indices`` and THD ``seq_lens*`` are rebuilt per row for the local layout, an int
        ``max_seqlen`` kwarg becomes the local max, and flash ``cu_seq_lens_q/k`` / ``max_length_q/k`` are
        dropped (rebuild them with ``attention.forward_kwargs``). Global cu and offsets stay; media stay
        whole (every rank runs the vision tower). ``puzzletron.dataset.batch.cp`` builds balanced indices
        and the inverse.
        """
        cp_rank = require_rank(
            cp_rank, cp_size, rank_name="cp_rank", size_name="cp_size", error=BatchValidationError
        )
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
        return _splits.token_partition(self, idx, cp_rank, cp_size)

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
        dp_rank = require_rank(
            dp_rank, dp_size, rank_name="dp_rank", size_name="dp_size", error=BatchValidationError
        )
        if dp_size == 1:
            return self
        if (
            self.layout is DataLayout.PACKED_VARLEN
            and self.batch_size == 1
            and self.sequence.global_cu_seqlens is not None
        ):
            return _splits.dp_slice_packed_row(self, dp_rank, dp_size)
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
        ``sample_ids`` (when given) gain ``__pp_padding_<i>``. Padding of more than `MAX_PAD_TOKENS` tokens
        or `MAX_PAD_BYTES` bytes (over every tensor it grows) is refused before anything is allocated.
        """
        multiple = require_int(
            multiple, "multiple", minimum=1, maximum=MAX_PAD_MULTIPLE, error=BatchValidationError
        )
        extra = (-self.batch_size) % multiple
        if extra == 0:
            return self
        if extra * self.sequence_length > MAX_PAD_TOKENS:
            raise BatchValidationError(
                f"pad_batch_to_multiple({multiple}) would add {extra} rows of {self.sequence_length} tokens "
                f"({extra * self.sequence_length} > MAX_PAD_TOKENS = {MAX_PAD_TOKENS}); a pipeline schedule "
                "pads to its microbatch count"
            )
        kwargs = [t for k, t in self.model_kwargs.items() if k not in _MEDIA_KWARGS]
        targets = [self.labels, self.ce_mask, self.kd_mask, self.hidden_mask, self.sequence.seq_ids]
        grown = [t for t in (*kwargs, *targets) if isinstance(t, torch.Tensor)]
        row_bytes = sum(t.numel() * t.element_size() for t in grown) // max(self.batch_size, 1)
        if extra * row_bytes > MAX_PAD_BYTES:
            raise BatchValidationError(
                f"pad_batch_to_multiple({multiple}) would add {extra} rows of {row_bytes} bytes "
                f"({extra * row_bytes} > MAX_PAD_BYTES = {MAX_PAD_BYTES}); a pipeline schedule pads to its "
                "microbatch count"
            )
        return _splits.padded(self, extra)

    def pp_microbatches(self, n_microbatches: int) -> tuple[PuzzletronBatch, ...]:
        """Exactly ``n_microbatches`` contiguous row groups (the first ``B % n`` groups get one more row).

        Raises when ``n_microbatches > B`` (call ``pad_batch_to_multiple`` first). Each group gets its rows'
        media (per-image kwargs by media range, flat ``pixel_values`` by patch range through
        ``image_grid_thw``) and, for packed batches, re-canonicalised ``seq_ids``, cu, offsets and max (a flat
        ``cu_seqlens`` kwarg, an int ``max_seqlen`` and a ``seq_idx`` kwarg are rebuilt to match; a per-row
        ``cu_seqlens``, ``packed_token_indices``, THD ``seq_lens*`` and per-row counts are sliced with the
        rows; flash ``cu_seq_lens_q/k`` / ``max_length_q/k`` are dropped: see ``attention.forward_kwargs``).
        """
        n = require_int(n_microbatches, "n_microbatches", minimum=1, error=BatchValidationError)
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
        return _splits.rows(self, start, stop)


def token_targets(
    labels: torch.Tensor | None, ce_mask: torch.Tensor, valid: torch.Tensor
) -> dict[str, torch.Tensor | None]:
    """The four target fields as every builder fills them: ``labels``, ``ce_mask``, ``kd_mask`` starting as
    a copy of ``ce_mask`` (a distillation stage may narrow it independently), ``hidden_mask`` = the valid
    tokens. Each ``[B, T]``; pass the result as ``PuzzletronBatch(..., **token_targets(...))``."""
    return {"labels": labels, "ce_mask": ce_mask, "kd_mask": ce_mask.clone(), "hidden_mask": valid}

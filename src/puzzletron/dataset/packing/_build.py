"""Rows of tokenised samples -> a text `PuzzletronBatch` in one of the three layouts.

`build_batch` reads its samples through the `SampleSource` protocol: `TokenizedSamples` holds every sample
flat in memory (ids, shifted labels, offsets); a token store reads only the samples a batch holds. Tokens
of every row are gathered with one ragged gather and scattered into ``[B, T]`` tensors, so building a batch
costs O(tokens of the batch), with no per-token or per-sample Python loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from puzzletron.dataset.batch import (
    IGNORE_INDEX,
    DataLayout,
    Modality,
    PackedSequenceMetadata,
    PuzzletronBatch,
    token_targets,
)
from puzzletron.dataset.batch._segments import canonical_packed_ids
from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.errors import PackingError
from puzzletron.dataset.packing._units import Units

__all__ = ["SampleSource", "TokenizedSamples", "build_batch", "ragged"]


class SampleSource(Protocol):
    """Tokenised samples as `build_batch` reads them."""

    @property
    def lengths(self) -> np.ndarray:
        """``[n]`` tokens per sample."""
        ...

    def __len__(self) -> int: ...

    def names(self, indices: np.ndarray) -> list[str]:
        """The sample ids of ``indices``."""
        ...

    def gather(
        self, indices: np.ndarray, starts: np.ndarray, takes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, labels)`` int64 of tokens ``[starts[k], starts[k] + takes[k])`` of sample
        ``indices[k]``, concatenated. Labels are shifted and true: a span that stops inside its sample keeps
        the label of its last token (the next token's id where supervised)."""
        ...


@dataclass(frozen=True, eq=False)
class TokenizedSamples:
    """Tokenised samples, flat: sample ``i`` is ``input_ids[offsets[i]:offsets[i + 1]]``.

    ``labels`` are already shifted (``labels[t]`` is the target of ``input_ids[t]``, i.e. the next token
    where supervised) and ``-100`` elsewhere; the last token of every sample is ``-100`` (no target crosses
    a document boundary). Arrays are read-only ``int64``: ``input_ids``/``labels`` ``[total_tokens]``,
    ``offsets`` ``[n + 1]``.
    """

    input_ids: np.ndarray = field(repr=False)
    labels: np.ndarray = field(repr=False)
    offsets: np.ndarray = field(repr=False)
    sample_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        ids, labels, offsets = (
            np.asarray(a, dtype=np.int64) for a in (self.input_ids, self.labels, self.offsets)
        )
        n = offsets.shape[0] - 1
        if ids.ndim != 1 or labels.shape != ids.shape:
            raise PackingError(
                f"input_ids and labels must be 1-D and equal, got {ids.shape} and {labels.shape}"
            )
        if n < 0 or offsets[0] != 0 or offsets[-1] != ids.shape[0] or np.any(np.diff(offsets) <= 0):
            raise PackingError("offsets must start at 0, increase strictly and end at the token count")
        if len(self.sample_ids) != n:
            raise PackingError(f"sample_ids has {len(self.sample_ids)} entries for {n} samples")
        open_ends = np.flatnonzero(labels[offsets[1:] - 1] != IGNORE_INDEX)
        if open_ends.size:
            i = int(open_ends[0])
            raise PackingError(
                f"labels of sample {i} ({self.sample_ids[i]!r}) end with a target; the last token of a "
                "sample must be -100 (labels are shifted: nothing follows it)"
            )
        for name, arr in (("input_ids", ids), ("labels", labels), ("offsets", offsets)):
            arr = arr.copy() if arr is getattr(self, name) else arr
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "sample_ids", tuple(str(s) for s in self.sample_ids))

    @classmethod
    def from_lists(
        cls,
        input_ids: Sequence[Sequence[int]],
        labels: Sequence[Sequence[int]],
        *,
        sample_ids: Sequence[str] | None = None,
    ) -> TokenizedSamples:
        """Build from per-sample token lists (``labels`` already shifted, same lengths)."""
        if len(labels) != len(input_ids):
            raise PackingError(f"{len(labels)} label lists for {len(input_ids)} samples")
        lengths = np.fromiter((len(x) for x in input_ids), dtype=np.int64, count=len(input_ids))
        bad = np.flatnonzero(
            lengths != np.fromiter((len(x) for x in labels), dtype=np.int64, count=len(labels))
        )
        if bad.size:
            raise PackingError(f"sample {int(bad[0])}: labels and input_ids differ in length")
        flat = np.fromiter((t for x in input_ids for t in x), dtype=np.int64, count=int(lengths.sum()))
        flat_labels = np.fromiter((t for x in labels for t in x), dtype=np.int64, count=int(lengths.sum()))
        ids = tuple(sample_ids) if sample_ids is not None else tuple(str(i) for i in range(len(input_ids)))
        return cls(flat, flat_labels, np.concatenate([[0], np.cumsum(lengths)]), ids)

    def __len__(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def lengths(self) -> np.ndarray:
        """``[n]`` tokens per sample."""
        return np.diff(self.offsets)

    def names(self, indices: np.ndarray) -> list[str]:
        return [self.sample_ids[i] for i in indices.tolist()]

    def gather(
        self, indices: np.ndarray, starts: np.ndarray, takes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        slot, position = ragged(takes)
        src = (self.offsets[indices] + starts)[slot] + position
        return self.input_ids[src], self.labels[src]


def ragged(takes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For spans of ``takes`` ``[k]`` tokens laid end to end: each token's span and its position in it.

    >>> [a.tolist() for a in ragged(np.array([2, 3]))]
    [[0, 0, 1, 1, 1], [0, 1, 0, 1, 2]]
    """
    slot = np.repeat(np.arange(takes.shape[0], dtype=np.int64), takes)
    before = np.cumsum(takes) - takes  # [k] first output token of each span
    return slot, np.arange(slot.shape[0], dtype=np.int64) - before[slot]


def _check_rows(rows: Sequence[Sequence[int]], n: int) -> tuple[np.ndarray, np.ndarray]:
    counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    order = np.fromiter((int(i) for r in rows for i in r), dtype=np.int64, count=int(counts.sum()))
    if order.size and (order.min() < 0 or order.max() >= n):
        bad = int(order[(order < 0) | (order >= n)][0])
        raise PackingError(f"row refers to sample {bad}, outside 0..{n - 1}")
    if np.unique(order).shape[0] != order.shape[0]:
        raise PackingError("a sample appears twice in the rows of one batch")
    return order, counts


def build_batch(
    samples: SampleSource,
    rows: Sequence[Sequence[int]],
    *,
    spec: PuzzletronDataSpec,
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    source_metadata: Mapping[str, Any] | None = None,
    units: Units | None = None,
) -> PuzzletronBatch:
    """Build a text `PuzzletronBatch` ``[B = len(rows), T]`` from rows of sample indices, in ``spec.layout``.

    An empty row is a fully masked padding row (the sampler's uneven tail). Layouts:

    - ``packed_varlen``: each row holds its samples back to back, ``T = pack_size``; ``seq_ids`` (global,
      row-major, ``-1`` on padding), ``global_cu_seqlens`` over valid tokens, ``position_ids`` restarting
      at 0 per sample; no ``attention_mask`` (use cu/``seq_ids``). A row over ``pack_size`` is an error.
    - ``padded_varlen``: one sample per row, right padding to the longest sample rounded up to
      ``pad_to_multiple_of``; samples longer than ``max_sample_length`` are truncated to it.
    - ``fixed``: one sample per row, ``T = max_sample_length``: shorter samples are right padded, longer
      ones truncated to their first ``T`` tokens (their labels stay the true next tokens).

    Labels are ``-100`` on padding; ``ce_mask = labels != -100``, ``kd_mask`` a copy of it, ``hidden_mask``
    the valid tokens. ``sample_ids`` has one entry per row (the row's sample ids joined by ``"|"``,
    ``"__padding_<r>"`` for a padding row); ``source_metadata["document_ids"]`` lists every sample id in
    ``seq_ids`` order. With ``units`` (a plan's cut long samples) the rows index units, each packed as a
    document of its own whose last label is -100.
    """
    layout = DataLayout(spec.layout)
    if pad_to_multiple_of < 1:
        raise PackingError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    order, counts = _check_rows(rows, len(samples) if units is None else len(units))
    n_rows = len(rows)
    if units is None:
        sample_of, starts = order, np.zeros_like(order)
        lengths = samples.lengths[order].astype(np.int64)  # a store's index is uint32
    else:
        sample_of, starts, lengths = units.sample[order], units.start[order], units.length[order]

    def unit_names(indices: np.ndarray) -> list[str]:
        names = samples.names(sample_of[indices])
        return names if units is None else units.names(order[indices], names)

    if layout is DataLayout.PACKED_VARLEN:
        if spec.packing is None:
            raise PackingError("data.packing is required for the packed_varlen layout")
        width = int(spec.packing.pack_size)
        take = lengths
        row_of_sample = np.repeat(np.arange(n_rows, dtype=np.int64), counts)
        row_tokens = np.bincount(row_of_sample, weights=take, minlength=n_rows).astype(np.int64)
        over = np.flatnonzero(row_tokens > width)
        if over.size:
            r = int(over[0])
            names = unit_names(np.flatnonzero(row_of_sample == r))
            raise PackingError(
                f"row {r} holds {int(row_tokens[r])} tokens > pack_size {width}: samples {names}"
            )
    else:
        if np.any(counts > 1):
            r = int(np.flatnonzero(counts > 1)[0])
            raise PackingError(
                f"row {r} holds {int(counts[r])} samples; layout {layout.value} takes one per row"
            )
        row_of_sample = np.flatnonzero(counts == 1)
        take = np.minimum(lengths, spec.max_sample_length)
        if layout is DataLayout.FIXED:
            width = int(spec.max_sample_length)
        else:
            longest = int(take.max()) if take.size else 1
            width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    slot, position = ragged(take)
    token_ids, token_labels = samples.gather(sample_of, starts, take)
    if units is not None:  # a unit is a document: no label crosses its end
        token_labels[(np.cumsum(take) - 1)[take > 0]] = IGNORE_INDEX
    if layout is DataLayout.PACKED_VARLEN:
        # Column of a token: where its sample starts inside its row, plus its position in the sample.
        row_token_start = np.cumsum(row_tokens) - row_tokens
        start_in_row = (np.cumsum(take) - take) - row_token_start[row_of_sample]
        column = start_in_row[slot] + position
    else:
        column = position
    dest = row_of_sample[slot] * width + column  # flat index into [B, T]

    def _scatter(values: np.ndarray, fill: int) -> torch.Tensor:
        out = np.full(n_rows * width, fill, dtype=np.int64)
        out[dest] = values
        return torch.from_numpy(out.reshape(n_rows, width))

    input_ids = _scatter(token_ids, pad_token_id)
    labels = _scatter(token_labels, IGNORE_INDEX)
    positions = _scatter(position, 0)
    seq_ids = _scatter(slot, -1)
    valid = seq_ids >= 0
    ce_mask = labels != IGNORE_INDEX
    names = unit_names(np.arange(order.shape[0]))
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    row_names = tuple(
        "|".join(names[a:b]) if b > a else f"__padding_{r}"
        for r, (a, b) in enumerate(itertools.pairwise(bounds))
    )
    metadata = {**(source_metadata or {}), "document_ids": names}
    kwargs: dict[str, Any] = {"input_ids": input_ids, "position_ids": positions}
    sequence = PackedSequenceMetadata()
    if layout is DataLayout.PACKED_VARLEN:
        # Samples sit in row-major order, so seq_ids are already canonical. A batch of padding rows only
        # (the sampler's tail) has no sample: cu [0], max 0, seq_ids all -1 (a packed layout always carries
        # cu and seq_ids).
        canon = canonical_packed_ids(seq_ids)
        sequence = PackedSequenceMetadata(
            global_cu_seqlens=canon.cu_seqlens,
            max_seqlen=canon.max_seqlen,
            seq_ids=seq_ids,
            sample_offsets=canon.sample_offsets,
        )
    else:
        kwargs["attention_mask"] = valid.long()
    return PuzzletronBatch(
        model_kwargs=kwargs,
        **token_targets(labels, ce_mask, valid),
        sequence=sequence,
        sample_ids=row_names,
        source_metadata=metadata,
        modality=Modality.TEXT,
        layout=layout,
    )

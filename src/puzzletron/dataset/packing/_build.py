"""Rows of tokenised samples -> a text `PuzzletronBatch` in one of the three layouts.

`build_batch` reads its samples through the `SampleSource` protocol (`puzzletron.dataset.packing.sources`:
in memory, or read from a token store one batch at a time). Tokens
of every row are gathered with one ragged gather and scattered into ``[B, T]`` tensors, so building a batch
costs O(tokens of the batch), with no per-token or per-sample Python loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
from puzzletron.dataset.batch.segments import canonical_packed_ids
from puzzletron.dataset.config import PuzzletronDataSpec, as_spec
from puzzletron.dataset.errors import PackingError
from puzzletron.dataset.packing._units import Units
from puzzletron.dataset.packing.sources import SampleSource, ragged

__all__ = ["Spans", "build_batch", "build_spans"]


def _check_rows(
    rows: Sequence[Sequence[int]], n: int, *, unique: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    order = np.fromiter((int(i) for r in rows for i in r), dtype=np.int64, count=int(counts.sum()))
    if order.size and (order.min() < 0 or order.max() >= n):
        bad = int(order[(order < 0) | (order >= n)][0])
        raise PackingError(f"row refers to sample {bad}, outside 0..{n - 1}")
    if unique and np.unique(order).shape[0] != order.shape[0]:
        raise PackingError("a sample appears twice in the rows of one batch")
    return order, counts


@dataclass(frozen=True, eq=False)
class Spans:
    """The token spans a batch holds, in order: span ``k`` is tokens ``[start[k], start[k] + length[k])``
    of sample ``sample[k]`` of a `SampleSource`, named ``names[k]`` (a unit of a cut sample is a document of
    its own: ``cut[k]``). Rows hold ``counts`` spans each (``[B]``, 0 for a padding row)."""

    sample: np.ndarray
    start: np.ndarray
    length: np.ndarray
    counts: np.ndarray
    names: Callable[[np.ndarray], list[str]]  # the names of spans ``k``
    cut: bool = False

    @classmethod
    def of_rows(
        cls, samples: SampleSource, rows: Sequence[Sequence[int]], units: Units | None, *, unique: bool = True
    ) -> Spans:
        """The spans of ``rows`` of sample indices (of ``units`` when a plan cut long samples); ``unique``:
        a sample twice is an error (a mixture repeating a small component may hold one twice)."""
        order, counts = _check_rows(rows, len(samples) if units is None else len(units), unique=unique)
        if units is None:
            lengths = samples.lengths[order].astype(np.int64)  # a store's index is uint32
            return cls(order, np.zeros_like(order), lengths, counts, lambda k: samples.names(order[k]))

        def names(k: np.ndarray) -> list[str]:
            return units.names(order[k], samples.names(units.sample[order[k]]))

        sample = units.sample[order].astype(np.int64)
        return cls(sample, units.start[order], units.length[order], counts, names, cut=True)


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
    spec = as_spec(spec, owner="build_batch")
    if pad_to_multiple_of < 1:
        raise PackingError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    spans = Spans.of_rows(samples, rows, units)
    return build_spans(
        samples,
        spans,
        spec=spec,
        pad_token_id=pad_token_id,
        pad_to_multiple_of=pad_to_multiple_of,
        source_metadata=source_metadata,
    )


def build_spans(
    samples: SampleSource,
    spans: Spans,
    *,
    spec: PuzzletronDataSpec,
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    source_metadata: Mapping[str, Any] | None = None,
) -> PuzzletronBatch:
    """`build_batch` of given `Spans` (rows of spans of ``samples``)."""
    layout = DataLayout(spec.layout)
    counts, sample_of, starts, lengths = spans.counts, spans.sample, spans.start, spans.length
    n_rows = counts.shape[0]
    unit_names = spans.names

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
    if spans.cut:  # a unit is a document: no label crosses its end
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
    names = unit_names(np.arange(sample_of.shape[0]))
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

"""Packing: a pure planner over sample lengths, then rows of token ids -> `PuzzletronBatch`.

The planner never sees a tensor. It takes integer lengths and returns a `PackingPlan` (which sample goes in
which row); tensors are built only at the end, by `build_batch`, for whichever layout a
`PuzzletronDataSpec` asks for.

Best-fit decreasing (BFD), exact, in time proportional to the number of *distinct* lengths plus the number
of samples. Samples are taken longest first; each goes into the open row with the smallest remaining
capacity that still fits it, else a new row. Lengths are bounded integers, so samples of one length form a
group that is placed at once: in BFD a row that takes an item of length ``L`` keeps taking the next items of
that length while it still fits one more (its remaining capacity is now the smallest that fits), so the
group walks the rows in ascending remaining capacity and each row takes ``capacity // L`` of them. Open rows
live in buckets keyed by remaining capacity (a sorted list of non-empty capacities, found with `bisect`).
Ties between rows of equal remaining capacity go to the row that reached that capacity first.

One packed row of ``pack_size = 16`` holding samples ``a`` (5 tokens), ``b`` (4), ``c`` (6)::

    tokens     a a a a a b b b b c c c c c c .
    seq_ids    0 0 0 0 0 1 1 1 1 2 2 2 2 2 2 -1
    positions  0 1 2 3 4 0 1 2 3 0 1 2 3 4 5 0
    cu_seqlens 0         5       9           15

Capacity and ``packing_ratio``: ``pack_size`` is the hard row length. When lengths are exact (text,
``estimated=False``) the planner may fill a row up to ``pack_size``. When lengths are *estimated* (a VLM
sample's token count depends on the processor's image resize, known only at collation time),
``estimated=True`` caps the planned fill at ``capacity = floor(pack_size * packing_ratio)`` to leave
headroom. A single sample longer than the capacity but not longer than ``pack_size`` still gets a row of its
own. Samples longer than ``pack_size`` are dropped and counted (``drop_long_samples=True``) or raise a
`PackingError` naming the sample.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from puzzletron.dataset.batch import DataLayout, Modality, PackedSequenceMetadata, PuzzletronBatch
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
from puzzletron.dataset.errors import PuzzletronDataError

__all__ = [
    "PackingError",
    "PackingPlan",
    "TokenizedSamples",
    "build_batch",
    "plan_packing",
]

IGNORE_INDEX = -100


class PackingError(PuzzletronDataError, ValueError):
    """A sample cannot be packed as asked (too long, empty, or a malformed length)."""


@dataclass(frozen=True, eq=False)
class PackingPlan:
    """Which sample goes in which row, in CSR form.

    Row ``r`` holds samples ``sample_order[row_offsets[r]:row_offsets[r + 1]]`` (indices into the planned
    lengths, ascending within a row). All arrays are read-only ``int64``.

    Attributes:
        pack_size: the hard row length (tokens).
        capacity: the planned fill limit (tokens); ``pack_size`` unless lengths were estimated.
        sample_order: ``[n_placed]`` sample indices, row after row.
        row_offsets: ``[num_rows + 1]`` offsets into ``sample_order``, starting at 0.
        row_lengths: ``[num_rows]`` tokens per row (sum of its samples' lengths).
        num_samples: samples given to the planner (placed + dropped).
        total_tokens: tokens of the placed samples.
        dropped: indices of samples longer than ``pack_size`` that were dropped, ascending.
        dropped_tokens: their tokens.
        seed: the seed that ordered the rows.
    """

    pack_size: int
    capacity: int
    sample_order: np.ndarray = field(repr=False)
    row_offsets: np.ndarray = field(repr=False)
    row_lengths: np.ndarray = field(repr=False)
    num_samples: int
    total_tokens: int
    dropped: tuple[int, ...]
    dropped_tokens: int
    seed: int

    @property
    def num_rows(self) -> int:
        return int(self.row_offsets.shape[0] - 1)

    @property
    def lower_bound_rows(self) -> int:
        """``ceil(total_tokens / pack_size)``: no packing can use fewer rows."""
        return math.ceil(self.total_tokens / self.pack_size)

    @property
    def slots(self) -> int:
        """Token slots of the planned rows: ``num_rows * pack_size``."""
        return self.num_rows * self.pack_size

    @property
    def efficiency(self) -> float:
        """Non-pad tokens / slots, in [0, 1] (1.0 for an empty plan)."""
        return self.total_tokens / self.slots if self.slots else 1.0

    def row(self, index: int) -> tuple[int, ...]:
        """The sample indices of row ``index``."""
        if not -self.num_rows <= index < self.num_rows:
            raise IndexError(f"row {index} out of range for a plan of {self.num_rows} rows")
        index %= self.num_rows
        start, stop = self.row_offsets[index], self.row_offsets[index + 1]
        return tuple(int(i) for i in self.sample_order[start:stop])

    @property
    def rows(self) -> tuple[tuple[int, ...], ...]:
        """Every row as a tuple of sample indices (builds Python objects: for inspection and tests)."""
        bounds = self.row_offsets.tolist()
        order = self.sample_order.tolist()
        return tuple(tuple(order[a:b]) for a, b in itertools.pairwise(bounds))

    def summary(self) -> dict[str, int | float]:
        """The headline numbers as plain Python values."""
        return {
            "samples": self.num_samples,
            "placed": int(self.sample_order.shape[0]),
            "dropped": len(self.dropped),
            "dropped_tokens": self.dropped_tokens,
            "tokens": self.total_tokens,
            "rows": self.num_rows,
            "lower_bound_rows": self.lower_bound_rows,
            "pack_size": self.pack_size,
            "capacity": self.capacity,
            "efficiency": self.efficiency,
        }


def _as_lengths(lengths: Sequence[int] | np.ndarray | torch.Tensor | Iterable[int]) -> np.ndarray:
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.detach().cpu().numpy()
    arr = np.asarray(lengths if isinstance(lengths, (np.ndarray, Sequence)) else list(lengths))
    if arr.ndim != 1:
        raise PackingError(f"lengths must be 1-D, got shape {tuple(arr.shape)}")
    integral = np.issubdtype(arr.dtype, np.integer) or (
        np.issubdtype(arr.dtype, np.floating) and bool(np.all(np.floor(arr) == arr))
    )
    if arr.size and not integral:
        raise PackingError(f"lengths must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _name(index: int, sample_ids: Sequence[str] | None) -> str:
    return f"sample {index}" + (f" ({sample_ids[index]!r})" if sample_ids is not None else "")


def _bfd(lengths: np.ndarray, indices: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact best-fit decreasing of ``lengths[indices]`` into rows of ``capacity``.

    Lengths above ``capacity`` are planned as ``capacity`` (a row of their own). Returns ``(row_of, order)``:
    ``row_of[k]`` is the row (in opening order) of sample ``order[k]``.
    """
    fit = np.minimum(lengths[indices], capacity)
    # Longest first; within a length, ascending sample index (stable sort of the negated key).
    order = indices[np.argsort(-fit, kind="stable")]
    fit_sorted = np.minimum(lengths[order], capacity)
    distinct, counts = np.unique(-fit_sorted, return_counts=True)
    buckets: dict[int, list[int]] = {}  # remaining capacity -> rows with it, in arrival order
    nonempty: list[int] = []  # sorted remaining capacities with at least one row
    row_chunks: list[np.ndarray] = []
    next_row = 0

    def _push(cap: int, rows: list[int]) -> None:
        if not rows:
            return
        bucket = buckets.get(cap)
        if bucket is None:
            buckets[cap] = list(rows)
            bisect.insort(nonempty, cap)
        else:
            bucket.extend(rows)

    for neg_len, count in zip(distinct.tolist(), counts.tolist(), strict=True):
        length, left = -neg_len, count
        rows_taken: list[int] = []
        takes: list[int] = []
        pos = bisect.bisect_left(nonempty, length)
        emptied_until = pos
        moves: list[tuple[int, list[int]]] = []
        while left and pos < len(nonempty):
            cap = nonempty[pos]
            bucket = buckets[cap]
            per_row = cap // length
            if len(bucket) * per_row <= left:  # the whole bucket fills up with this length
                rows_taken.extend(bucket)
                takes.extend([per_row] * len(bucket))
                left -= len(bucket) * per_row
                moves.append((cap - per_row * length, bucket))
                del buckets[cap]
                pos += 1
                emptied_until = pos
                continue
            full, rest = divmod(left, per_row)
            rows_taken.extend(bucket[:full])
            takes.extend([per_row] * full)
            moves.append((cap - per_row * length, bucket[:full]))
            if rest:
                rows_taken.append(bucket[full])
                takes.append(rest)
                moves.append((cap - rest * length, [bucket[full]]))
                full += 1
            del bucket[:full]
            if not bucket:
                del buckets[cap]
                emptied_until = pos + 1
            left = 0
        del nonempty[bisect.bisect_left(nonempty, length) : emptied_until]
        if left:  # open new rows, each taking as many as fit
            per_row = capacity // length
            n_new, rest = divmod(left, per_row)
            new_rows = list(range(next_row, next_row + n_new + (1 if rest else 0)))
            next_row += len(new_rows)
            rows_taken.extend(new_rows)
            takes.extend([per_row] * n_new)
            moves.append((capacity - per_row * length, new_rows[:n_new]))
            if rest:
                takes.append(rest)
                moves.append((capacity - rest * length, new_rows[n_new:]))
        for cap, rows in moves:
            if cap > 0:
                _push(cap, rows)
        row_chunks.append(np.repeat(np.asarray(rows_taken, dtype=np.int64), takes))
    row_of = np.concatenate(row_chunks) if row_chunks else np.zeros(0, dtype=np.int64)
    return row_of, order


def plan_packing(
    lengths: Sequence[int] | np.ndarray | torch.Tensor | Iterable[int],
    spec: PackingSpec,
    *,
    estimated: bool = False,
    seed: int = 0,
    sample_ids: Sequence[str] | None = None,
) -> PackingPlan:
    """Plan rows of at most ``spec.pack_size`` tokens for samples of the given lengths (tokens, ``[N]``).

    Deterministic: the same lengths, spec, ``estimated`` and ``seed`` give the same plan on any machine; it
    does not depend on batch sizes, worker counts or how the lengths were produced. The seed only orders
    the rows (BFD emits long samples first; a seeded permutation spreads them over the epoch); samples
    inside a row are in ascending index order. ``sample_ids`` (``N`` names) only make error messages
    clearer.
    """
    pack_size = int(spec.pack_size)
    ratio = float(spec.packing_ratio)
    if pack_size <= 0:
        raise PackingError(f"data.packing.pack_size must be > 0, got {pack_size}")
    if not 0.0 < ratio <= 1.0:
        raise PackingError(f"data.packing.packing_ratio must be in (0, 1], got {ratio}")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise PackingError(f"seed must be an int >= 0, got {seed!r}")  # numpy's own error names no field
    capacity = max(1, math.floor(pack_size * ratio)) if estimated else pack_size
    arr = _as_lengths(lengths)
    if sample_ids is not None and len(sample_ids) != arr.shape[0]:
        raise PackingError(f"sample_ids has {len(sample_ids)} entries for {arr.shape[0]} lengths")
    bad = np.flatnonzero(arr <= 0)
    if bad.size:
        i = int(bad[0])
        raise PackingError(f"{_name(i, sample_ids)} has length {int(arr[i])}; every sample needs >= 1 token")
    long_mask = arr > pack_size
    long_idx = np.flatnonzero(long_mask)
    if long_idx.size and not spec.drop_long_samples:
        i = int(long_idx[0])
        raise PackingError(
            f"{_name(i, sample_ids)} has {int(arr[i])} tokens > pack_size {pack_size} "
            f"({long_idx.size} such sample(s)); set data.packing.drop_long_samples=true to drop them, "
            "or increase data.packing.pack_size"
        )
    keep = np.flatnonzero(~long_mask)
    row_of, order = _bfd(arr, keep, capacity)
    n_rows = int(row_of.max()) + 1 if row_of.size else 0
    # Seeded row order; inside a row, ascending sample index.
    perm = np.random.default_rng(seed).permutation(n_rows)  # new position -> old row
    rank = np.empty(n_rows, dtype=np.int64)
    rank[perm] = np.arange(n_rows, dtype=np.int64)
    final_row = rank[row_of]
    sort = np.lexsort((order, final_row))
    sample_order = order[sort]
    counts = np.bincount(final_row, minlength=n_rows)
    row_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    row_lengths = np.bincount(final_row, weights=arr[order], minlength=n_rows).astype(np.int64)
    for a in (sample_order, row_offsets, row_lengths):
        a.setflags(write=False)
    return PackingPlan(
        pack_size=pack_size,
        capacity=capacity,
        sample_order=sample_order,
        row_offsets=row_offsets,
        row_lengths=row_lengths,
        num_samples=int(arr.shape[0]),
        total_tokens=int(arr[keep].sum()),
        dropped=tuple(int(i) for i in long_idx),
        dropped_tokens=int(arr[long_idx].sum()),
        seed=int(seed),
    )


# ---------------------------------------------------------------------------------------------------------
# Rows -> PuzzletronBatch


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
            raise ValueError(
                f"input_ids and labels must be 1-D and equal, got {ids.shape} and {labels.shape}"
            )
        if n < 0 or offsets[0] != 0 or offsets[-1] != ids.shape[0] or np.any(np.diff(offsets) <= 0):
            raise ValueError("offsets must start at 0, increase strictly and end at the token count")
        if len(self.sample_ids) != n:
            raise ValueError(f"sample_ids has {len(self.sample_ids)} entries for {n} samples")
        open_ends = np.flatnonzero(labels[offsets[1:] - 1] != IGNORE_INDEX)
        if open_ends.size:
            i = int(open_ends[0])
            raise ValueError(
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
            raise ValueError(f"{len(labels)} label lists for {len(input_ids)} samples")
        lengths = np.fromiter((len(x) for x in input_ids), dtype=np.int64, count=len(input_ids))
        bad = np.flatnonzero(
            lengths != np.fromiter((len(x) for x in labels), dtype=np.int64, count=len(labels))
        )
        if bad.size:
            raise ValueError(f"sample {int(bad[0])}: labels and input_ids differ in length")
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


def _ragged_gather(
    samples: TokenizedSamples, order: np.ndarray, take: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per output token of samples ``order`` (first ``take`` tokens each): source, sample slot, position.

    All ``[sum(take)]``: flat index into ``samples``, index into ``order``, position inside the sample.
    """
    slot = np.repeat(np.arange(order.shape[0], dtype=np.int64), take)
    before = np.cumsum(take) - take  # [len(order)] first output token of each sample
    position = np.arange(slot.shape[0], dtype=np.int64) - before[slot]
    return samples.offsets[order][slot] + position, slot, position


def _check_rows(rows: Sequence[Sequence[int]], n: int) -> tuple[np.ndarray, np.ndarray]:
    counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    order = np.fromiter((int(i) for r in rows for i in r), dtype=np.int64, count=int(counts.sum()))
    if order.size and (order.min() < 0 or order.max() >= n):
        bad = int(order[(order < 0) | (order >= n)][0])
        raise IndexError(f"row refers to sample {bad}, outside 0..{n - 1}")
    if np.unique(order).shape[0] != order.shape[0]:
        raise ValueError("a sample appears twice in the rows of one batch")
    return order, counts


def build_batch(
    samples: TokenizedSamples,
    rows: Sequence[Sequence[int]],
    *,
    spec: PuzzletronDataSpec,
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    source_metadata: Mapping[str, Any] | None = None,
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
    ``seq_ids`` order.
    """
    layout = DataLayout(spec.layout)
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    order, counts = _check_rows(rows, len(samples))
    n_rows = len(rows)
    lengths = samples.lengths[order]
    if layout is DataLayout.PACKED_VARLEN:
        if spec.packing is None:
            raise ValueError("data.packing is required for the packed_varlen layout")
        width = int(spec.packing.pack_size)
        take = lengths
        row_of_sample = np.repeat(np.arange(n_rows, dtype=np.int64), counts)
        row_tokens = np.bincount(row_of_sample, weights=take, minlength=n_rows).astype(np.int64)
        over = np.flatnonzero(row_tokens > width)
        if over.size:
            r = int(over[0])
            names = [samples.sample_ids[i] for i in rows[r]]
            raise PackingError(
                f"row {r} holds {int(row_tokens[r])} tokens > pack_size {width}: samples {names}"
            )
    else:
        if np.any(counts > 1):
            r = int(np.flatnonzero(counts > 1)[0])
            raise ValueError(
                f"row {r} holds {int(counts[r])} samples; layout {layout.value} takes one per row"
            )
        row_of_sample = np.flatnonzero(counts == 1)
        take = np.minimum(lengths, spec.max_sample_length)
        if layout is DataLayout.FIXED:
            width = int(spec.max_sample_length)
        else:
            longest = int(take.max()) if take.size else 1
            width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    src, slot, position = _ragged_gather(samples, order, take)
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

    input_ids = _scatter(samples.input_ids[src], pad_token_id)
    labels = _scatter(samples.labels[src], IGNORE_INDEX)
    positions = _scatter(position, 0)
    seq_ids = _scatter(slot, -1)
    valid = seq_ids >= 0
    ce_mask = labels != IGNORE_INDEX
    names = [samples.sample_ids[i] for i in order.tolist()]
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    row_names = tuple(
        "|".join(names[a:b]) if b > a else f"__padding_{r}"
        for r, (a, b) in enumerate(itertools.pairwise(bounds))
    )
    metadata = {**(source_metadata or {}), "document_ids": names}
    kwargs: dict[str, Any] = {"input_ids": input_ids, "position_ids": positions}
    sequence = PackedSequenceMetadata()
    if layout is DataLayout.PACKED_VARLEN:
        cu = torch.zeros(len(take) + 1, dtype=torch.int32)
        cu[1:] = torch.from_numpy(np.cumsum(take))
        # A batch of padding rows only (the sampler's tail) has no sample: cu [0], max 0, seq_ids all -1
        # (a packed layout always carries cu and seq_ids).
        sequence = PackedSequenceMetadata(
            global_cu_seqlens=cu,
            max_seqlen=int(take.max()) if take.size else 0,
            seq_ids=seq_ids,
            sample_offsets=tuple(itertools.pairwise(cu.tolist())),
        )
    else:
        kwargs["attention_mask"] = valid.long()
    return PuzzletronBatch(
        model_kwargs=kwargs,
        labels=labels,
        ce_mask=ce_mask,
        kd_mask=ce_mask.clone(),
        hidden_mask=valid,
        sequence=sequence,
        sample_ids=row_names,
        source_metadata=metadata,
        modality=Modality.TEXT,
        layout=layout,
    )

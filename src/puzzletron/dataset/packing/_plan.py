"""The packing planner: a pure function from sample lengths (integers) to a `PackingPlan`.

The planner never sees a tensor: it returns which sample goes in which row; tensors are built only at the
end, by `puzzletron.dataset.packing.build_batch`, in whichever layout a `PuzzletronDataSpec` asks for.

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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from puzzletron.dataset._checks import require_seed
from puzzletron.dataset.config import PackingSpec
from puzzletron.dataset.errors import PackingError
from puzzletron.dataset.packing._sort import chunks, halves, index_dtype, radix_order
from puzzletron.dataset.packing._units import Units, cut_long_samples

__all__ = ["IndexSequence", "PackingPlan", "plan_packing"]


class IndexSequence(Sequence[int]):
    """A read-only array of indices seen as a sequence of ints (equal to a tuple of the same ints), so a
    plan's ``dropped`` costs its array, not one Python int per sample."""

    def __init__(self, values: np.ndarray) -> None:
        self._values = values

    def __len__(self) -> int:
        return int(self._values.shape[0])

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            return tuple(self._values[index].tolist())
        return int(self._values[index])

    def __iter__(self) -> Iterator[int]:
        return iter(self._values.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IndexSequence | Sequence) and not isinstance(other, str):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return (
            f"IndexSequence({self._values.tolist()!r})"
            if len(self) <= 16
            else f"IndexSequence(<{len(self)}>)"
        )

    def array(self) -> np.ndarray:
        return self._values


@dataclass(frozen=True, eq=False)
class PackingPlan:
    """Which sample (or unit of a long sample) goes in which row, in CSR form.

    Row ``r`` holds ``sample_order[row_offsets[r]:row_offsets[r + 1]]``, ascending within a row: indices
    into the planned lengths, or into ``units`` when the ``truncate``/``split`` policy cut long samples
    (`puzzletron.dataset.packing._units`). All arrays are read-only ``int64``.

    Attributes:
        pack_size: the hard row length (tokens).
        capacity: the planned fill limit (tokens); ``pack_size`` unless lengths were estimated.
        sample_order: ``[n_placed]`` sample indices, row after row.
        row_offsets: ``[num_rows + 1]`` offsets into ``sample_order``, starting at 0.
        row_lengths: ``[num_rows]`` tokens per row (sum of its samples' lengths).
        num_samples: samples given to the planner (placed + dropped).
        total_tokens: tokens of the placed samples.
        dropped: indices of samples longer than ``pack_size`` that were dropped, ascending (an
            `IndexSequence`: equal to the tuple of those ints, stored as one array).
        dropped_tokens: their tokens.
        seed: the seed that ordered the rows.
        policy: the long-sample policy (``drop``, ``raise``, ``truncate``, ``split``).
        units: the planned token spans when the policy cut long samples, else None (units = samples).
        cut_samples: samples longer than ``pack_size`` that were truncated or split.
        cut_tokens: tokens lost by truncation (0 for the other policies).
    """

    pack_size: int
    capacity: int
    sample_order: np.ndarray = field(repr=False)
    row_offsets: np.ndarray = field(repr=False)
    row_lengths: np.ndarray = field(repr=False)
    num_samples: int
    total_tokens: int
    dropped: Sequence[int]
    dropped_tokens: int
    seed: int
    policy: str = "drop"
    units: Units | None = field(default=None, repr=False)
    cut_samples: int = 0
    cut_tokens: int = 0

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
            "policy": self.policy,
            "cut_samples": self.cut_samples,
            "cut_tokens": self.cut_tokens,
            "units": len(self.units) if self.units is not None else int(self.sample_order.shape[0]),
        }


def _as_lengths(lengths: Sequence[int] | np.ndarray | Iterable[int] | Any) -> np.ndarray:
    """``[N]`` integer lengths as a numpy array, without copying an integer array (a memory-mapped ``uint32``
    index of 75M samples stays 300 MB, not 600 MB)."""
    if hasattr(lengths, "detach"):  # a torch tensor (the planner itself never imports torch)
        lengths = lengths.detach().cpu().numpy()
    arr = np.asarray(lengths if isinstance(lengths, (np.ndarray, Sequence)) else list(lengths))
    if arr.ndim != 1:
        raise PackingError(f"lengths must be 1-D, got shape {tuple(arr.shape)}")
    if np.issubdtype(arr.dtype, np.integer):
        return arr
    if arr.size and not (np.issubdtype(arr.dtype, np.floating) and bool(np.all(np.floor(arr) == arr))):
        raise PackingError(f"lengths must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def _name(index: int, sample_ids: Sequence[str] | None) -> str:
    return f"sample {index}" + (f" ({sample_ids[index]!r})" if sample_ids is not None else "")


class _RowQueue:
    """Row ids of one remaining capacity, in arrival order, as numpy chunks (never one Python int a row:
    15M open rows would cost 540 MB as a list)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.chunks: list[np.ndarray] = [rows]
        self.size = int(rows.shape[0])

    def push(self, rows: np.ndarray) -> None:
        self.chunks.append(rows)
        self.size += int(rows.shape[0])

    def take(self, k: int) -> np.ndarray:
        """Remove and return the first ``k`` rows."""
        if k == 0:
            return self.chunks[0][:0]
        out, need = [], k
        while need:
            head = self.chunks[0]
            if head.shape[0] <= need:
                out.append(self.chunks.pop(0))
                need -= head.shape[0]
            else:
                out.append(head[:need])
                self.chunks[0] = head[need:]
                need = 0
        self.size -= k
        return out[0] if len(out) == 1 else np.concatenate(out)


def _bfd(order: np.ndarray, counts: dict[int, int], capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact best-fit decreasing into rows of ``capacity``: ``(row_of, row_tokens)``, the row (in opening
    order) of every sample of ``order`` (samples longest first) and the planned tokens of every row.

    ``counts`` maps every planned length to its number of samples (longest first). In BFD a row that takes
    a sample of length ``L`` keeps taking the next ones of that length while one more fits, so a length's
    group walks the open rows in ascending remaining capacity, each row taking ``capacity // L``.
    """
    queues: dict[int, _RowQueue] = {}  # remaining capacity -> open rows with it, in arrival order
    nonempty: list[int] = []  # sorted remaining capacities with at least one row
    idx = index_dtype(max(order.shape[0], 1))
    row_of = np.empty(order.shape[0], dtype=idx)
    placed = 0
    fills: list[tuple[np.ndarray, int]] = []
    next_row = 0

    def give(cap: int, rows: np.ndarray) -> None:
        if cap <= 0 or rows.shape[0] == 0:
            return
        queue = queues.get(cap)
        if queue is None:
            queues[cap] = _RowQueue(rows)
            bisect.insort(nonempty, cap)
        else:
            queue.push(rows)

    for length, count in counts.items():
        left = count
        taken: list[tuple[np.ndarray, int]] = []  # (rows, samples each takes), in placement order
        moves: list[tuple[int, np.ndarray]] = []
        pos = first = bisect.bisect_left(nonempty, length)
        emptied_until = pos
        while left and pos < len(nonempty):
            cap = nonempty[pos]
            queue = queues[cap]
            per_row = cap // length
            full = min(queue.size, left // per_row)
            rest = left - full * per_row if full < queue.size else 0
            rows = queue.take(full)
            taken.append((rows, per_row))
            moves.append((cap - per_row * length, rows))
            left -= full * per_row
            if rest:
                row = queue.take(1)
                taken.append((row, rest))
                moves.append((cap - rest * length, row))
                left = 0
            if queue.size == 0:
                del queues[cap]
                emptied_until = pos + 1
            if left == 0:
                break
            pos += 1
        del nonempty[first:emptied_until]
        if left:  # open new rows, each taking as many as fit
            per_row = capacity // length
            n_new, rest = divmod(left, per_row)
            rows = np.arange(next_row, next_row + n_new, dtype=idx)
            taken.append((rows, per_row))
            moves.append((capacity - per_row * length, rows))
            if rest:
                row = np.array([next_row + n_new], dtype=idx)
                taken.append((row, rest))
                moves.append((capacity - rest * length, row))
            next_row += n_new + bool(rest)
        for cap, rows in moves:
            give(cap, rows)
        for rows, take in taken:
            row_of[placed : placed + rows.shape[0] * take] = np.repeat(rows, take)
            placed += rows.shape[0] * take
            fills.append((rows, take * length))
    row_tokens = np.zeros(next_row, dtype=np.int64)
    for rows, tokens in fills:  # a row appears at most once per entry, so += is exact
        row_tokens[rows] += tokens
    return row_of, row_tokens


def plan_packing(
    lengths: Sequence[int] | np.ndarray | Iterable[int] | Any,
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
    seed = require_seed(seed, error=PackingError)
    capacity = max(1, math.floor(pack_size * ratio)) if estimated else pack_size
    arr = _as_lengths(lengths)
    if sample_ids is not None and len(sample_ids) != arr.shape[0]:
        raise PackingError(f"sample_ids has {len(sample_ids)} entries for {arr.shape[0]} lengths")
    bad = np.flatnonzero(arr <= 0)
    if bad.size:
        i = int(bad[0])
        raise PackingError(f"{_name(i, sample_ids)} has length {int(arr[i])}; every sample needs >= 1 token")
    policy = spec.long_samples
    if policy == "raise":
        _refuse_long_samples(arr, pack_size, sample_ids)
    units = cut_long_samples(arr, pack_size, policy) if policy in ("truncate", "split") else None
    planned = arr if units is None else units.length
    sample_order, row_offsets, row_lengths, long_idx = _plan_rows(planned, pack_size, capacity, seed)
    long_idx = long_idx.astype(np.int64)
    for a in (sample_order, row_offsets, row_lengths, long_idx):
        a.setflags(write=False)
    cut = arr > pack_size if units is not None else np.zeros(0, dtype=bool)
    dropped_tokens = int(planned[long_idx].sum(dtype=np.int64))
    return PackingPlan(
        pack_size=pack_size,
        capacity=capacity,
        sample_order=sample_order,
        row_offsets=row_offsets,
        row_lengths=row_lengths,
        num_samples=int(arr.shape[0]),
        total_tokens=int(planned.sum(dtype=np.int64)) - dropped_tokens,
        dropped=IndexSequence(long_idx),
        dropped_tokens=dropped_tokens,
        seed=int(seed),
        policy=policy,
        units=units,
        cut_samples=int(cut.sum()),
        cut_tokens=int((arr[cut].astype(np.int64) - pack_size).sum()) if policy == "truncate" else 0,
    )


def _refuse_long_samples(arr: np.ndarray, pack_size: int, sample_ids: Sequence[str] | None) -> None:
    long_idx = np.flatnonzero(arr > pack_size)
    if long_idx.size:
        i = int(long_idx[0])
        raise PackingError(
            f"{_name(i, sample_ids)} has {int(arr[i])} tokens > pack_size {pack_size} "
            f"({long_idx.size} such sample(s)); set data.packing.drop_long_samples=true to drop them, "
            "data.packing.long_samples to truncate or split them, or increase data.packing.pack_size"
        )


def _plan_rows(
    arr: np.ndarray, pack_size: int, capacity: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Best-fit decreasing of ``arr`` ``[N]`` (lengths > ``pack_size`` dropped), rows in a seeded order:
    ``(sample_order, row_offsets, row_lengths, dropped indices)``."""
    long_mask = arr > pack_size
    long_idx = np.flatnonzero(long_mask)
    n = arr.shape[0]
    kept = n - int(long_idx.size)
    # Longest first, ascending index within a length: a stable counting sort of ``capacity - fit`` (long
    # samples get the key capacity + 1 and sort last, where they are cut off).
    key = np.empty(n, dtype=np.uint16 if capacity + 1 < 1 << 16 else np.uint32)
    for part in chunks(n):
        fit = np.minimum(arr[part], capacity).astype(np.uint32)
        key[part] = np.where(long_mask[part], capacity + 1, capacity - fit)
    per_key = np.bincount(key, minlength=capacity + 2)[: capacity + 1]
    order = radix_order(halves(key), capacity + 2)[:kept]
    del key
    counts = {capacity - k: int(c) for k, c in enumerate(per_key.tolist()) if c}
    row_of, row_tokens = _bfd(order, counts, capacity)
    n_rows = row_tokens.shape[0]
    # A sample longer than the (estimated) capacity is planned as `capacity`, alone in its row: add back
    # the tokens over it.
    capped = order[: counts.get(capacity, 0)]
    over = arr[capped].astype(np.int64) - capacity
    row_tokens[row_of[: capped.shape[0]][over > 0]] += over[over > 0]
    # Seeded row order (new position -> old row); inside a row, ascending sample index: group the samples
    # by their new row (dropped ones get the key n_rows and sort last, where they are cut off).
    perm = np.random.default_rng(seed).permutation(n_rows)
    row_lengths = row_tokens[perm]
    rank = np.empty(n_rows, dtype=row_of.dtype)
    rank[perm] = np.arange(n_rows, dtype=row_of.dtype)
    row_by_sample = np.full(n, n_rows, dtype=index_dtype(n_rows + 1))
    row_by_sample[order] = rank[row_of]
    del row_of, rank, order, row_tokens
    row_offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_by_sample, minlength=n_rows + 1)[:n_rows], out=row_offsets[1:])
    row_halves = halves(row_by_sample)
    del row_by_sample
    grouped = radix_order(row_halves, n_rows + 1)
    sample_order = np.empty(kept, dtype=np.int64)
    for part in chunks(kept):
        sample_order[part] = grouped[part]
    del grouped
    return sample_order, row_offsets, row_lengths, long_idx

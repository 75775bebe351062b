"""Dealing a mixture's epoch to steps and DP ranks: every rank holds an image in a step or none does, the
ranks of a step are even, and a resume needs two counters, whatever the DP size. Pure functions of integers
(``docs/mixtures.md``).

The epoch's rows (`puzzletron.dataset.packing.mixture.mixture_epoch`, in stream order) fall in two queues
(`row_queues`): rows holding an image token, and the others, each in stream order (the image queue sorted by
image tokens inside blocks of a tenth of it at most, so neighbours carry alike loads). A step of ``dp_size *
batch_size`` rows takes the next ``a`` image rows and the next ``G - a`` text rows, ``a`` a multiple of
``dp_size`` (`step_cursors`): as many image rows as the stream holds by the step's end, rounded to the nearest
multiple, so every rank of a step gets an image row, or none does, and the image rows lag or lead the stream
by less than ``dp_size / 2`` rows. Where a queue runs out (the epoch's last image rows, fewer than the ranks)
they join the step before that took images when it has room (``batch_size >= 2``)::

    dp 2, batch 2, stream  t t I t t I I t I t t t      (I: a row holding images)
    step 0: images in the first 4 rows: 1 -> a = 2     rows I I t t   rank 0: I t   rank 1: I t
    step 1: images in the first 8 rows: 3 -> a = 4     rows I I t t   ...

Inside a step the rows go to ranks in a snake, image rows first: the image rows of a step are neighbours in
the load-sorted image queue, so the snake evens their image tokens with no sort, and a rank computes only
its own column (`step_rows` with ``rank``). The state of a deal is ``(images taken, texts taken)``: the same
two numbers mean the same rows at any DP size or batch size, so a run resumes at another DP size with no row
repeated or skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from puzzletron.dataset._checks import require_int
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.packing.balance import ROUNDS, tail_step

__all__ = ["RowQueues", "image_exceptions", "row_queues", "step_cursors", "step_rows"]

_BLOCK = 256  # image rows sorted together at most: a step's image rows are neighbours in load
_STEPS_AT_ONCE = 1 << 12  # steps laid out at a time: bounded temporaries


@dataclass(frozen=True, eq=False)
class RowQueues:
    """An epoch's rows in two queues.

    Attributes:
        image_positions: ``[M]`` int64 stream positions of the rows holding images, ascending.
        images: ``[M]`` int64 global row ids of the image queue.
        texts: ``[n - M]`` int64 global row ids of the other rows, in stream order.
    """

    image_positions: np.ndarray
    images: np.ndarray
    texts: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.images.shape[0] + self.texts.shape[0])


def row_queues(order: np.ndarray, image_tokens: np.ndarray) -> RowQueues:
    """Split the stream ``order`` (global row ids) by ``image_tokens`` (``[all rows]``, indexed by global
    id): the image rows in stream order, sorted by image tokens (descending, then ascending in every other
    block, so block edges are alike too) inside blocks of at most ``_BLOCK`` and at most a tenth of them
    (every tenth of the epoch still spans the loads); the others in stream order."""
    order = np.asarray(order, dtype=np.int64)
    has_image = np.asarray(image_tokens)[order] > 0
    positions = np.flatnonzero(has_image).astype(np.int64)
    images = order[positions]
    m = images.shape[0]
    block = max(1, min(_BLOCK, m // ROUNDS))
    if block > 1:
        load = np.asarray(image_tokens)[images].astype(np.int64)
        n_blocks = -(-m // block)
        pad = n_blocks * block - m
        # [blocks, block] loads; padding sorts last in every block, then is cut off
        grid = np.concatenate([load, np.full(pad, -1, dtype=np.int64)]).reshape(n_blocks, block)
        rank = np.argsort(-grid, axis=1, kind="stable")
        flip = np.arange(n_blocks) % 2 == 1
        real = (grid >= 0).sum(axis=1)
        # odd blocks ascending: reverse the real part of each (padding stays at the end)
        within = np.arange(block)[None, :]
        rev = np.where(within < real[:, None], real[:, None] - 1 - within, within)
        rank[flip] = np.take_along_axis(rank[flip], rev[flip], axis=1)
        flat = (rank + np.arange(n_blocks)[:, None] * block).reshape(-1)
        images = images[flat[flat < m]]
    texts = order[~has_image]
    for a in (positions, images, texts):
        a.setflags(write=False)
    return RowQueues(image_positions=positions, images=images, texts=texts)


def step_cursors(
    queues: RowQueues,
    *,
    dp_size: int,
    batch_size: int,
    start: tuple[int, int] = (0, 0),
    drop_last: bool = False,
) -> np.ndarray:
    """``[S + 1, 2]`` int64: image and text rows taken after each step, from ``start`` (row 0). Every full
    step takes ``G = dp_size * batch_size`` rows; a last step of fewer rows is the tail (dropped with
    ``drop_last``). Image rows per step are a multiple of ``dp_size`` while both queues last."""
    d = require_int(dp_size, "dp_size", minimum=1, error=ConfigError)
    g = d * require_int(batch_size, "batch_size", minimum=1, error=ConfigError)
    m, t = queues.images.shape[0], queues.texts.shape[0]
    i0, x0 = (int(v) for v in start)
    if not (0 <= i0 <= m and 0 <= x0 <= t):
        raise ConfigError(f"deal position ({i0}, {x0}) outside this epoch's {m} image and {t} text rows")
    n0, n = i0 + x0, m + t
    full = (n - n0) // g
    ends = n0 + g * np.arange(1, full + 1, dtype=np.int64)
    if (n - n0) % g and not drop_last:
        ends = np.append(ends, n)  # the tail step
    owed = np.searchsorted(queues.image_positions, ends)  # image rows of the stream by each step's end
    images = i0 + np.maximum(0, d * np.floor((owed - i0) / d + 0.5).astype(np.int64))
    # A resume from another DP size may find the image rows behind the stream by more than a step holds:
    # they catch up by at most a step's rows a step (after the first step the target moves <= g a step).
    images = np.minimum(images, i0 + g * np.arange(1, ends.shape[0] + 1))
    images = np.maximum(np.minimum(images, m), ends - t)  # a queue that runs out: take from the other
    images = np.maximum.accumulate(np.concatenate([[i0], images]))
    totals = np.concatenate([[n0], ends])
    images = _merge_short_image_steps(images, totals, d)
    return np.stack([images, totals - images], axis=1)


def _merge_short_image_steps(images: np.ndarray, totals: np.ndarray, dp_size: int) -> np.ndarray:
    """``images`` (``[S + 1]`` image rows taken after each step) with every step that takes fewer image rows
    than ranks (where a queue runs out: the epoch's last image rows) merged into the step before that took
    images, when that step has room for them (``batch_size >= 2``): it then holds at least ``dp_size`` image
    rows, so every rank an image, and the steps between take text rows only. Steps are full before the last,
    and the few short steps are visited one by one (not a per-step loop)."""
    images = images.copy()
    taken, rows = np.diff(images), np.diff(totals)
    for k in np.flatnonzero((taken > 0) & (taken < np.minimum(rows, dp_size))):
        earlier = np.flatnonzero(taken[:k] > 0)
        if earlier.size == 0:
            continue
        j = int(earlier[-1])
        if taken[j] + taken[k] > rows[j]:
            continue  # one row a rank: no room; the step stays an exception (counted in the plan)
        images[j + 1 : k + 1] = images[k + 1]
        taken[j], taken[j + 1 : k + 1] = taken[j] + taken[k], 0
    return images


def image_exceptions(cursors: np.ndarray, dp_size: int) -> int:
    """Steps in which some rank holds an image row and another none: ``0 < image rows < dp_size`` (in the
    tail step, fewer image rows than ranks with rows)."""
    taken = np.diff(cursors, axis=0)  # [S, 2]
    images, rows = taken[:, 0], taken.sum(axis=1)
    ranks_with_rows = np.minimum(rows, dp_size)
    return int(np.count_nonzero((images > 0) & (images < ranks_with_rows)))


def _snake_slots(dp_size: int, batch_size: int, rank: int | None) -> np.ndarray:
    """``[ranks, batch_size]`` the positions in a step's row list (image rows first) that each rank takes:
    a snake over the ranks, lap after lap (``0 1 2 3 3 2 1 0 0 1 ...``), so a step's ``a`` image rows (a
    multiple of ``dp_size``) go ``a / dp_size`` to every rank, and rows of alike loads (the image queue is
    sorted by load inside blocks) are spread evenly."""
    laps = np.arange(batch_size)[None, :]
    ranks = np.arange(dp_size)[:, None] if rank is None else np.array([[rank]])
    return laps * dp_size + np.where(laps % 2 == 0, ranks, dp_size - 1 - ranks)


def step_rows(
    queues: RowQueues,
    cursors: np.ndarray,
    steps: slice,
    *,
    dp_size: int,
    batch_size: int,
    rank: int | None = None,
) -> np.ndarray:
    """``[s, dp_size, batch_size]`` int64 global row ids (``-1`` = padding slot) of ``steps`` (a slice of the
    steps of ``cursors``): each step's rows, image rows first, snaked to ranks (`_snake_slots`); a tail step
    dealt contiguously (`tail_step`). With ``rank``: that rank's ``[s, batch_size]`` only (O(steps x
    batch_size) work, whatever the DP size)."""
    g = dp_size * batch_size
    first, stop = steps.indices(cursors.shape[0] - 1)[:2]
    slots = _snake_slots(dp_size, batch_size, rank)  # [ranks, batch_size] positions in a step's list
    out = np.empty((max(stop - first, 0), *slots.shape), dtype=np.int64)
    for a in range(first, stop, _STEPS_AT_ONCE):
        b = min(a + _STEPS_AT_ONCE, stop)
        before, took = cursors[a:b], cursors[a + 1 : b + 1] - cursors[a:b]  # [s, 2]
        full = took.sum(axis=1) == g
        if full.any():
            k = slots[None, :, :]  # [1, ranks, batch_size]
            n_img = took[full, 0][:, None, None]
            rows = np.full((int(full.sum()), *slots.shape), -1, dtype=np.int64)
            if queues.images.size:
                rows = _take(queues.images, before[full, 0][:, None, None] + k)
            if queues.texts.size:
                texts = _take(queues.texts, before[full, 1][:, None, None] + k - n_img)
                rows = np.where(k < n_img, rows, texts)
            out[np.flatnonzero(full) + a - first] = rows
        for s in np.flatnonzero(~full):  # at most the last step: the tail
            i, x = before[s]
            ni, nx = took[s]
            tail = tail_step(
                np.concatenate([queues.images[i : i + ni], queues.texts[x : x + nx]]), dp_size, batch_size
            )
            out[a + s - first] = tail[0] if rank is None else tail[0, rank : rank + 1]
    return out


def _take(queue: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``queue[at]`` with ``at`` clipped into the queue (slots outside it are masked by the caller)."""
    return queue[np.clip(at, 0, queue.shape[0] - 1)]

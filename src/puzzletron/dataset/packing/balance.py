"""A media-balanced deal of packs to steps and data-parallel ranks, and the figures that judge a deal.

The plain deal (`puzzletron.dataset.distributed.deal_epoch`) cuts a seeded permutation into steps: the
ranks of a step get whatever packs fall there, so their image tokens (the vision tower's work) and real
tokens differ widely and the slowest rank sets the step's time. `balanced_deal` has the same shape and
contract (``[steps, dp_size, batch_size]`` item indices, ``-1`` = padding slot, every item exactly once per
epoch, a function of ``(seed, epoch)`` only, the same on every rank) and arranges the packs so that:

1. the ranks of a step hold packs of nearly the same image tokens: a step takes ``dp_size * batch_size``
   packs adjacent in the order of image tokens (ties broken by the seeded permutation; packs less full than
   the rest are kept apart, so real tokens stay level too), dealt to the ranks in a snake order of their
   image tokens;
2. image-heavy steps do not bunch up: the steps, in the order of their image tokens, are cut into blocks of
   ``rounds`` (10) neighbours, and the epoch runs in ``rounds`` rounds that each take one step of every block,
   blocks and steps in seeded order. Every tenth of the epoch is a stratified sample of all the steps, so the
   first and the last tenth carry about the same image tokens;
3. the shuffle stays: which packs share a step among equals, which step of a block goes to which round and
   the order of the steps inside a round come from ``(seed, epoch)``; the tail step (``num_items`` not a
   multiple of ``dp_size * batch_size``) takes packs drawn by the same permutation and is dealt like
   `deal_epoch`'s (dropped with ``drop_last``).

`balance_report` measures a deal: per step, max over the ranks / mean over the ranks of image and real
tokens, and the image tokens of the first and last tenth of the steps.
"""

from __future__ import annotations

import numpy as np

from puzzletron.dataset._checks import require_int, require_seed
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.packing._sort import index_dtype

__all__ = ["ROUNDS", "balance_report", "balanced_deal", "snake_positions", "tail_step"]

ROUNDS = 10  # tenths of an epoch, each a stratified sample of the steps
_FULL = 0.99  # a pack with fewer real tokens than this share of the fullest is dealt apart
_STEPS_AT_ONCE = 1 << 10  # steps sorted or widened to int64 at a time: bounded temporaries


def tail_step(items: np.ndarray, dp_size: int, batch_size: int) -> np.ndarray:
    """``[1, dp_size, batch_size]`` int64: the tail step of a deal, ``items`` (fewer than a step) dealt
    contiguously, the first ``len(items) % dp_size`` ranks one more, ``-1`` in the empty slots."""
    base, extra = divmod(items.size, dp_size)
    sizes = base + (np.arange(dp_size) < extra)
    rank = np.repeat(np.arange(dp_size), sizes)
    column = np.arange(items.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    out = np.full((1, dp_size, batch_size), -1, dtype=np.int64)
    out[0, rank, column] = items
    return out


def snake_positions(loads: np.ndarray, dp_size: int, batch_size: int) -> np.ndarray:
    """``[steps, dp_size * batch_size]`` positions within each step, so that slot ``r * batch_size + c``
    gets the ``c``-th pack of rank ``r`` in a snake over the step's packs by descending ``loads``."""
    per_step = dp_size * batch_size
    k = np.arange(per_step)
    lap, pos = k // dp_size, k % dp_size
    rank = np.where(lap % 2 == 0, pos, dp_size - 1 - pos)  # 0 1 2 3 3 2 1 0 0 1 ...
    slot = rank * batch_size + lap
    out = np.empty(loads.shape, dtype=np.int32)  # positions within a step
    for a in range(0, loads.shape[0], _STEPS_AT_ONCE):  # the sort's int64 temporaries a slice at a time
        part = np.negative(loads[a : a + _STEPS_AT_ONCE], dtype=np.int64)
        out[a : a + _STEPS_AT_ONCE, slot] = np.argsort(part, axis=1, kind="stable")  # heaviest first
    return out


def _rounds(n_steps: int, rng: np.random.Generator | None, rounds: int) -> np.ndarray:
    """The order of ``n_steps`` steps (sorted by load): round ``j`` takes one step of every block of
    ``rounds`` neighbours, blocks and their steps in the generator's order (ascending without one)."""
    blocks = -(-n_steps // rounds)
    slot = np.arange(blocks * rounds).reshape(blocks, rounds)  # step index of (block, place)
    if rng is not None:
        slot = rng.permuted(slot, axis=1)  # which step of a block plays in which round
    real = slot < n_steps
    block_order = np.stack(
        [rng.permutation(blocks) if rng is not None else np.arange(blocks) for _ in range(rounds)]
    )
    # round j lists slot[block_order[j], j] for the blocks in its order
    picked = slot[block_order, np.arange(rounds)[:, None]]
    keep = real[block_order, np.arange(rounds)[:, None]]
    return picked[keep]


def balanced_deal(
    image_tokens: np.ndarray,
    tokens: np.ndarray,
    *,
    batch_size: int,
    dp_size: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    drop_last: bool = False,
    rounds: int = ROUNDS,
) -> np.ndarray:
    """Item indices ``[steps, dp_size, batch_size]`` (int64, ``-1`` = padding slot) of one epoch for items
    (packs) of ``image_tokens`` and real ``tokens`` ``[P]`` each (see the module docstring)."""
    image_tokens = np.asarray(image_tokens).reshape(-1)  # any integer dtype: no copy of the loads
    tokens = np.asarray(tokens).reshape(-1)
    if image_tokens.shape != tokens.shape:
        raise ConfigError(f"{image_tokens.size} image-token counts for {tokens.size} items")
    require_int(batch_size, "batch_size", minimum=1, error=ConfigError)
    require_int(dp_size, "dp_size", minimum=1, error=ConfigError)
    seed = require_seed(seed, error=ConfigError)
    epoch = require_int(epoch, "epoch", minimum=0, error=ConfigError)
    n, per_step = image_tokens.size, dp_size * batch_size
    idx = index_dtype(max(n, 1))  # item indices in int32 below 2**31 items: half the temporaries
    rng = np.random.default_rng([int(seed), int(epoch)]) if shuffle else None
    perm = (rng.permutation(n) if rng is not None else np.arange(n)).astype(idx)
    full = n // per_step
    tail, body = perm[: n - full * per_step].copy(), perm[n - full * per_step :]  # tail: not a view of perm
    # neighbours in image tokens share a step; less full packs sort after the full ones, by real tokens
    top, heaviest = (int(tokens.max()), int(image_tokens.max())) if n else (0, 0)
    key = image_tokens[body].astype(np.int32 if heaviest + 1 + top < 2**31 else np.int64)
    underfull = tokens[body] < _FULL * top
    key[underfull] = heaviest + 1 + tokens[body][underfull]
    by_key = np.argsort(key, kind="stable")
    del key, underfull
    steps = body[by_key].reshape(full, per_step)
    del by_key, body, perm
    steps = np.take_along_axis(steps, snake_positions(image_tokens[steps], dp_size, batch_size), axis=1)
    order, with_tail = _rounds(full, rng, rounds), bool(tail.size) and not drop_last
    out = np.empty((full + with_tail, dp_size, batch_size), dtype=np.int64)
    for a in range(0, full, _STEPS_AT_ONCE):  # widened a slice at a time: no second copy of the deal
        b = min(a + _STEPS_AT_ONCE, full)
        out[a:b] = steps[order[a:b]].reshape(b - a, dp_size, batch_size)
    if with_tail:
        out[full:] = tail_step(tail, dp_size, batch_size)
    return out


def balance_report(deal: np.ndarray, image_tokens: np.ndarray, tokens: np.ndarray) -> dict[str, float]:
    """How even a deal ``[steps, dp_size, batch_size]`` is, over its full steps (no padding slot):

    - ``image_max_over_mean`` / ``tokens_max_over_mean``: per step, the largest rank's image (real) tokens
      over the ranks' mean, averaged over the steps weighted by their mean (= total step time if the
      slowest rank sets it, over the time of a perfect split); ``..._step_mean``: the plain mean of the
      steps' ratios; ``..._worst``: the largest step's ratio (steps with a mean of at least 1% of the
      average step);
    - ``image_edge_ratio``: image tokens of the first tenth of the steps over those of the last tenth
      (or the inverse, whichever is >= 1).
    """
    image_tokens, tokens = np.asarray(image_tokens, np.int64), np.asarray(tokens, np.int64)
    full = deal[(deal >= 0).all(axis=(1, 2))]
    out: dict[str, float] = {"steps": float(full.shape[0])}
    for name, values in (("image", image_tokens), ("tokens", tokens)):
        per_rank = values[full].sum(axis=2).astype(np.float64)  # [steps, dp]
        mean, top = per_rank.mean(axis=1), per_rank.max(axis=1)
        out[f"{name}_max_over_mean"] = float(top.sum() / mean.sum()) if mean.sum() else 1.0
        counted = mean >= 0.01 * mean.mean() if mean.size else mean > 0
        out[f"{name}_step_mean"] = float((top[counted] / mean[counted]).mean()) if counted.any() else 1.0
        out[f"{name}_worst"] = float((top[counted] / mean[counted]).max()) if counted.any() else 1.0
    tenth = max(1, full.shape[0] // 10)
    per_step = image_tokens[full].sum(axis=(1, 2)).astype(np.float64)
    first, last = per_step[:tenth].sum(), per_step[-tenth:].sum()
    out["image_edge_ratio"] = float(max(first, last) / min(first, last)) if min(first, last) else float("inf")
    return out

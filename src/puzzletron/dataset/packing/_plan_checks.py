"""The invariants of a packing plan against the lengths it was planned from (``docs/plan-cache.md``).

`plan_problems` is what the plan cache checks on a plan's arrays as written (read back from the files
whose checksums ``plan.json`` then records) before it publishes them; every mapping rank verifies those
checksums, so it maps bytes that passed these checks. Over the planned entries (the samples, or the units
of ``truncate`` / ``split``), of lengths ``planned``:

- ``dropped`` is exactly the entries longer than ``pack_size``, ascending;
- ``sample_order`` holds entries in ``[0, m)``, ascending inside each row, and with ``dropped`` every
  entry exactly once (``placed + dropped = m``, a bitmap of ``m`` bytes counts them: no entry twice);
- each row is non-empty, its ``row_lengths`` entry is the sum of its entries' lengths, at most
  ``pack_size``; ``total_tokens``, ``dropped_tokens``, ``cut_samples`` and ``cut_tokens`` follow;
- units (`_units.Units`) tile each sample: a sample's units are pieces ``0, 1, ...`` starting at
  ``piece * pack_size``; ``split`` pieces are ``min(pack_size, rest)`` tokens and the last ends at the
  sample's end; a ``truncate`` unit is the sample's first ``min(L, pack_size)`` tokens (or all ``L``, then
  dropped: a VLM sample that may not be cut before its last image); ``split`` marks the samples cut.

Vectorised in chunks of ``2**22`` entries: memory is the bitmap plus a few chunk-sized temporaries
(about 75 MB + 100 MB at 75M samples), whatever the plan's size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["plan_problems"]

_CHUNK = 1 << 22


def _spans(n: int) -> range:
    return range(0, n, _CHUNK)


def _unit_problems(units: Any, lengths: np.ndarray, pack: int, policy: str) -> list[str]:
    """How the units do not tile the samples of ``lengths`` (`plan_problems`' last rule)."""
    n, m = lengths.shape[0], units.sample.shape[0]
    if {units.start.shape[0], units.length.shape[0], units.piece.shape[0]} != {m} or units.split.shape[
        0
    ] != n:
        return ["the units' arrays differ in length"]
    if m == 0 or int(units.sample[-1]) != n - 1:
        return ["the units do not end at the last sample"]
    before_sample, before_piece = -1, -1  # the unit before the chunk (none: a sample -1)
    for a in _spans(m):
        b = min(a + _CHUNK, m)
        s, k = np.asarray(units.sample[a:b], np.int64), np.asarray(units.piece[a:b], np.int64)
        start, length = np.asarray(units.start[a:b], np.int64), np.asarray(units.length[a:b], np.int64)
        step = np.diff(s, prepend=before_sample)
        after = int(units.sample[b]) if b < m else n  # the sample of the unit after the chunk
        last = np.diff(s, append=after) != 0  # the last unit of its sample
        total = lengths[s].astype(np.int64)
        where = f"units [{a}, {b})"
        if np.any((step != 0) & (step != 1)) or np.any(
            k != np.where(step == 1, 0, np.append(before_piece, k[:-1]) + 1)
        ):
            return [f"{where} are not the pieces 0, 1, ... of every sample in order"]
        if np.any(start != k * pack) or np.any(length <= 0):
            return [f"{where} do not start at piece * pack_size"]
        if policy == "split" and (
            np.any(length != np.minimum(total - start, pack))
            or np.any(start[last] + length[last] != total[last])
        ):
            return [f"{where} do not tile their samples exactly"]
        if policy == "truncate" and (
            np.any(k != 0) or np.any((length != np.minimum(total, pack)) & (length != total))
        ):
            return [f"{where} are not their samples' first min(length, pack_size) tokens"]
        before_sample, before_piece = int(s[-1]), int(k[-1])
    for a in _spans(n):
        cut = lengths[a : a + _CHUNK] > pack if policy == "split" else np.zeros(min(_CHUNK, n - a), bool)
        if not np.array_equal(np.asarray(units.split[a : a + _CHUNK]), cut):
            return [f"units.split [{a}, {a + _CHUNK}) does not mark the samples cut into pieces"]
    return []


def _cut(plan: Any, lengths: np.ndarray) -> tuple[int, int]:
    """``(cut_samples, cut_tokens)`` the plan's units imply."""
    if plan.units is None:
        return 0, 0
    samples = tokens = 0
    for a in _spans(lengths.shape[0]):
        total = lengths[a : a + _CHUNK].astype(np.int64)
        if plan.policy == "split":
            samples += int((total > plan.pack_size).sum())
        else:
            cut = np.asarray(plan.units.length[a : a + _CHUNK]) < total
            samples += int(cut.sum())
            tokens += int((total[cut] - plan.pack_size).sum())
    return samples, tokens


def plan_problems(plan: Any, lengths: Any) -> list[str]:
    """What breaks the invariants of `plan` (a `PackingPlan`) planned from `lengths` ``[N]`` (module
    docstring), one phrase each; empty when it is sound."""
    lengths = np.asarray(lengths)
    pack, n = int(plan.pack_size), lengths.shape[0]
    if plan.num_samples != n:
        return [f"num_samples {plan.num_samples} is not the {n} lengths planned"]
    if plan.units is not None:
        problems = _unit_problems(plan.units, lengths, pack, plan.policy)
        if problems:
            return problems
    planned = lengths if plan.units is None else plan.units.length
    m = planned.shape[0]
    order, offsets, rows = plan.sample_order, plan.row_offsets, plan.row_lengths
    dropped = np.asarray(plan.dropped.array() if hasattr(plan.dropped, "array") else plan.dropped, np.int64)
    long = np.concatenate([np.flatnonzero(planned[a : a + _CHUNK] > pack) + a for a in _spans(m)] or [[]])
    if not np.array_equal(dropped, long):
        return ["dropped is not exactly the samples longer than pack_size"]
    if order.shape[0] + dropped.shape[0] != m or offsets.shape[0] != rows.shape[0] + 1:
        return [f"{order.shape[0]} placed and {dropped.shape[0]} dropped entries are not the {m} planned"]
    if offsets.shape[0] and (int(offsets[0]) != 0 or int(offsets[-1]) != order.shape[0]):
        return ["row_offsets do not cut sample_order into rows"]
    seen = np.zeros(m, dtype=bool)
    seen[dropped] = True
    r = 0
    while r < rows.shape[0]:  # blocks of whole rows of about _CHUNK entries
        stop = max(int(np.searchsorted(offsets, int(offsets[r]) + _CHUNK, side="right")) - 1, r + 1)
        stop = min(stop, rows.shape[0])
        cuts = np.asarray(offsets[r : stop + 1], dtype=np.int64)
        part = np.asarray(order[cuts[0] : cuts[-1]], dtype=np.int64)
        if np.any(np.diff(cuts) <= 0) or part.min() < 0 or part.max() >= m:
            return [f"rows [{r}, {stop}) are empty or hold entries outside [0, {m})"]
        rising = np.diff(part) > 0
        rising[cuts[1:-1] - cuts[0] - 1] = True  # a row start may step down
        sums = np.add.reduceat(planned[part].astype(np.int64), cuts[:-1] - cuts[0])
        if not rising.all():
            return [f"rows [{r}, {stop}) are not in ascending entry order (an entry twice?)"]
        if not np.array_equal(sums, np.asarray(rows[r:stop], dtype=np.int64)) or sums.max() > pack:
            return [f"row_lengths of rows [{r}, {stop}) are not their entries' lengths (or over pack_size)"]
        seen[part] = True
        r = stop
    if int(np.count_nonzero(seen)) != m:
        return [f"{m - int(np.count_nonzero(seen))} entries are placed twice (and as many never)"]
    dropped_tokens = int(planned[dropped].astype(np.int64).sum())
    facts = {
        "total_tokens": int(np.asarray(rows, dtype=np.int64).sum()),
        "dropped_tokens": dropped_tokens,
        **dict(zip(("cut_samples", "cut_tokens"), _cut(plan, lengths), strict=True)),
    }
    return [
        f"{k} is {getattr(plan, k)}, the arrays say {v}" for k, v in facts.items() if getattr(plan, k) != v
    ]

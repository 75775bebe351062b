"""Stable grouping of integer keys in bounded memory: a chunked counting sort, and an LSD radix sort of two
16-bit passes for keys up to 32 bits. The planner groups 75M samples by length and by row with these: an
``argsort`` of all keys would need an int64 result plus a same-size buffer (1.2 GB) and O(N log N) time.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["chunks", "group_stable", "halves", "index_dtype", "order_by", "radix_order"]


def index_dtype(n: int) -> type[np.integer]:
    """The smallest of int32/int64 that indexes ``n`` elements."""
    return np.int32 if n < 2**31 else np.int64


_CHUNK = 1 << 22  # elements per chunk of the whole-array passes: bounds their temporaries (~100 MB)
_MIN_CHUNK = 1 << 13  # ... and at least this many, so small inputs pay a few Python iterations at most


def chunks(n: int) -> Iterator[slice]:
    """Slices covering ``0..n``: ``_CHUNK`` elements, or a sixteenth of ``n`` when that is smaller (at
    least ``_MIN_CHUNK``), so a pass's temporaries stay a small share of the ``n`` elements it works on."""
    size = min(_CHUNK, max(_MIN_CHUNK, n >> 4))
    return (slice(a, min(a + size, n)) for a in range(0, n, size))


def group_stable(keys: np.ndarray, n_keys: int) -> np.ndarray:
    """Indices ``0..N-1`` ordered by ``keys`` (``uint16``, values ``< n_keys``), ascending index within a key.

    A counting sort done chunk by chunk (each chunk's stable argsort of 16-bit keys is numpy's radix sort):
    memory is the output, ``n_keys`` counters and one chunk's temporaries, never an argsort of all ``N``
    keys (whose int64 result and buffer alone would be 1.2 GB for 75M samples).
    """
    n = keys.shape[0]
    start = np.zeros(n_keys, dtype=np.int64)
    for part in chunks(n):
        start += np.bincount(keys[part], minlength=n_keys)
    start = np.cumsum(start) - start  # first output slot of every key
    out = np.empty(n, dtype=index_dtype(n))
    for part in chunks(n):
        chunk = keys[part]
        local = np.argsort(chunk, kind="stable")
        sorted_keys = chunk[local]
        # runs of equal keys in the sorted chunk: [run_start, run_start + run_len)
        run_start = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
        run_len = np.diff(np.r_[run_start, sorted_keys.shape[0]])
        rank = np.arange(sorted_keys.shape[0]) - np.repeat(run_start, run_len)
        out[start[sorted_keys] + rank] = local + part.start
        start[sorted_keys[run_start]] += run_len
    return out


def halves(keys: np.ndarray) -> list[np.ndarray]:
    """``[low, high]``: the 16-bit halves of ``keys`` (ints up to 32 bits) as ``uint16`` arrays."""
    low = np.empty(keys.shape[0], dtype=np.uint16)
    high = np.empty(keys.shape[0], dtype=np.uint16)
    for part in chunks(keys.shape[0]):
        low[part] = keys[part] & 0xFFFF
        high[part] = keys[part] >> 16
    return [low, high]


def radix_order(halves: list[np.ndarray], n_keys: int) -> np.ndarray:
    """`group_stable` order of the keys ``high << 16 | low`` (< ``n_keys``) given as `halves`: an LSD
    radix sort of two 16-bit passes. Empties ``halves``, so each half is freed as soon as it is used."""
    low, high = halves.pop(0), halves.pop(0)
    if n_keys <= 1 << 16:
        del high  # all zero: free it before the sort's temporaries
        return group_stable(low, n_keys)
    order = group_stable(low, 1 << 16)
    del low
    high = high[order]
    second = group_stable(high, ((n_keys - 1) >> 16) + 1)
    del high
    for part in chunks(order.shape[0]):
        second[part] = order[second[part]]
    return second


def order_by(keys: np.ndarray, n_keys: int) -> np.ndarray:
    """`group_stable` order of integer ``keys`` (``< n_keys``, up to 32 bits): one counting sort of the keys
    as uint16 when they fit (no copy of uint16 keys), else the two-pass radix sort of their halves."""
    if n_keys <= 1 << 16:
        return group_stable(keys if keys.dtype == np.uint16 else keys.astype(np.uint16), n_keys)
    return radix_order(halves(keys), n_keys)

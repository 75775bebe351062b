"""Block checksums: a damaged byte of a large file is found before it is served, at the cost of hashing each
block once per reading process.

A file is cut into blocks of `BLOCK_SIZE` bytes (the last one shorter); each block's checksum is its
``xxh3_64`` (about 20 GB/s on one core, far below the cost of reading it). A writer computes them while it
writes (`BlockHasher`, streaming); a format stores them for all its files in one little-endian uint64 file
whose own SHA-256 its manifest records, so the checksums are as trustworthy as the manifest. A reader
(`BlockChecks`) loads them at open and verifies each block the first time a read touches it, through the
same `puzzletron.dataset.storage.sources.ByteSource` the read uses, keeping a bitmap of the blocks this
process has verified: a damaged block is a `SnapshotError` naming the file and the byte range, and
nothing of it is served. Blocks are verified in aligned groups of `READAHEAD` (1 MiB of a file), so a
reader pays the per-call cost once per MiB it touches, whatever its order.

    hasher = BlockHasher()
    hasher.update(data)                           # any chunking: the same checksums
    sums = hasher.finish()                        # uint64 [block_count(len(data))]

    checks = BlockChecks(source, [("a.bin", size_a), ("b.bin", size_b)], sums_of_both, where="store")
    checks.ensure_range("b.bin", 1000, 70_000)   # verifies blocks 0 and 1 of b.bin (first time only)

Used by the token store (``docs/token-store-format.md``); any format can adopt it (``docs/trust-model.md``,
"Stores and snapshots on disk").

>>> block_count(0), block_count(1), block_count(BLOCK_SIZE), block_count(BLOCK_SIZE + 1)
(0, 1, 1, 2)
>>> h = BlockHasher(block_size=4); h.update(b"abcde"); h.update(b"fgh"); h.update(b"i")
>>> h.finish().tolist() == block_sums(b"abcdefghi", block_size=4).tolist()
True
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xxhash

from puzzletron.dataset.errors import SnapshotError

__all__ = [
    "ALGORITHM",
    "BLOCK_SIZE",
    "READAHEAD",
    "BlockChecks",
    "BlockHasher",
    "block_count",
    "block_sums",
    "ragged_blocks",
]

ALGORITHM = "xxh3_64"
BLOCK_SIZE = 1 << 16  # 64 KiB: a random single-sample read verifies at most a few of them
READAHEAD = 16  # blocks verified together (an aligned 1 MiB of a file): the per-call cost amortised
_DIGEST = xxhash.xxh3_64_intdigest


def block_count(size: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks of a file of `size` bytes (the last one may be shorter)."""
    return -(-size // block_size)


def block_sums(data: Any, block_size: int = BLOCK_SIZE) -> np.ndarray:
    """uint64 ``[block_count(len(data))]``: the checksum of each block of the bytes-like `data`."""
    view = memoryview(data).cast("B")
    return np.fromiter(
        (_DIGEST(view[a : a + block_size]) for a in range(0, len(view), block_size)),
        dtype=np.uint64,
        count=block_count(len(view), block_size),
    )


class BlockHasher:
    """Block checksums of bytes written front to back in chunks of any size."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self._pending = bytearray()
        self._sums: list[int] = []

    def update(self, data: Any) -> None:
        view, size = memoryview(data).cast("B"), self.block_size
        start = 0
        if self._pending:
            start = min(size - len(self._pending), len(view))
            self._pending += view[:start]
            if len(self._pending) < size:
                return
            self._sums.append(_DIGEST(self._pending))
            self._pending = bytearray()
        whole = start + (len(view) - start) // size * size
        self._sums.extend(_DIGEST(view[a : a + size]) for a in range(start, whole, size))
        self._pending += view[whole:]

    def finish(self) -> np.ndarray:
        """uint64 ``[blocks]`` of everything given (the trailing partial block included)."""
        if self._pending:
            self._sums.append(_DIGEST(self._pending))
            self._pending = bytearray()
        return np.asarray(self._sums, dtype=np.uint64)


def ragged_blocks(
    bases: np.ndarray, starts: np.ndarray, stops: np.ndarray, block_size: int = BLOCK_SIZE
) -> np.ndarray:
    """The global block ids covering the non-empty byte ranges ``[starts[i], stops[i])`` of files whose
    first global block is ``bases[i]`` (int64 arrays of one length), concatenated, vectorised."""
    keep = stops > starts
    first = bases[keep] + starts[keep] // block_size
    counts = (stops[keep] - 1) // block_size - starts[keep] // block_size + 1
    ends = np.cumsum(counts)
    return np.repeat(first - (ends - counts), counts) + np.arange(int(ends[-1]) if ends.size else 0)


class BlockChecks:
    """The block checksums of a set of files read through `source`, and which blocks this process verified.

    `files` are ``(rel, size)`` in the order their checksums appear in `sums` (uint64, ``block_count(size)``
    each, `SnapshotError` when the counts disagree); `where` names the directory in errors. Global block ids
    run over the files in that order (`base`). ``inspect(rel, offset, data)``, when given, sees each group
    of blocks once its checksums matched, before it counts as verified (a format's check of the content:
    the token store's ids against its vocabulary); it raises to refuse it.
    """

    def __init__(
        self,
        source: Any,
        files: Sequence[tuple[str, int]],
        sums: np.ndarray,
        *,
        where: str,
        block_size: int = BLOCK_SIZE,
        inspect: Callable[[str, int, np.ndarray], None] | None = None,
    ) -> None:
        self.source, self.where, self.block_size, self.inspect = source, where, block_size, inspect
        counts = np.asarray([block_count(size, block_size) for _, size in files], dtype=np.int64)
        if int(counts.sum()) != len(sums):
            raise SnapshotError(
                f"{where}: {len(sums)} block checksums for files of {int(counts.sum())} blocks"
            )
        self._names = [rel for rel, _ in files]
        self._sizes = np.asarray([size for _, size in files], dtype=np.int64)
        self._bases = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
        self._index = {rel: k for k, rel in enumerate(self._names)}
        self._base_list, self._size_list = self._bases.tolist(), self._sizes.tolist()
        self._sums = np.asarray(sums, dtype=np.uint64)
        self._set_verified(bytearray(len(sums)))

    def _set_verified(self, flags: bytearray) -> None:
        # one byte a block; `verified_flags` indexes it as Python ints (the fast path of a one-sample
        # read), `verified` is the same memory as a bool array (vectorised checks)
        self.verified_flags = flags
        self.verified = np.frombuffer(flags, dtype=bool)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "verified"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._set_verified(state["verified_flags"])

    def base(self, rel: str) -> int:
        """The global id of the first block of `rel`."""
        return int(self._bases[self._index[rel]])

    def spans_verified(self, spans: Sequence[tuple[int, int]]) -> bool:
        """Whether every block of the inclusive global block spans ``(first, last)`` is verified: the
        fast path of a read of a few ranges (Python ints, no array work)."""
        verified = self.verified
        for first, last in spans:
            if not (verified[first] and verified[last]) or (
                last - first > 1 and not verified[first + 1 : last].all()
            ):
                return False
        return True

    def ensure_blocks(self, blocks: np.ndarray) -> None:
        """Verify the global blocks `blocks` not verified yet (reading and hashing each with its aligned
        group of `READAHEAD` blocks of its file); `SnapshotError` naming the first damaged one."""
        if blocks.size == 0:
            return
        todo = blocks[~self.verified[blocks]]
        for block in np.unique(todo).tolist():
            if not self.verified[block]:  # an earlier run of this call may have covered it
                self._verify_from(block)

    def _verify_from(self, first: int) -> None:
        k = bisect.bisect_right(self._base_list, first) - 1
        base = self._base_list[k]
        first = base + (first - base) // READAHEAD * READAHEAD  # blocks are verified in aligned groups
        stop = min(first + READAHEAD, self._base_list[k + 1])
        rel, local = self._names[k], first - base
        begin = local * self.block_size
        end = min((stop - self._base_list[k]) * self.block_size, self._size_list[k])
        buffer = np.empty(end - begin, dtype=np.uint8)
        self.source.read_into(rel, begin, buffer)
        bad = np.flatnonzero(block_sums(buffer, self.block_size) != self._sums[first:stop])
        if not bad.size and self.inspect is not None:
            self.inspect(rel, begin, buffer)  # the format's own check of verified content
        if bad.size:
            a = begin + int(bad[0]) * self.block_size
            b = min(a + self.block_size, end)
            raise SnapshotError(
                f"{self.where}: {rel}: bytes {a}..{b} (block {local + int(bad[0])}) do not match their "
                "checksum: the file is damaged and nothing of it was served; run `puzzletron-data verify` "
                "and rebuild the store"
            )
        self.verified[first:stop] = True

    def ensure_range(self, rel: str, start: int, stop: int) -> None:
        """Verify the blocks covering bytes ``[start, stop)`` of `rel`."""
        if stop > start:
            base = self.base(rel)
            self.ensure_blocks(
                np.arange(base + start // self.block_size, base + (stop - 1) // self.block_size + 1)
            )

    def ensure_file(self, rel: str) -> None:
        """Verify every block of `rel`."""
        self.ensure_range(rel, 0, int(self._sizes[self._index[rel]]))

    def read_into(self, rel: str, offset: int, out: np.ndarray) -> None:
        """Verify the blocks `out` covers, then fill it from byte `offset` of `rel`."""
        self.ensure_range(rel, offset, offset + out.nbytes)
        self.source.read_into(rel, offset, out)

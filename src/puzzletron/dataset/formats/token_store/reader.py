"""The token store: chat-tokenised samples of a text snapshot split, read by positional reads.

The format, with an example manifest: ``docs/token-store-format.md``. Written by
`puzzletron.dataset.tokenize.store` (through `formats.token_store_writer`), checked by
`formats.token_store_verify` (``puzzletron-data verify`` / ``inspect``), read here::

    store = TokenStore("stores/puzzle-kd-train")
    store.lengths                                    # [n] uint32, memory-mapped: all a planner needs
    ids, mask = store.read(store.offsets[[3, 7]], store.offsets[[4, 8]])   # samples 3 and 7, concatenated
    labels = labels_from_mask(ids, mask, offsets)    # puzzletron.dataset.tokenize: derived, never stored

Opening checks the manifest's format and version and every file's presence and size (a truncated shard
is refused before a byte is served); it loads no token. A read refuses ids outside the vocabulary; any
other byte changed in place is found by `verify` (every SHA-256), not by the reader, which hashes nothing.
Tokens and mask bits are read with ``os.preadv`` straight into the result, so a reader walking an epoch
keeps no page of the shards mapped: its memory is the index it touches (a few bytes a sample), not the
tokens it has read.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.formats.manifest import MANIFEST
from puzzletron.dataset.formats.token_store._layout import (
    IDS_BIN,
    IDS_OFFSETS,
    LENGTHS,
    OFFSETS,
    SKIPPED_BIN,
    SKIPPED_OFFSETS,
    TOKEN_STORE_FORMAT,
    TOKEN_STORE_VERSION,
    mask_name,
    memmap_array,
    read_complete_manifest,
    tokens_name,
)

__all__ = ["TOKEN_STORE_FORMAT", "TOKEN_STORE_VERSION", "TokenStore", "pread_into", "read_strings"]

_MAX_OPEN_SHARDS = 64  # file descriptors kept open (two a shard), least recently used closed first


def pread_into(fd: int, out: np.ndarray, offset: int, where: str) -> None:
    """Fill the contiguous uint8 array `out` from byte `offset` of `fd`; `SnapshotError` on a short file."""
    view, done = memoryview(out).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise SnapshotError(f"{where}: ends at byte {offset + done}; {len(view) - done} more expected")
        done += got


def read_strings(path: Path, offsets: np.ndarray, indices: np.ndarray) -> list[str]:
    """Strings `indices` of a strings file (UTF-8 bytes cut by int64 `offsets` ``[m + 1]``)."""
    if not len(indices):
        return []
    begin, end = offsets[indices], offsets[np.asarray(indices) + 1]
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        out = []
        for a, b in zip(begin.tolist(), end.tolist(), strict=True):  # one read a string
            buf = np.empty(b - a, np.uint8)
            pread_into(fd, buf, a, str(path))
            out.append(buf.tobytes().decode("utf-8"))
        return out
    finally:
        os.close(fd)


def _ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concat(arange(s, s + n) for s, n in zip(starts, lengths))``, vectorised."""
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(total, dtype=np.int64)


class TokenStore:
    """A read-only view of the token store at `path` (see the module docstring).

    Attributes:
        path: the store directory (absolute).
        manifest: its parsed ``manifest.json``.
        num_tokens: tokens over all samples; pad_token_id: the id batches pad with; skipped: rows the
            build skipped (no supervised token), whose ids `skipped_ids` returns.

    Picklable and fork-safe: a copy reopens its files lazily (DataLoader workers).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).absolute()
        self.manifest = read_complete_manifest(self.path)
        counts = self.manifest["counts"]
        self.num_tokens: int = counts["tokens"]
        self.skipped: int = counts["skipped"]
        self.pad_token_id: int = int(self.manifest["pad_token_id"])
        self._n: int = counts["samples"]
        self._dtype = np.dtype(self.manifest["token_dtype"]).newbyteorder("<")
        self._vocab = int(self.manifest["vocab_size"])
        shards = self.manifest["shards"]
        self._bounds = np.asarray([s["tokens"][0] for s in shards] + [self.num_tokens], dtype=np.int64)
        if shards and (self._bounds[0] != 0 or np.any(np.diff(self._bounds) < 0)):
            raise SnapshotError(
                f"{self.path / MANIFEST}: shard token ranges do not tile [0, {self.num_tokens})"
            )
        self._reset()

    def _reset(self) -> None:
        self._fds: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._arrays: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"TokenStore({str(self.path)!r}, samples={self._n}, tokens={self.num_tokens})"

    def _array(self, rel: str, dtype: str, count: int) -> np.ndarray:
        if rel not in self._arrays:
            self._arrays[rel] = memmap_array(self.path / rel, dtype, count)
        return self._arrays[rel]

    @property
    def lengths(self) -> np.ndarray:
        """``[n]`` uint32, read-only (memory-mapped): tokens of each sample."""
        return self._array(LENGTHS, "<u4", self._n)

    @property
    def offsets(self) -> np.ndarray:
        """``[n + 1]`` int64, read-only (memory-mapped): the global token offset of each sample."""
        return self._array(OFFSETS, "<i8", self._n + 1)

    def sample_ids(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """The ids of samples `indices` (read for these samples only)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self._n):
            raise ConfigError(f"sample indices must be in [0, {self._n}); got {idx.min()}..{idx.max()}")
        return read_strings(self.path / IDS_BIN, self._array(IDS_OFFSETS, "<i8", self._n + 1), idx)

    def skipped_ids(self) -> list[str]:
        """The ids of the rows the build skipped (no supervised token), in row order."""
        offsets = memmap_array(self.path / SKIPPED_OFFSETS, "<i8", self.skipped + 1)
        return read_strings(self.path / SKIPPED_BIN, offsets, np.arange(self.skipped))

    def _shard_fds(self, shard: int) -> tuple[int, int]:
        fds = self._fds.get(shard)
        if fds is not None:
            self._fds.move_to_end(shard)
            return fds
        flags = os.O_RDONLY | os.O_CLOEXEC
        tokens = os.open(self.path / tokens_name(shard), flags)
        try:
            fds = (tokens, os.open(self.path / mask_name(shard), flags))
        except BaseException:
            os.close(tokens)
            raise
        self._fds[shard] = fds
        if len(self._fds) > _MAX_OPEN_SHARDS:
            for fd in self._fds.popitem(last=False)[1]:
                os.close(fd)
        return fds

    def read(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global token ranges ``[starts[i], stops[i])`` concatenated: ``(ids int64 [sum], mask bool [sum])``.

        Ranges may be empty and may cross shards. One positional read per range and shard (tokens and
        mask bits), straight into the result: nothing stays mapped, no per-token Python loop.
        """
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        stops = np.asarray(stops, dtype=np.int64).reshape(-1)
        if starts.shape != stops.shape:
            raise ConfigError(f"starts and stops differ in length ({starts.size} vs {stops.size})")
        if starts.size and (starts.min() < 0 or stops.max() > self.num_tokens or np.any(stops < starts)):
            raise ConfigError(f"token ranges must satisfy 0 <= start <= stop <= {self.num_tokens}")
        keep = stops > starts
        starts, stops = starts[keep], stops[keep]
        first = np.searchsorted(self._bounds, starts, side="right") - 1
        last = np.searchsorted(self._bounds, stops - 1, side="right") - 1
        # one piece per (range, shard it touches), in output order
        shard = _ragged_arange(first, last - first + 1)
        owner = np.repeat(np.arange(starts.size), last - first + 1)
        local_a = np.maximum(starts[owner], self._bounds[shard]) - self._bounds[shard]
        local_b = np.minimum(stops[owner], self._bounds[shard + 1]) - self._bounds[shard]
        sizes = local_b - local_a
        out = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(sizes, out=out[1:])
        byte_a, byte_b = local_a // 8, (local_b + 7) // 8
        bits_at = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(byte_b - byte_a, out=bits_at[1:])
        raw = np.empty(int(out[-1]) * self._dtype.itemsize, dtype=np.uint8)
        packed = np.empty(int(bits_at[-1]), dtype=np.uint8)
        width = self._dtype.itemsize
        for j, k in enumerate(shard.tolist()):  # one read a piece: per sample, never per token
            fd_tokens, fd_mask = self._shard_fds(k)
            where = f"{self.path}: shard {k}"
            pread_into(fd_tokens, raw[out[j] * width : out[j + 1] * width], int(local_a[j]) * width, where)
            pread_into(fd_mask, packed[bits_at[j] : bits_at[j + 1]], int(byte_a[j]), where)
        ids = raw.view(self._dtype).astype(np.int64)
        if ids.size and int(ids.max()) >= self._vocab:  # a damaged shard (same size: verify hashes it)
            raise SnapshotError(
                f"{self.path}: token id {int(ids.max())} outside the vocabulary ({self._vocab})"
            )
        bits = np.unpackbits(packed, bitorder="little")
        mask = bits[_ragged_arange(bits_at[:-1] * 8 + local_a % 8, sizes)].astype(bool)
        return ids, mask

    def close(self) -> None:
        """Close the open shard files and drop the index maps (the store stays usable: they reopen)."""
        while self._fds:
            for fd in self._fds.popitem()[1]:
                os.close(fd)
        self._arrays.clear()

    def __enter__(self) -> TokenStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fds"], state["_arrays"] = OrderedDict(), {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:
        # At interpreter exit this module's globals may already be None (os): use only what the
        # default argument and the builtins hold.
        fds = self.__dict__.get("_fds") or {}
        while fds:
            for fd in fds.popitem()[1]:
                try:  # noqa: SIM105 (contextlib may be None by now)
                    _close(fd)
                except OSError:
                    pass

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

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.formats.binary import memmap_array, pread_into, read_strings
from puzzletron.dataset.formats.manifest import MANIFEST
from puzzletron.dataset.formats.shards import TokenShards, check_tiling
from puzzletron.dataset.formats.token_store._layout import (
    IDS_BIN,
    IDS_OFFSETS,
    LENGTHS,
    OFFSETS,
    SKIPPED_BIN,
    SKIPPED_OFFSETS,
    TOKEN_STORE_FORMAT,
    TOKEN_STORE_VERSION,
    read_complete_manifest,
)

__all__ = ["TOKEN_STORE_FORMAT", "TOKEN_STORE_VERSION", "TokenStore", "pread_into", "read_strings"]


class TokenStore:
    """A read-only view of the token store at `path` (see the module docstring).

    Attributes:
        path: the store directory (absolute).
        manifest: its parsed ``manifest.json``.
        num_tokens: tokens over all samples; pad_token_id: the id batches pad with; skipped: rows the
            build skipped (no supervised token), whose ids `skipped_ids` returns.

    Picklable and fork-safe: a copy reopens its files lazily (DataLoader workers).
    """

    _complete_manifest = staticmethod(read_complete_manifest)  # a subclass checks its own layout

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).absolute()
        self.manifest = self._complete_manifest(self.path)
        counts = self.manifest["counts"]
        self.num_tokens: int = counts["tokens"]
        self.skipped: int = counts["skipped"]
        self.pad_token_id: int = int(self.manifest["pad_token_id"])
        self._n: int = counts["samples"]
        shards = self.manifest["shards"]
        bounds = np.asarray([s["tokens"][0] for s in shards] + [self.num_tokens], dtype=np.int64)
        check_tiling(bounds, self.num_tokens, lambda: str(self.path / MANIFEST))
        dtype, vocab = self.manifest["token_dtype"], int(self.manifest["vocab_size"])
        self._shards = TokenShards(self.path, bounds, dtype, vocab)
        self._reset()

    def _reset(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, samples={self._n}, tokens={self.num_tokens})"

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

    def read(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global token ranges ``[starts[i], stops[i])`` concatenated: ``(ids int64 [sum], mask bool [sum])``.

        Ranges may be empty and may cross shards. One positional read per range and shard (tokens and
        mask bits), straight into the result: nothing stays mapped, no per-token Python loop
        (`puzzletron.dataset.formats.shards.TokenShards`).
        """
        return self._shards.read(starts, stops)

    def close(self) -> None:
        """Close the open shard files and drop the index maps (the store stays usable: they reopen)."""
        self._shards.close()
        self._arrays.clear()

    def __enter__(self) -> TokenStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

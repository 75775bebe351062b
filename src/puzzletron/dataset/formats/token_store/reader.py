"""The token store: chat-tokenised samples of a text snapshot split, read by positional reads, every byte
checked before it is served.

The format, with an example manifest: ``docs/token-store-format.md``. Written by
`puzzletron.dataset.tokenize.store` (through `formats.token_store.writer`), checked byte for byte by
`formats.token_store.verify` (``puzzletron-data verify`` / ``inspect``), read here::

    store = TokenStore("stores/puzzle-kd-train")
    store.lengths                                    # [n] uint32, memory-mapped: all a planner needs
    ids, mask = store.read(store.offsets[[3, 7]], store.offsets[[4, 8]])   # samples 3 and 7, concatenated
    labels = labels_from_mask(ids, mask, offsets)    # puzzletron.dataset.tokenize: derived, never stored

Trust (``docs/trust-model.md``): opening checks every manifest field (`_layout.check_manifest`), that the
files are this layout's with the sizes the counts imply, and loads the block checksums (their SHA-256 is
the manifest's); it pins every file (`puzzletron.dataset.storage.local.LocalFiles`), so a store replaced
under the reader is an error, never a mix. Each 64 KiB block of a file is verified the first time a read
touches it (`formats.blocks.BlockChecks`); the index (offsets and lengths) is verified whole, with its
consistency and the shards' ranges, the first time it is used. Bytes are read with ``os.preadv`` straight
into the result, so a reader walking an epoch keeps no page of the shards mapped: its memory is the index it
touches (a few bytes a sample), the checksums (8 bytes a block) and one byte a block for what it verified.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.formats.token_store import _layout as layout
from puzzletron.dataset.formats.token_store._layout import TOKEN_STORE_FORMAT, TOKEN_STORE_VERSION
from puzzletron.dataset.storage.local import pread_into
from puzzletron.dataset.storage.objects import is_url
from puzzletron.dataset.storage.sources import ByteSource, open_source

__all__ = ["TOKEN_STORE_FORMAT", "TOKEN_STORE_VERSION", "TokenStore", "pread_into", "read_strings"]

_INDEX_CHUNK = 1 << 20  # samples of the index checked at a time


def read_strings(
    source: ByteSource, checks: _blocks.BlockChecks, rels: tuple[str, str], indices: np.ndarray
) -> list[str]:
    """Strings `indices` of a strings file pair ``rels = (offsets file, bytes file)`` (UTF-8 bytes cut by
    int64 offsets ``[m + 1]``), each byte verified; `SnapshotError` naming the file for offsets outside the
    bytes file or bytes that are not UTF-8."""
    rel_offsets, rel_bytes = rels
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if not idx.size:
        return []
    item = np.empty(2, dtype="<i8")
    size, out = source.size(rel_bytes), []
    for i in idx.tolist():  # one read a string
        checks.read_into(rel_offsets, 8 * i, item)
        a, b = int(item[0]), int(item[1])
        if not 0 <= a <= b <= size:
            raise SnapshotError(f"{checks.where}: {rel_offsets}: string {i} spans bytes {a}..{b}, not "
                                f"inside {rel_bytes} ({size} bytes)")  # fmt: skip
        buf = np.empty(b - a, np.uint8)
        checks.read_into(rel_bytes, a, buf)
        try:
            out.append(buf.tobytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise SnapshotError(
                f"{checks.where}: {rel_bytes}: string {i} is not UTF-8 ({exc.reason})"
            ) from None
    return out


def _ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concat(arange(s, s + n) for s, n in zip(starts, lengths))``, vectorised."""
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(total, dtype=np.int64)


class TokenStore:
    """A read-only view of the token store at `path`: a directory, or an URL prefix (``s3://bucket/store``,
    read through the node's object cache: `puzzletron.dataset.storage.remote`). See the module docstring.

    Attributes:
        path: the store directory (absolute), or its URL (a string).
        manifest: its parsed ``manifest.json`` (every field checked).
        num_tokens: tokens over all samples; pad_token_id: the id batches pad with; skipped: rows the
            build skipped (no supervised token), whose ids `skipped_ids` returns.

    Picklable and fork-safe: a copy carries the pins and checksums, reopens files lazily (DataLoader
    workers) and refuses files that are not the pinned ones.
    """

    def __init__(self, path: str | Path, *, source: ByteSource | None = None) -> None:
        self.path: Any = path.rstrip("/") if is_url(path) else Path(path).absolute()  # type: ignore[union-attr]
        self._files = source if source is not None else open_source(self.path)
        self.manifest = layout.read_complete_manifest(self.path, self._files if is_url(self.path) else None)
        counts = self.manifest["counts"]
        self.num_tokens: int = counts["tokens"]
        self.skipped: int = counts["skipped"]
        self.pad_token_id: int = self.manifest["pad_token_id"]
        self._n: int = counts["samples"]
        self._dtype = np.dtype(self.manifest["token_dtype"]).newbyteorder("<")
        self._vocab: int = self.manifest["vocab_size"]
        shards = self.manifest["shards"]
        self._bounds = np.asarray([s["tokens"][0] for s in shards] + [self.num_tokens], dtype=np.int64)
        for record in self.manifest["files"]:  # pinned before a byte is read: later opens must find them
            self._files.pin(record["path"])
        blocks_record = next(r for r in self.manifest["files"] if r["path"] == layout.BLOCKS)
        raw = self._files.read_bytes(layout.BLOCKS)
        if hashlib.sha256(raw).hexdigest() != blocks_record["sha256"]:
            raise SnapshotError(f"{self.path}: {layout.BLOCKS} differs from the SHA-256 the manifest records")
        files = layout.block_files(self.manifest)
        self._checks = _blocks.BlockChecks(
            self._files, files, np.frombuffer(raw, dtype="<u8"), where=str(self.path)
        )
        self._tok_base = np.asarray([self._checks.base(layout.tokens_name(k)) for k in range(len(shards))])
        self._mask_base = np.asarray([self._checks.base(layout.mask_name(k)) for k in range(len(shards))])
        self._tok_base_list, self._mask_base_list = self._tok_base.tolist(), self._mask_base.tolist()
        self._arrays: dict[str, np.ndarray] = {}
        self._index_checked = False

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"TokenStore({str(self.path)!r}, samples={self._n}, tokens={self.num_tokens})"

    def _index(self) -> dict[str, np.ndarray]:
        """The verified offsets and lengths (memory-mapped): their blocks, offsets from 0 by the lengths to
        the token count, every sample >= 2 tokens, and each shard's token range where its samples start."""
        if self._arrays:
            return self._arrays
        n, where = self._n, f"{self.path}: the index"
        self._checks.ensure_file(layout.OFFSETS)
        self._checks.ensure_file(layout.LENGTHS)
        offsets = self._files.map(layout.OFFSETS, "<i8", n + 1)
        lengths = self._files.map(layout.LENGTHS, "<u4", n)
        if not self._index_checked:
            if offsets[0] != 0 or offsets[-1] != self.num_tokens:
                raise SnapshotError(f"{where}: {layout.OFFSETS} runs from {offsets[0]} to {offsets[-1]}, "
                                    f"not 0 to {self.num_tokens}")  # fmt: skip
            for a in range(0, n, _INDEX_CHUNK):
                b = min(a + _INDEX_CHUNK, n)
                part = lengths[a:b]
                if not np.array_equal(np.diff(offsets[a : b + 1]), part.astype(np.int64)) or part.min() < 2:
                    raise SnapshotError(f"{where}: {layout.OFFSETS} and {layout.LENGTHS} disagree (or a "
                                        f"sample has < 2 tokens) in samples [{a}, {b})")  # fmt: skip
            shards = self.manifest["shards"]
            starts = np.asarray([s["samples"][0] for s in shards], dtype=np.int64)
            if shards and not np.array_equal(offsets[starts], self._bounds[:-1]):
                k = int(np.flatnonzero(offsets[starts] != self._bounds[:-1])[0])
                raise SnapshotError(f"{where}: shard {k}'s token range {shards[k]['tokens']} does not start "
                                    f"where its first sample does ({int(offsets[starts[k]])})")  # fmt: skip
            self._index_checked = True
        self._arrays = {"offsets": offsets, "lengths": lengths}
        return self._arrays

    @property
    def lengths(self) -> np.ndarray:
        """``[n]`` uint32, read-only (memory-mapped, verified): tokens of each sample."""
        return self._index()["lengths"]

    @property
    def offsets(self) -> np.ndarray:
        """``[n + 1]`` int64, read-only (memory-mapped, verified): the global token offset of each sample."""
        return self._index()["offsets"]

    def sample_ids(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """The ids of samples `indices` (read for these samples only)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self._n):
            raise ConfigError(f"sample indices must be in [0, {self._n}); got {idx.min()}..{idx.max()}")
        return read_strings(self._files, self._checks, (layout.IDS_OFFSETS, layout.IDS_BIN), idx)

    def skipped_ids(self) -> list[str]:
        """The ids of the rows the build skipped (no supervised token), in row order."""
        rels = (layout.SKIPPED_OFFSETS, layout.SKIPPED_BIN)
        return read_strings(self._files, self._checks, rels, np.arange(self.skipped))

    def read(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global token ranges ``[starts[i], stops[i])`` concatenated: ``(ids int64 [sum], mask bool [sum])``.

        Ranges may be empty and may cross shards. The blocks they touch are verified first (once per
        process); then one positional read per range and shard (tokens and mask bits), straight into the
        result: nothing stays mapped, no per-token Python loop.
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
        width = self._dtype.itemsize
        self._ensure_verified(shard, local_a * width, local_b * width, byte_a, byte_b)
        raw = np.empty(int(out[-1]) * width, dtype=np.uint8)
        packed = np.empty(int(bits_at[-1]), dtype=np.uint8)
        for j, k in enumerate(shard.tolist()):  # one read a piece: per sample, never per token
            self._files.read_into(
                layout.tokens_name(k), int(local_a[j]) * width, raw[out[j] * width : out[j + 1] * width]
            )
            self._files.read_into(layout.mask_name(k), int(byte_a[j]), packed[bits_at[j] : bits_at[j + 1]])
        ids = raw.view(self._dtype).astype(np.int64)
        if ids.size and int(ids.max()) >= self._vocab:  # checksums passed: a store written with a bad id
            raise SnapshotError(
                f"{self.path}: token id {int(ids.max())} outside the vocabulary ({self._vocab})"
            )
        bits = np.unpackbits(packed, bitorder="little")
        mask = bits[_ragged_arange(bits_at[:-1] * 8 + local_a % 8, sizes)].astype(bool)
        return ids, mask

    def _ensure_verified(
        self, shard: np.ndarray, tok_a: np.ndarray, tok_b: np.ndarray, mask_a: np.ndarray, mask_b: np.ndarray
    ) -> None:
        """Verify the blocks of the pieces' byte ranges (token files ``[tok_a, tok_b)``, mask files
        ``[mask_a, mask_b)`` of shards `shard`) not verified yet; a read of a few pieces whose blocks are
        all verified costs a few Python operations."""
        size = self._checks.block_size
        if shard.size == 1:  # one piece (a single sample): a few Python operations when verified
            k = int(shard[0])
            tok, mask = self._tok_base_list[k], self._mask_base_list[k]
            ta, tb, ma, mb = int(tok_a[0]), int(tok_b[0]), int(mask_a[0]), int(mask_b[0])
            spans = ((tok + ta // size, tok + (tb - 1) // size), (mask + ma // size, mask + (mb - 1) // size))
            if self._checks.spans_verified(spans):
                return
        self._checks.ensure_blocks(
            np.concatenate(
                [
                    _blocks.ragged_blocks(self._tok_base[shard], tok_a, tok_b, size),
                    _blocks.ragged_blocks(self._mask_base[shard], mask_a, mask_b, size),
                ]
            )
        )

    def close(self) -> None:
        """Close the open files and drop the index maps (the store stays usable: they reopen, pinned)."""
        self._files.close()
        self._arrays = {}

    def __enter__(self) -> TokenStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_arrays"] = {}
        return state

    def __del__(self) -> None:
        # At interpreter exit this module's globals may already be None: use only the builtins (the
        # pinned files close themselves the same way, `LocalFiles.__del__`).
        files = self.__dict__.get("_files")
        if files is not None:
            files.__del__()

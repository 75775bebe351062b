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

import bisect
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.formats.binary import ragged_arange
from puzzletron.dataset.formats.token_store import _layout as layout
from puzzletron.dataset.formats.token_store._layout import TOKEN_STORE_FORMAT, TOKEN_STORE_VERSION
from puzzletron.dataset.storage.local import pread_into
from puzzletron.dataset.storage.objects import is_url
from puzzletron.dataset.storage.sources import ByteSource, open_source

__all__ = ["TOKEN_STORE_FORMAT", "TOKEN_STORE_VERSION", "TokenStore", "pread_into", "read_strings"]

_INDEX_CHUNK = 1 << 20  # samples of the index checked at a time
_RELEASE_BYTES = 64 << 20  # bytes copied out of mapped shards between two releases of their pages
_FEW_RANGES = 256  # a read of at most this many ranges takes them one by one (`_piece`), no array work
_MAPPED_SHARDS = 48  # shards whose files a reader keeps as arrays over their mappings
# bits of each byte value, least significant first, as bools: a lookup that unpacks mask bytes
_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").view(bool)


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
        inspect = self._check_ids if self._vocab < 1 << (8 * self._dtype.itemsize) else None
        self._checks = _blocks.BlockChecks(
            self._files, files, np.frombuffer(raw, dtype="<u8"), where=str(self.path), inspect=inspect
        )
        self._tok_names = [layout.tokens_name(k) for k in range(len(shards))]
        self._mask_names = [layout.mask_name(k) for k in range(len(shards))]
        self._tok_base = np.asarray([self._checks.base(rel) for rel in self._tok_names])
        self._mask_base = np.asarray([self._checks.base(rel) for rel in self._mask_names])
        self._tok_base_list, self._mask_base_list = self._tok_base.tolist(), self._mask_base.tolist()
        self._bounds_list = self._bounds.tolist()
        self._arrays: dict[str, np.ndarray] = {}
        self._offsets_view: memoryview | None = None  # the verified offsets as Python ints (`sample`)
        self._index_checked = False
        self._served = [0]  # bytes copied out of mappings since their pages were last released
        self._fast: Any = None  # `sample`'s closure, made on first use
        self._fast_ids: Any = None  # `tokens`'s
        self._width = self._dtype.itemsize
        self._mapped_view = getattr(self._files, "view", None)  # local: whole files mapped; remote: None
        self._shard_arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # shard -> (tokens, mask bytes)

    def _check_ids(self, rel: str, offset: int, data: np.ndarray) -> None:
        """`BlockChecks`' inspection of verified token bytes: every id inside the vocabulary (so no read
        needs to look again)."""
        if rel.endswith(".tokens") and data.size:
            largest = int(data[: data.size - data.size % self._dtype.itemsize].view(self._dtype).max())
            if largest >= self._vocab:  # checksums passed: a store written with a bad id
                raise SnapshotError(f"{self.path}: {rel}: token id {largest} outside the vocabulary "
                                    f"({self._vocab}) in bytes {offset}..{offset + data.size}")  # fmt: skip

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
                if not np.array_equal(np.diff(offsets[a : b + 1]), part) or part.min() < 2:  # no int64 copy
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
        self._offsets_view = memoryview(offsets).cast("B").cast("q") if n else memoryview(b"").cast("q")
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

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample `index` as ``(ids int64 [n], mask bool [n])``, what `read` of its range returns, in a few
        Python operations once its blocks are verified (the path of a random single-sample read)."""
        fast = self._fast
        if fast is None:
            fast = self._fast = self._sample_function(mask=True)
        return fast(index)

    def tokens(self, index: int) -> np.ndarray:
        """Sample `index`'s ids (int64 ``[n]``, verified) without its mask: the same tokens Megatron-Core's
        `IndexedDataset[index]` gives, for a reader that derives its labels from the ids alone."""
        fast = self._fast_ids
        if fast is None:
            fast = self._fast_ids = self._sample_function(mask=False)
        return fast(index)

    def _sample_function(self, *, mask: bool) -> Any:
        """`sample` as a closure over what it reads (locals are the cheapest names Python has): the index
        as Python ints, the shard arrays over their mappings and the verified-block flags; anything else
        (a block not verified yet, a shard not mapped, a remote source) goes through `_piece`."""
        self._index()
        view, bounds, n, width = self._offsets_view, self._bounds_list, self._n, self._width
        flags, tok_base, mask_base = self._checks.verified_flags, self._tok_base_list, self._mask_base_list
        shard_arrays, piece, take, find, int64 = (
            self._shard_arrays,
            self._piece,
            _BITS.take,
            bisect.bisect_right,
            np.int64,
        )
        shift = _blocks.BLOCK_SIZE.bit_length() - 1
        served = self._served

        def sample(index: int) -> tuple[np.ndarray, np.ndarray]:
            if not 0 <= index < n:
                raise IndexError(f"sample index {index} out of range for a store of {n} samples")
            a = view[index]
            k = find(bounds, a) - 1
            start, count = a - bounds[k], view[index + 1] - a
            arrays = shard_arrays.get(k)
            ta, tz, ma, mz = start * width, (start + count) * width, start >> 3, (start + count + 7) >> 3
            first, last = tok_base[k] + (ta >> shift), tok_base[k] + ((tz - 1) >> shift)
            mfirst, mlast = mask_base[k] + (ma >> shift), mask_base[k] + ((mz - 1) >> shift)
            if (
                arrays is None
                or not (flags[first] and flags[last] and flags[mfirst] and flags[mlast])
                or (last - first > 1 or mlast - mfirst > 1 or served[0] > _RELEASE_BYTES)
            ):
                out = piece(k, start, count)
                return out if mask else out[0]
            served[0] += tz - ta
            if not mask:
                return arrays[0][start : start + count].astype(int64)
            bit = start & 7
            return arrays[0][start : start + count].astype(int64), take(arrays[1][ma:mz], axis=0).reshape(-1)[
                bit : bit + count
            ]

        return sample

    def _piece(self, k: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[start, start + count)`` of shard `k` (count >= 1): verified, copied out of the local
        mapping (no system call) or read from the source; the mask bits unpacked."""
        width, size = self._width, _blocks.BLOCK_SIZE
        ta, tz, ma, mz = start * width, (start + count) * width, start >> 3, (start + count + 7) >> 3
        tb, mb, flags = self._tok_base_list[k], self._mask_base_list[k], self._checks.verified_flags
        first, last, mfirst, mlast = (
            tb + ta // size,
            tb + (tz - 1) // size,
            mb + ma // size,
            mb + (mz - 1) // size,
        )
        if not (flags[first] and flags[last] and flags[mfirst] and flags[mlast]) or (
            last - first > 1 or mlast - mfirst > 1
        ):
            one = np.array([k])
            self._ensure_verified(one, one * 0 + ta, one * 0 + tz, one * 0 + ma, one * 0 + mz)
        arrays = self._shard_arrays.get(k) or self._map_shard(k)
        if arrays is not None:
            ids = arrays[0][start : start + count].astype(np.int64)
            packed = arrays[1][ma:mz]
            self._served[0] += tz - ta
            if self._served[0] > _RELEASE_BYTES:
                self._release()
        else:
            raw, packed = np.empty(count, self._dtype), np.empty(mz - ma, np.uint8)
            self._files.read_into(self._tok_names[k], ta, raw)
            self._files.read_into(self._mask_names[k], ma, packed)
            ids = raw.astype(np.int64)
        bit = start & 7
        return ids, _BITS.take(packed, axis=0).reshape(-1)[bit : bit + count]

    def _map_shard(self, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Shard `k`'s token and mask files as arrays over the source's mappings (None for a source that
        maps nothing: object storage); at most `_MAPPED_SHARDS` shards at a time."""
        mapped = self._mapped_view
        if mapped is None:
            return None
        if len(self._shard_arrays) >= _MAPPED_SHARDS:
            self._shard_arrays.pop(next(iter(self._shard_arrays)))
        arrays = (
            np.frombuffer(mapped(self._tok_names[k]), self._dtype),
            np.frombuffer(mapped(self._mask_names[k]), np.uint8),
        )
        self._shard_arrays[k] = arrays
        return arrays

    def _release(self) -> None:
        """Drop the mapped pages this reader touched from its resident memory (they stay in the page
        cache): an epoch keeps a flat resident size."""
        self._served[0] = 0
        self._files.release()  # type: ignore[attr-defined]

    def read(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global token ranges ``[starts[i], stops[i])`` concatenated: ``(ids int64 [sum], mask bool [sum])``.

        Ranges may be empty and may cross shards. The blocks they touch are verified first (once per
        process); then one positional read per range and shard (tokens and mask bits), straight into the
        result: nothing stays mapped, no per-token Python loop.
        """
        if len(starts) == 1 == len(stops):  # one range (an epoch's read): Python ints, no array work
            a, b = int(starts[0]), int(stops[0])
            k = bisect.bisect_right(self._bounds_list, a) - 1
            if 0 <= a < b <= self._bounds_list[k + 1] and b <= self.num_tokens:
                return self._piece(k, a - self._bounds_list[k], b - a)
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
        if 0 < starts.size <= _FEW_RANGES and np.array_equal(first, last):  # a batch's samples, none crossing
            bounds = self._bounds_list
            pieces = [
                self._piece(k, a - bounds[k], b - a)
                for k, a, b in zip(first.tolist(), starts.tolist(), stops.tolist(), strict=True)
            ]
            if len(pieces) == 1:
                return pieces[0]
            return np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces])
        # one piece per (range, shard it touches), in output order
        shard = ragged_arange(first, last - first + 1)
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
        tok_at, out_at = (local_a * width).tolist(), (out * width).tolist()
        mask_at, mask_end, packed_at = byte_a.tolist(), byte_b.tolist(), bits_at.tolist()
        mapped, view = self._mapped_view, memoryview(raw)
        packed_view = memoryview(packed)
        for j, k in enumerate(shard.tolist()):  # one copy (or read) a piece: per sample, never per token
            oa, oz, ma, mz = out_at[j], out_at[j + 1], mask_at[j], mask_end[j]
            if mapped is not None:
                ta = tok_at[j]
                view[oa:oz] = mapped(self._tok_names[k])[ta : ta + oz - oa]
                packed_view[packed_at[j] : packed_at[j + 1]] = mapped(self._mask_names[k])[ma:mz]
            else:
                self._files.read_into(self._tok_names[k], tok_at[j], raw[oa:oz])
                self._files.read_into(self._mask_names[k], ma, packed[packed_at[j] : packed_at[j + 1]])
        if mapped is not None:
            self._served[0] += raw.size
            if self._served[0] > _RELEASE_BYTES:
                self._release()
        ids = raw.view(self._dtype).astype(np.int64)
        bits = np.unpackbits(packed, bitorder="little")
        mask = bits[ragged_arange(bits_at[:-1] * 8 + local_a % 8, sizes)].astype(bool)
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
        self._shard_arrays.clear()
        self._files.close()
        self._arrays, self._offsets_view, self._fast, self._fast_ids = {}, None, None, None

    def __enter__(self) -> TokenStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(
            _arrays={}, _offsets_view=None, _served=[0], _shard_arrays={}, _fast=None, _fast_ids=None
        )
        return state

    def __del__(self) -> None:
        # At interpreter exit this module's globals may already be None: use only the builtins (the
        # pinned files close themselves the same way, `LocalFiles.__del__`).
        files = self.__dict__.get("_files")
        if files is not None:
            files.__del__()

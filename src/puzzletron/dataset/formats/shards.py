"""Token shards and per-shard index parts: what the token store and the VLM store share on disk.

A sharded store keeps every sample's token ids (``shards/<k>.tokens``, ``token_dtype`` little-endian) and
its supervision mask (``shards/<k>.mask``, one bit a token, ``np.packbits(bitorder="little")``) in shards of
fixed row ranges, and an index (``index/...``) concatenated from the shards' parts. Building writes each
shard into a build directory of its own: the token and mask files (`TokenShardWriter`, streamed and hashed
as written), index parts (`write_part`; an *offsets* part is int64 ``[m + 1]`` from 0) and ``record.json``
(`write_record`, last). Assembly links the shard files into the store (`link_shard_files`) and
concatenates the parts (`assemble_index`: offsets parts rebased, the others appended). Reading
(`TokenShards`) serves global token ranges with positional reads straight into the result.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.formats.binary import HashingFile, pread_into, ragged_arange
from puzzletron.dataset.formats.manifest import MANIFEST, check_file, load_json

__all__ = [
    "IDS_BIN",
    "IDS_OFFSETS",
    "LENGTHS",
    "OFFSETS",
    "RECORD",
    "SKIPPED_BIN",
    "SKIPPED_OFFSETS",
    "IndexPart",
    "TokenShardWriter",
    "TokenShards",
    "assemble_index",
    "check_complete",
    "check_tiling",
    "count_of",
    "link_shard_files",
    "load_format_manifest",
    "mask_name",
    "read_shard_record",
    "shard_file_sizes",
    "tokens_name",
    "write_part",
    "write_record",
]

RECORD = "record.json"  # a finished shard's record, in its build directory (written last)
# The token index every sharded store has (docs/token-store-format.md).
OFFSETS = "index/offsets.i64"  # [n + 1] int64: global token offset of each sample
LENGTHS = "index/lengths.u32"  # [n] uint32: tokens of each sample
IDS_BIN = "index/ids.bin"  # sample ids, UTF-8, concatenated
IDS_OFFSETS = "index/ids.i64"  # [n + 1] int64: byte offset of each id in ids.bin
SKIPPED_BIN = "skipped/ids.bin"  # ids of the rows not kept
SKIPPED_OFFSETS = "skipped/ids.i64"  # [skipped + 1] int64: byte offsets into skipped/ids.bin
_CHUNK = 1 << 24
_MAX_OPEN_SHARDS = 64  # file descriptors kept open (two a shard), least recently used closed first


def tokens_name(shard: int) -> str:
    """The token file of shard `shard` (its samples' ids, little-endian ``token_dtype``)."""
    return f"shards/{shard:06d}.tokens"


def mask_name(shard: int) -> str:
    """The mask file of shard `shard` (one bit a token, ``np.packbits(bitorder="little")``)."""
    return f"shards/{shard:06d}.mask"


class TokenShardWriter:
    """A shard's ``tokens`` and ``mask`` files in its build directory, streamed: tokens as `dtype`
    (little-endian) and mask bits go straight to disk (at most 7 bits wait for the next call)."""

    def __init__(self, directory: Path, dtype: str) -> None:
        self._dtype = np.dtype(dtype).newbyteorder("<")
        self._tokens = HashingFile(Path(directory) / "tokens")
        self._mask = HashingFile(Path(directory) / "mask")
        self._carry = np.zeros(0, dtype=bool)

    def add(self, input_ids: np.ndarray, mask: np.ndarray) -> None:
        """Append flat ``input_ids`` ``[N]`` and their ``mask`` ``[N]``."""
        if input_ids.size and int(input_ids.max()) > np.iinfo(self._dtype).max:
            raise SnapshotError(
                f"token id {int(input_ids.max())} does not fit the store's {self._dtype.name}"
            )
        self._tokens.write(np.ascontiguousarray(input_ids, dtype=self._dtype))
        bits = np.concatenate([self._carry, np.asarray(mask, dtype=bool)])
        whole = bits.size - bits.size % 8
        self._mask.write(np.packbits(bits[:whole], bitorder="little"))
        self._carry = bits[whole:]

    def finish(self) -> dict[str, dict[str, Any]]:
        """Write the last mask bits and close: ``{"tokens": {bytes, sha256}, "mask": {...}}``."""
        self._mask.write(np.packbits(self._carry, bitorder="little"))
        return {"tokens": self._tokens.close(), "mask": self._mask.close()}


def write_part(directory: Path, name: str, data: bytes | np.ndarray) -> None:
    """One whole index part of a shard (little-endian arrays, or bytes)."""
    part = HashingFile(Path(directory) / name)
    part.write(data)
    part.close()


def write_record(directory: Path, record: Mapping[str, Any]) -> None:
    """The shard's ``record.json``: written last, so its presence means the parts are complete."""
    write_part(directory, RECORD, json.dumps(record, sort_keys=True).encode())


def read_shard_record(directory: Path, rows: tuple[int, int], parts: Sequence[str]) -> dict[str, Any] | None:
    """The record of the finished shard in `directory` when it covers `rows` and its `parts` (plus the
    token and mask files) are there with their recorded sizes; None otherwise (then it is built again)."""
    try:
        record = load_json(directory / RECORD, "the shard record")
    except SnapshotError:
        return None
    if not isinstance(record, dict) or record.get("rows") != list(rows):
        return None
    sizes = record.get("files", {})
    for name in ("tokens", "mask", *parts):
        path = directory / name
        if not path.is_file() or (name in sizes and path.stat().st_size != sizes[name].get("bytes")):
            return None
    return record


def _link(source: Path, target: Path) -> None:
    """Hard-link `source` as `target` (the shard stays in the build directory until publication); a file
    system without hard links moves it instead."""
    try:
        os.link(source, target)
    except OSError:
        os.replace(source, target)


def link_shard_files(
    tmp: Path, shard_dirs: Sequence[Path], records: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Link every shard's token and mask files into the store at `tmp`; their file records."""
    (tmp / "shards").mkdir(exist_ok=True)
    files = []
    for k, (directory, record) in enumerate(zip(shard_dirs, records, strict=True)):
        for part, rel in (("tokens", tokens_name(k)), ("mask", mask_name(k))):
            _link(directory / part, tmp / rel)
            files.append({"path": rel, **record["files"][part]})
    return files


@dataclass(frozen=True)
class IndexPart:
    """One file of the index: ``part`` in every shard's build directory, ``rel`` in the store. An
    ``offsets`` part is int64 ``[m + 1]`` from 0 per shard; the store's is rebased and concatenated
    (``0``, then each shard's ``[1:]`` plus the ends of the shards before it)."""

    part: str
    rel: str
    offsets: bool = False


def assemble_index(tmp: Path, shard_dirs: Sequence[Path], parts: Sequence[IndexPart]) -> list[dict[str, Any]]:
    """Write the store's index files at `tmp` from the shards' parts, shard by shard (memory: one shard's
    part at a time); their file records."""
    out = {}
    for spec in parts:
        (tmp / spec.rel).parent.mkdir(parents=True, exist_ok=True)
        out[spec.rel] = HashingFile(tmp / spec.rel)
        if spec.offsets:
            out[spec.rel].write(np.zeros(1, "<i8"))
    bases = dict.fromkeys((p.rel for p in parts if p.offsets), 0)
    for directory in shard_dirs:
        for spec in parts:
            if spec.offsets:
                offsets = np.fromfile(directory / spec.part, dtype="<i8")
                out[spec.rel].write(bases[spec.rel] + offsets[1:])
                bases[spec.rel] += int(offsets[-1])
            else:
                with open(directory / spec.part, "rb") as fh:
                    while chunk := fh.read(_CHUNK):
                        out[spec.rel].write(chunk)
    return [{"path": rel, **writer.close()} for rel, writer in out.items()]


class TokenShards:
    """Global token ranges of a sharded store, read with ``os.preadv`` straight into the result.

    ``bounds`` ``[shards + 1]`` are the global token offsets of the shards; ``dtype`` the tokens' dtype;
    ids at or above ``vocab_size`` are refused (a damaged shard; `verify` hashes every byte). Nothing stays
    mapped; picklable (file descriptors reopen lazily, e.g. in DataLoader workers).
    """

    def __init__(self, root: Path, bounds: np.ndarray, dtype: str, vocab_size: int) -> None:
        self.root = Path(root)
        self._bounds = np.asarray(bounds, dtype=np.int64)
        self._dtype = np.dtype(dtype).newbyteorder("<")
        self._vocab = int(vocab_size)
        self.num_tokens = int(self._bounds[-1]) if self._bounds.size else 0
        self._fds: OrderedDict[int, tuple[int, int]] = OrderedDict()

    def _shard_fds(self, shard: int) -> tuple[int, int]:
        fds = self._fds.get(shard)
        if fds is not None:
            self._fds.move_to_end(shard)
            return fds
        flags = os.O_RDONLY | os.O_CLOEXEC
        tokens = os.open(self.root / tokens_name(shard), flags)
        try:
            fds = (tokens, os.open(self.root / mask_name(shard), flags))
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
        bounds = self._bounds
        first = np.searchsorted(bounds, starts, side="right") - 1
        last = np.searchsorted(bounds, stops - 1, side="right") - 1
        # one piece per (range, shard it touches), in output order
        shard = ragged_arange(first, last - first + 1)
        owner = np.repeat(np.arange(starts.size), last - first + 1)
        local_a = np.maximum(starts[owner], bounds[shard]) - bounds[shard]
        local_b = np.minimum(stops[owner], bounds[shard + 1]) - bounds[shard]
        sizes = local_b - local_a
        out = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(sizes, out=out[1:])
        byte_a, byte_b = local_a // 8, (local_b + 7) // 8
        bits_at = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(byte_b - byte_a, out=bits_at[1:])
        width = self._dtype.itemsize
        raw = np.empty(int(out[-1]) * width, dtype=np.uint8)
        packed = np.empty(int(bits_at[-1]), dtype=np.uint8)
        for j, k in enumerate(shard.tolist()):  # one read a piece: per sample, never per token
            fd_tokens, fd_mask = self._shard_fds(k)
            where = f"{self.root}: shard {k}"
            pread_into(fd_tokens, raw[out[j] * width : out[j + 1] * width], int(local_a[j]) * width, where)
            pread_into(fd_mask, packed[bits_at[j] : bits_at[j + 1]], int(byte_a[j]), where)
        ids = raw.view(self._dtype).astype(np.int64)
        if ids.size and int(ids.max()) >= self._vocab:  # a damaged shard (same size: verify hashes it)
            raise SnapshotError(
                f"{self.root}: token id {int(ids.max())} outside the vocabulary ({self._vocab})"
            )
        bits = np.unpackbits(packed, bitorder="little")
        mask = bits[ragged_arange(bits_at[:-1] * 8 + local_a % 8, sizes)].astype(bool)
        return ids, mask

    def close(self) -> None:
        """Close the open shard files (they reopen on the next read)."""
        while self._fds:
            for fd in self._fds.popitem()[1]:
                os.close(fd)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": OrderedDict()}

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:
        # At interpreter exit this module's globals may already be None (os): use only what the default
        # argument and the builtins hold, and print nothing.
        fds = self.__dict__.get("_fds") or {}
        while fds:
            for fd in fds.popitem()[1]:
                try:  # noqa: SIM105 (contextlib may be None by now)
                    _close(fd)
                except OSError:
                    pass


def check_tiling(bounds: np.ndarray, total: int, where: Callable[[], str]) -> None:
    """`SnapshotError` unless shard token ranges ``bounds`` start at 0 and never decrease to `total`."""
    if bounds.size > 1 and (bounds[0] != 0 or np.any(np.diff(bounds) < 0) or bounds[-1] != total):
        raise SnapshotError(f"{where()}: shard token ranges do not tile [0, {total})")


# ------------------------------------------------------------------------------------- manifest checks


def load_format_manifest(root: Path, fmt: str, version: int, what: str) -> dict[str, Any]:
    """The manifest at `root`, checked for its format and version (not for completeness)."""
    where = root / MANIFEST
    manifest = load_json(where, "the manifest")
    if not isinstance(manifest, dict):
        raise SnapshotError(f"{where}: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != fmt:
        raise SnapshotError(f"{where}: a {manifest.get('format')!r} manifest, not a {what}")
    if manifest.get("version") != version:
        raise SnapshotError(
            f"{where}: {what} version {manifest.get('version')!r} is not supported "
            f"(this code reads {version})"
        )
    return manifest


def count_of(manifest: Mapping[str, Any], key: str, where: Path) -> int:
    """``manifest["counts"][key]``, checked to be an int >= 0."""
    counts = manifest.get("counts")
    value = counts.get(key) if isinstance(counts, Mapping) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SnapshotError(f"{where}: counts.{key} is {value!r}; expected an int >= 0")
    return value


def shard_file_sizes(manifest: Mapping[str, Any], where: Path) -> dict[str, int]:
    """Path -> byte size of every shard's token and mask file, from ``shards[k].tokens`` and
    ``token_dtype``; `SnapshotError` for a malformed manifest."""
    if manifest.get("token_dtype") not in ("uint16", "uint32"):
        raise SnapshotError(
            f"{where}: token_dtype is {manifest.get('token_dtype')!r}; expected uint16 or uint32"
        )
    itemsize = np.dtype(manifest["token_dtype"]).itemsize
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise SnapshotError(f"{where}: 'shards' is {shards!r}; expected a list")
    sizes = {}
    for k, shard in enumerate(shards):
        tokens = shard.get("tokens") if isinstance(shard, Mapping) else None
        if not (isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, int) for t in tokens)):
            raise SnapshotError(f"{where}: shards[{k}].tokens is {tokens!r}; expected [start, stop]")
        count = tokens[1] - tokens[0]
        sizes[tokens_name(k)] = count * itemsize
        sizes[mask_name(k)] = (count + 7) // 8
    return sizes


def check_complete(
    root: Path,
    manifest: Mapping[str, Any],
    sizes: Mapping[str, int],
    unsized: set[str],
    *,
    within: str,
    what: str,
) -> None:
    """That ``files`` lists exactly the files of `sizes` (path -> the size the counts imply) and `unsized`
    (string bytes, whose size only their offsets tell), each there with its recorded size; `SnapshotError`
    naming the problems otherwise. Reads no data."""
    records = manifest.get("files")
    if not isinstance(records, list):
        raise SnapshotError(f"{root / MANIFEST}: 'files' is {records!r}; expected a list of file records")
    listed = {r.get("path"): r for r in records if isinstance(r, Mapping)}
    expected = set(sizes) | unsized
    if set(listed) != expected or len(records) != len(expected):
        missing, extra = sorted(expected - set(listed)), sorted(set(listed) - expected, key=str)
        raise SnapshotError(
            f"{root}: the manifest's files are not this layout's (missing {missing}, unexpected {extra})"
        )
    problems = []
    for rel, record in sorted(listed.items()):
        try:
            check_file(root, record, within=within)
        except SnapshotError as exc:
            problems.append(str(exc))
            continue
        if rel in sizes and record.get("bytes") != sizes[rel]:
            problems.append(f"{root}: {rel} has {record.get('bytes')} bytes; its counts imply {sizes[rel]}")
    if problems:
        raise SnapshotError(f"{root}: incomplete or damaged {what}: {'; '.join(problems[:5])}")

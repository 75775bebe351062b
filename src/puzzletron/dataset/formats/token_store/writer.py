"""Write a token store: one shard at a time (`ShardWriter`, streaming, in a shard's build directory), then
the store from its finished shards (`assemble_store`: shard files linked in, the index concatenated, the
manifest written last).

The format: ``docs/token-store-format.md``. A shard's build directory holds its token and mask files (they
become ``shards/<k>.tokens`` / ``.mask`` of the store), its part of the index (``lengths.u32``, ``ids.bin``
/ ``ids.i64``, ``skipped.bin`` / ``skipped.i64``, in the store's encodings with offsets from 0) and
``blocks.u64`` (the block checksums of the token then the mask file, `formats.blocks`) and ``record.json``
(counts, and the size and SHA-256 of the token and mask files, all hashed while written).
Nothing here is random or dated: the same rows and tokenizer give the same bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.formats.binary import HashingFile, encode_strings
from puzzletron.dataset.formats.manifest import MANIFEST, load_json
from puzzletron.dataset.formats.token_store import _layout as layout

__all__ = ["RECORD", "ShardWriter", "assemble_store", "read_shard_record"]

RECORD = "record.json"  # a finished shard's record, in its build directory
_PARTS = ("tokens", "mask", "blocks.u64", "lengths.u32", "ids.bin", "ids.i64", "skipped.bin", "skipped.i64")
_CHUNK = 1 << 24


class ShardWriter:
    """The files of one shard, written into its (empty) build directory as batches of rows arrive.

    ``add`` takes a batch's flat ids / mask / offsets and which rows to keep; kept rows' tokens (as
    `dtype`, little-endian) and mask bits go straight to disk (at most 7 bits wait for the next batch),
    their lengths and ids stay in memory until `finish` (``rows_per_shard`` entries at most).
    """

    def __init__(self, directory: Path, dtype: str) -> None:
        self.directory = Path(directory)
        self._dtype = np.dtype(dtype).newbyteorder("<")
        self._tokens = HashingFile(self.directory / "tokens")
        self._mask = HashingFile(self.directory / "mask")
        self._carry = np.zeros(0, dtype=bool)
        self._lengths: list[np.ndarray] = []
        self._ids: list[str] = []
        self._skipped: list[str] = []
        self._supervised = 0

    def add(
        self,
        input_ids: np.ndarray,
        mask: np.ndarray,
        lengths: np.ndarray,
        sample_ids: Sequence[str],
        *,
        supervised: np.ndarray,
    ) -> None:
        """Append the rows with ``supervised > 0``: flat ``input_ids`` / ``mask`` ``[N]`` of those rows,
        their ``lengths``, and every row's id and ``supervised`` count (rows with 0 are recorded skipped)."""
        keep = supervised > 0
        if input_ids.size and int(input_ids.max()) > np.iinfo(self._dtype).max:
            raise SnapshotError(
                f"token id {int(input_ids.max())} does not fit the store's {self._dtype.name}"
            )
        self._tokens.write(np.ascontiguousarray(input_ids, dtype=self._dtype))
        bits = np.concatenate([self._carry, np.asarray(mask, dtype=bool)])
        whole = bits.size - bits.size % 8
        self._mask.write(np.packbits(bits[:whole], bitorder="little"))
        self._carry = bits[whole:]
        self._lengths.append(np.asarray(lengths, dtype="<u4"))
        self._ids += [s for s, k in zip(sample_ids, keep.tolist(), strict=True) if k]
        self._skipped += [s for s, k in zip(sample_ids, keep.tolist(), strict=True) if not k]
        self._supervised += int(supervised.sum())

    def finish(self, *, rows: tuple[int, int]) -> dict[str, Any]:
        """Write the rest (last mask bits, index parts, ``record.json``); return the record. The caller
        fsyncs the directory (`_atomic.fsync_tree`) before renaming it complete."""
        self._mask.write(np.packbits(self._carry, bitorder="little"))
        files = {"tokens": self._tokens.close(), "mask": self._mask.close()}
        sums = np.concatenate([self._tokens.block_sums, self._mask.block_sums]).astype("<u8")
        lengths = np.concatenate([np.zeros(0, "<u4"), *self._lengths])
        for name, data in (
            ("blocks.u64", sums.tobytes()),
            ("lengths.u32", lengths.tobytes()),
            *zip(("ids.bin", "ids.i64"), encode_strings(self._ids), strict=True),
            *zip(("skipped.bin", "skipped.i64"), encode_strings(self._skipped), strict=True),
        ):
            part = HashingFile(self.directory / name)
            part.write(data)
            part.close()
        record = {
            "rows": list(rows),
            "samples": len(self._ids),
            "skipped": len(self._skipped),
            "tokens": int(lengths.sum(dtype=np.int64)),
            "supervised_tokens": self._supervised,
            "files": files,
        }
        part = HashingFile(self.directory / RECORD)
        part.write(json.dumps(record, sort_keys=True).encode())
        part.close()
        return record


def read_shard_record(directory: Path, rows: tuple[int, int]) -> dict[str, Any] | None:
    """The record of the finished shard in `directory` when it covers `rows` and its files are there with
    their sizes; None otherwise (then the shard is built again)."""
    try:
        record = load_json(directory / RECORD, "the shard record")
    except SnapshotError:
        return None
    if not isinstance(record, dict) or record.get("rows") != list(rows):
        return None
    sizes = {name: (part or {}).get("bytes") for name, part in record.get("files", {}).items()}
    if isinstance(sizes.get("tokens"), int) and isinstance(sizes.get("mask"), int):
        sizes["blocks.u64"] = 8 * (_blocks.block_count(sizes["tokens"]) + _blocks.block_count(sizes["mask"]))
    for name in _PARTS:
        path = directory / name
        if not path.is_file() or (name in sizes and path.stat().st_size != sizes[name]):
            return None
    return record


def _shard_sums(directory: Path, record: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The block checksums of a finished shard's token and mask files."""
    sums = np.fromfile(directory / "blocks.u64", dtype="<u8")
    split = _blocks.block_count(record["files"]["tokens"]["bytes"])
    return sums[:split], sums[split:]


def _link(source: Path, target: Path) -> None:
    """Hard-link `source` as `target` (the shard stays in the build directory until publication); a file
    system without hard links moves it instead."""
    try:
        os.link(source, target)
    except OSError:
        os.replace(source, target)


def _append_file(out: HashingFile, source: Path) -> None:
    with open(source, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            out.write(chunk)


def assemble_store(
    tmp: Path,
    shard_dirs: Sequence[Path],
    records: Sequence[Mapping[str, Any]],
    *,
    fields: Mapping[str, Any],
    link_shards: bool = True,
) -> dict[str, Any]:
    """Write the store into the empty directory `tmp` from finished shards (`shard_dirs`, with their
    `records`, in shard order); `fields` are the manifest's identity and tokenizer facts (``identity``,
    ``identity_sha256``, ``token_dtype``, ``vocab_size``, ``pad_token_id``, ``rows_per_shard``,
    ``built_with``). The index is written shard by shard (memory: one shard's index). Returns the manifest,
    written last. ``link_shards=False``: the shards' token and mask files are not there (on object storage
    they are uploaded already); only the index, the checksums and the manifest are written."""
    for rel in (layout.OFFSETS, layout.SKIPPED_OFFSETS, layout.tokens_name(0)):
        (tmp / rel).parent.mkdir(exist_ok=True)
    out = {
        rel: HashingFile(tmp / rel)
        for rel in (layout.OFFSETS, layout.LENGTHS, layout.IDS_BIN, layout.IDS_OFFSETS)
    }
    out |= {rel: HashingFile(tmp / rel) for rel in (layout.SKIPPED_BIN, layout.SKIPPED_OFFSETS)}
    zero = np.zeros(1, "<i8")
    for rel in (layout.OFFSETS, layout.IDS_OFFSETS, layout.SKIPPED_OFFSETS):
        out[rel].write(zero)
    files, shards = [], []
    sums: dict[str, np.ndarray] = {}
    tokens, samples = 0, 0
    string_bases = {layout.IDS_OFFSETS: 0, layout.SKIPPED_OFFSETS: 0}
    for k, (directory, record) in enumerate(zip(shard_dirs, records, strict=True)):
        lengths = np.fromfile(directory / "lengths.u32", dtype="<u4")
        if lengths.size != record["samples"] or int(lengths.sum(dtype=np.int64)) != record["tokens"]:
            raise SnapshotError(f"{directory}: the shard's lengths do not match its record; rebuild it")
        out[layout.LENGTHS].write(lengths)
        out[layout.OFFSETS].write(tokens + np.cumsum(lengths, dtype="<i8"))
        for rel, name, strings in (
            (layout.IDS_OFFSETS, "ids", layout.IDS_BIN),
            (layout.SKIPPED_OFFSETS, "skipped", layout.SKIPPED_BIN),
        ):
            offsets = np.fromfile(directory / f"{name}.i64", dtype="<i8")
            out[rel].write(string_bases[rel] + offsets[1:])
            string_bases[rel] += int(offsets[-1])
            _append_file(out[strings], directory / f"{name}.bin")
        parts = (("tokens", layout.tokens_name(k)), ("mask", layout.mask_name(k)))
        for (part, rel), part_sums in zip(parts, _shard_sums(directory, record), strict=True):
            if link_shards:
                _link(directory / part, tmp / rel)
            files.append({"path": rel, **record["files"][part]})
            sums[rel] = part_sums
        shard = {
            "rows": record["rows"],
            "samples": [samples, samples + record["samples"]],
            "tokens": [tokens, tokens + record["tokens"]],
        }
        shards.append(shard)
        samples, tokens = shard["samples"][1], shard["tokens"][1]
    for rel, writer in out.items():
        files.append({"path": rel, **writer.close()})
        sums[rel] = writer.block_sums
    blocks = HashingFile(tmp / layout.BLOCKS)
    for rel in sorted(sums):  # the manifest's files order, the checksum file itself left out
        blocks.write(np.asarray(sums[rel], dtype="<u8"))
    files.append({"path": layout.BLOCKS, **blocks.close()})
    manifest = {
        **fields,
        "format": layout.TOKEN_STORE_FORMAT,
        "version": layout.TOKEN_STORE_VERSION,
        "block_checksums": {"algorithm": _blocks.ALGORITHM, "block_size": _blocks.BLOCK_SIZE},
        "counts": {
            "rows": sum(r["rows"][1] - r["rows"][0] for r in records),
            "samples": samples,
            "skipped": sum(r["skipped"] for r in records),
            "tokens": tokens,
            "supervised_tokens": sum(r["supervised_tokens"] for r in records),
            "shards": len(records),
        },
        "shards": shards,
        "files": sorted(files, key=lambda r: r["path"]),
    }
    manifest["content_sha256"] = layout.content_sha256(manifest)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest

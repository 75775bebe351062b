"""Write a token store: one shard at a time (`ShardWriter`, streaming, in a shard's build directory), then
the store from its finished shards (`assemble_store`: shard files linked in, the index concatenated, the
manifest written last).

The format: ``docs/token-store-format.md``. A shard's build directory holds its token and mask files (they
become ``shards/<k>.tokens`` / ``.mask`` of the store), its part of the index (``offsets.i64``,
``lengths.u32``, ``ids.bin`` / ``ids.i64``, ``skipped.bin`` / ``skipped.i64``, in the store's encodings with
offsets from 0) and ``record.json`` (counts, and the size and SHA-256 of the token and mask files, hashed
while written). The shared machinery is `puzzletron.dataset.formats.shards`. Nothing here is random or
dated: the same rows and tokenizer give the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.binary import encode_strings
from puzzletron.dataset.formats.manifest import MANIFEST
from puzzletron.dataset.formats.shards import (
    RECORD,
    IndexPart,
    TokenShardWriter,
    assemble_index,
    link_shard_files,
    write_part,
    write_record,
)
from puzzletron.dataset.formats.shards import read_shard_record as _read_record
from puzzletron.dataset.formats.token_store import _layout as layout

__all__ = ["INDEX_PARTS", "RECORD", "ShardWriter", "assemble_store", "read_shard_record"]

# The index of a token store, part by part (docs/token-store-format.md).
INDEX_PARTS = (
    IndexPart("offsets.i64", layout.OFFSETS, offsets=True),
    IndexPart("lengths.u32", layout.LENGTHS),
    IndexPart("ids.bin", layout.IDS_BIN),
    IndexPart("ids.i64", layout.IDS_OFFSETS, offsets=True),
    IndexPart("skipped.bin", layout.SKIPPED_BIN),
    IndexPart("skipped.i64", layout.SKIPPED_OFFSETS, offsets=True),
)


class ShardWriter:
    """The files of one shard, written into its (empty) build directory as batches of rows arrive.

    ``add`` takes a batch's flat ids / mask / offsets and which rows to keep; kept rows' tokens and mask
    bits go straight to disk (`TokenShardWriter`), their lengths and ids stay in memory until `finish`
    (``rows_per_shard`` entries at most).
    """

    def __init__(self, directory: Path, dtype: str) -> None:
        self.directory = Path(directory)
        self._shard = TokenShardWriter(self.directory, dtype)
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
        keep = (supervised > 0).tolist()
        self._shard.add(input_ids, mask)
        self._lengths.append(np.asarray(lengths, dtype="<u4"))
        self._ids += [s for s, k in zip(sample_ids, keep, strict=True) if k]
        self._skipped += [s for s, k in zip(sample_ids, keep, strict=True) if not k]
        self._supervised += int(supervised.sum())

    def finish(self, *, rows: tuple[int, int]) -> dict[str, Any]:
        """Write the rest (last mask bits, index parts, ``record.json``); return the record. The caller
        fsyncs the directory before renaming it complete."""
        files = self._shard.finish()
        lengths = np.concatenate([np.zeros(0, "<u4"), *self._lengths])
        offsets = np.zeros(lengths.size + 1, "<i8")
        np.cumsum(lengths, out=offsets[1:])
        write_part(self.directory, "offsets.i64", offsets)
        write_part(self.directory, "lengths.u32", lengths)
        for name, strings in (("ids", self._ids), ("skipped", self._skipped)):
            data, string_offsets = encode_strings(strings)
            write_part(self.directory, f"{name}.bin", data)
            write_part(self.directory, f"{name}.i64", string_offsets)
        record = {
            "rows": list(rows),
            "samples": len(self._ids),
            "skipped": len(self._skipped),
            "tokens": int(offsets[-1]),
            "supervised_tokens": self._supervised,
            "files": files,
        }
        write_record(self.directory, record)
        return record


def read_shard_record(directory: Path, rows: tuple[int, int]) -> dict[str, Any] | None:
    """The record of the finished shard in `directory` when it covers `rows` and its files are there with
    their sizes; None otherwise (then the shard is built again)."""
    return _read_record(directory, rows, [p.part for p in INDEX_PARTS])


def assemble_store(
    tmp: Path, shard_dirs: Sequence[Path], records: Sequence[Mapping[str, Any]], *, fields: Mapping[str, Any]
) -> dict[str, Any]:
    """Write the store into the empty directory `tmp` from finished shards (`shard_dirs`, with their
    `records`, in shard order); `fields` are the manifest's identity and tokenizer facts (``identity``,
    ``identity_sha256``, ``token_dtype``, ``vocab_size``, ``pad_token_id``, ``rows_per_shard``,
    ``built_with``). The index is written shard by shard (memory: one shard's index). Returns the manifest,
    written last."""
    for directory, record in zip(shard_dirs, records, strict=True):
        lengths = np.fromfile(directory / "lengths.u32", dtype="<u4")
        if lengths.size != record["samples"] or int(lengths.sum(dtype=np.int64)) != record["tokens"]:
            raise SnapshotError(f"{directory}: the shard's lengths do not match its record; rebuild it")
    files = link_shard_files(tmp, shard_dirs, records)
    files += assemble_index(tmp, shard_dirs, INDEX_PARTS)
    shards, tokens, samples = [], 0, 0
    for record in records:
        shard = {
            "rows": record["rows"],
            "samples": [samples, samples + record["samples"]],
            "tokens": [tokens, tokens + record["tokens"]],
        }
        shards.append(shard)
        samples, tokens = shard["samples"][1], shard["tokens"][1]
    manifest = {
        **fields,
        "format": layout.TOKEN_STORE_FORMAT,
        "version": layout.TOKEN_STORE_VERSION,
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
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest

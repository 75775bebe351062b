"""Write a VLM store: one shard at a time (`VlmShardWriter`, in a shard's build directory), then the store
from its finished shards (`assemble_vlm_store`: shard files linked in, the index and image table
concatenated, the manifest written last). The shared machinery: `puzzletron.dataset.formats.shards`.

A shard's build directory holds ``tokens`` / ``mask`` (streamed), its part of the index and image table in
the store's encodings with offsets from 0 (``offsets.i64``, ``lengths.u32``, ``ids.bin``/``.i64``,
``images.i64``, ``image_tokens.u32``, ``media_end.u32``, ``grid.u32``, ``sha256.bin``, ``paths.bin``/``.i64``,
``skipped.bin``/``.i64``, ``reasons.u8``) and ``record.json``. Nothing is random or dated: the same subset and
processor give the same bytes.
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
    IndexPart,
    TokenShardWriter,
    assemble_index,
    link_shard_files,
    read_shard_record,
    write_part,
    write_record,
)
from puzzletron.dataset.formats.vlm_store import _layout as layout

__all__ = ["INDEX_PARTS", "VlmShardWriter", "assemble_vlm_store", "read_vlm_shard_record"]

INDEX_PARTS = (
    IndexPart("offsets.i64", layout.OFFSETS, offsets=True),
    IndexPart("lengths.u32", layout.LENGTHS),
    IndexPart("ids.bin", layout.IDS_BIN),
    IndexPart("ids.i64", layout.IDS_OFFSETS, offsets=True),
    IndexPart("images.i64", layout.IMAGE_OFFSETS, offsets=True),
    IndexPart("image_tokens.u32", layout.IMAGE_TOKENS),
    IndexPart("media_end.u32", layout.MEDIA_END),
    IndexPart("grid.u32", layout.GRID),
    IndexPart("sha256.bin", layout.SHA256),
    IndexPart("paths.bin", layout.PATHS_BIN),
    IndexPart("paths.i64", layout.PATHS_OFFSETS, offsets=True),
    IndexPart("skipped.bin", layout.SKIPPED_BIN),
    IndexPart("skipped.i64", layout.SKIPPED_OFFSETS, offsets=True),
    IndexPart("reasons.u8", layout.SKIPPED_REASONS),
)
_COUNTED = ("samples", "skipped", "tokens", "supervised_tokens", "images", "image_tokens")


class VlmShardWriter:
    """The files of one shard, written into its (empty) build directory as batches of rows arrive: kept
    samples' tokens and mask bits go straight to disk; their index entries and image records, and the
    skipped rows, stay in memory until `finish` (one shard's worth)."""

    def __init__(self, directory: Path, dtype: str) -> None:
        self.directory = Path(directory)
        self._shard = TokenShardWriter(self.directory, dtype)
        self._columns: dict[str, list[np.ndarray]] = {
            k: [] for k in ("lengths", "images", "image_tokens", "media_end", "grid", "sha")
        }
        self._ids: list[str] = []
        self._paths: list[str] = []
        self._skipped: list[str] = []
        self._reasons: list[int] = []
        self._supervised = 0

    def add(
        self,
        input_ids: np.ndarray,
        mask: np.ndarray,
        *,
        lengths: np.ndarray,
        sample_ids: Sequence[str],
        supervised: int,
        images: np.ndarray,
        media_end: np.ndarray,
        grid: np.ndarray,
        image_tokens: np.ndarray,
        paths: Sequence[str],
        sha256: np.ndarray,
    ) -> None:
        """Append kept samples: flat ``input_ids`` / ``mask`` ``[N]``, per sample ``lengths``, ids,
        ``images`` (how many) and ``media_end`` ``[k]``; per image ``grid`` ``[m, 3]``, ``image_tokens``
        ``[m]``, ``paths`` and raw ``sha256`` ``[m, 32]`` uint8; ``supervised`` labels in all."""
        self._shard.add(input_ids, mask)
        per_sample = np.zeros(len(images), dtype=np.int64)
        if len(images):
            owner = np.repeat(np.arange(len(images)), images)
            per_sample = np.bincount(owner, weights=image_tokens, minlength=len(images)).astype(np.int64)
        for key, value in (
            ("lengths", lengths), ("images", images), ("image_tokens", per_sample),
            ("media_end", media_end), ("grid", grid), ("sha", sha256),
        ):  # fmt: skip
            self._columns[key].append(np.asarray(value))
        self._ids += sample_ids
        self._paths += paths
        self._supervised += int(supervised)

    def skip(self, sample_ids: Sequence[str], reasons: Sequence[int]) -> None:
        """Record rows that are not kept, each with its reason (an index of ``SKIP_REASONS``)."""
        self._skipped += sample_ids
        self._reasons += [int(r) for r in reasons]

    def _column(self, key: str, dtype: str, width: int = 1) -> np.ndarray:
        parts = [np.asarray(a).reshape(-1, width) for a in self._columns[key]]
        return np.concatenate([np.zeros((0, width)), *parts]).astype(dtype).reshape(-1)

    def finish(self, *, rows: tuple[int, int]) -> dict[str, Any]:
        """Write the rest (last mask bits, index parts, ``record.json``); return the record."""
        files = self._shard.finish()
        lengths = self._column("lengths", "<u4")
        grid = self._column("grid", "<u4", 3)
        if grid.size and int(grid.max()) >= 1 << 32:
            raise SnapshotError(f"rows {rows}: an image grid does not fit uint32")
        image_tokens = self._column("image_tokens", "<u4")
        parts: dict[str, Any] = {
            "lengths.u32": lengths,
            "image_tokens.u32": image_tokens,
            "media_end.u32": self._column("media_end", "<u4"),
            "grid.u32": grid,
            "sha256.bin": self._column("sha", "u1", 32),
            "reasons.u8": np.asarray(self._reasons, dtype="u1"),
        }
        for name, counts in (("offsets", lengths), ("images", self._column("images", "<i8"))):
            offsets = np.zeros(counts.size + 1, "<i8")
            np.cumsum(counts, out=offsets[1:])
            parts[f"{name}.i64"] = offsets
        for name, strings in (("ids", self._ids), ("paths", self._paths), ("skipped", self._skipped)):
            parts[f"{name}.bin"], parts[f"{name}.i64"] = encode_strings(strings)
        for name, data in parts.items():
            write_part(self.directory, name, data)
        record = {
            "rows": list(rows),
            "samples": len(self._ids),
            "skipped": len(self._skipped),
            "skipped_reasons": [self._reasons.count(k) for k in range(len(layout.SKIP_REASONS))],
            "tokens": int(parts["offsets.i64"][-1]),
            "supervised_tokens": self._supervised,
            "images": int(parts["images.i64"][-1]),
            "image_tokens": int(image_tokens.sum(dtype=np.int64)),
            "files": files,
        }
        write_record(self.directory, record)
        return record


def read_vlm_shard_record(directory: Path, rows: tuple[int, int]) -> dict[str, Any] | None:
    """The record of the finished shard in `directory` covering `rows`, or None (then it is built again)."""
    return read_shard_record(directory, rows, [p.part for p in INDEX_PARTS])


def assemble_vlm_store(
    tmp: Path, shard_dirs: Sequence[Path], records: Sequence[Mapping[str, Any]], *, fields: Mapping[str, Any]
) -> dict[str, Any]:
    """Write the store into the empty directory `tmp` from finished shards (in shard order, with their
    `records`); `fields` are the manifest's identity and processor facts. Returns the manifest (written
    last)."""
    files = link_shard_files(tmp, shard_dirs, records)
    files += assemble_index(tmp, shard_dirs, INDEX_PARTS)
    shards, ends = [], dict.fromkeys(("samples", "tokens", "images"), 0)
    for record in records:
        shard: dict[str, Any] = {"rows": record["rows"]}
        for key in ends:
            shard[key] = [ends[key], ends[key] + record[key]]
            ends[key] += record[key]
        shards.append(shard)
    reasons = [sum(r["skipped_reasons"][k] for r in records) for k in range(len(layout.SKIP_REASONS))]
    counts = {key: sum(r[key] for r in records) for key in _COUNTED}
    counts |= {
        "rows": sum(r["rows"][1] - r["rows"][0] for r in records),
        "shards": len(records),
        "skipped_reasons": dict(zip(layout.SKIP_REASONS, reasons, strict=True)),
    }
    manifest = {
        **fields,
        "format": layout.VLM_STORE_FORMAT,
        "version": layout.VLM_STORE_VERSION,
        "counts": counts,
        "shards": shards,
        "files": sorted(files, key=lambda r: r["path"]),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest

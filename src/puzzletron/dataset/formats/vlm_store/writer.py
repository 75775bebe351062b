"""Write a VLM store: one shard at a time (`VlmShardWriter`, in a shard's build directory), then the store
from its finished shards (`assemble_vlm_store`: the token store in ``tokens/`` assembled by the token
store's writer, the image table concatenated, the manifest written last).

A shard's build directory holds ``tokens/`` (a token store shard: `formats.token_store.ShardWriter`; the
rows skipped for an image reason are recorded there as skipped, in row order) and its part of the image
table in the store's encodings with offsets from 0 (``images.i64``, ``image_tokens.u32``,
``media_end.u32``, ``grid.u32``, ``sha256.bin``, ``paths.bin``/``.i64``, ``skipped_reasons.u8``), then
``record.json``. Nothing is random or dated: the same subset and processor give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.formats.binary import HashingFile, encode_strings
from puzzletron.dataset.formats.manifest import MANIFEST, load_json
from puzzletron.dataset.formats.token_store import RECORD, ShardWriter, assemble_store, read_shard_record
from puzzletron.dataset.formats.vlm_store import _layout as layout

__all__ = ["VlmShardWriter", "assemble_vlm_store", "read_vlm_shard_record"]

# a shard's part of the image table -> the store's file; offsets files are rebased when concatenated
_PARTS = {
    "images.i64": layout.IMAGE_OFFSETS,
    "image_tokens.u32": layout.IMAGE_TOKENS,
    "media_end.u32": layout.MEDIA_END,
    "grid.u32": layout.GRID,
    "sha256.bin": layout.SHA256,
    "paths.bin": layout.PATHS_BIN,
    "paths.i64": layout.PATHS_OFFSETS,
    "skipped_reasons.u8": layout.SKIPPED_REASONS,
}
_CHUNK = 1 << 24


class VlmShardWriter:
    """The files of one shard, written into its (empty) build directory as batches of rows arrive: the
    token store shard streams kept samples' tokens and mask bits to disk; the image table's entries stay in
    memory until `finish` (one shard's worth)."""

    def __init__(self, directory: Path, dtype: str) -> None:
        self.directory = Path(directory)
        (self.directory / layout.TOKENS).mkdir()
        self._tokens = ShardWriter(self.directory / layout.TOKENS, dtype)
        self._columns: dict[str, list[np.ndarray]] = {
            k: [] for k in ("images", "image_tokens", "media_end", "grid", "sha", "reasons")
        }
        self._paths: list[str] = []

    def add(
        self, input_ids: np.ndarray, mask: np.ndarray, *, lengths: np.ndarray, sample_ids: Sequence[str],
        supervised: np.ndarray, reasons: np.ndarray, images: np.ndarray, media_end: np.ndarray,
        grid: np.ndarray, image_tokens: np.ndarray, paths: Sequence[str], sha256: np.ndarray,
    ) -> None:  # fmt: skip
        """Append a batch of rows. Every row, in order: ``sample_ids`` and ``supervised`` labels (0: the row
        is skipped); the skipped rows' ``reasons`` (indices of ``SKIP_REASONS``), in order. The kept rows:
        flat ``input_ids`` / ``mask`` ``[N]``, ``lengths``, ``images`` (how many) and ``media_end``; their
        images: ``grid`` ``[m, 3]``, ``image_tokens`` ``[m]``, ``paths`` and raw ``sha256`` ``[m, 32]``."""
        self._tokens.add(input_ids, mask, lengths, sample_ids, supervised=np.asarray(supervised))
        per_sample = np.zeros(len(images), dtype=np.int64)
        if len(images):
            owner = np.repeat(np.arange(len(images)), images)
            per_sample = np.bincount(owner, weights=image_tokens, minlength=len(images)).astype(np.int64)
        for key, value in (
            ("images", images), ("image_tokens", per_sample), ("media_end", media_end), ("grid", grid),
            ("sha", sha256), ("reasons", reasons),
        ):  # fmt: skip
            self._columns[key].append(np.asarray(value))
        self._paths += paths

    def _column(self, key: str, dtype: str, width: int = 1) -> np.ndarray:
        parts = [np.asarray(a).reshape(-1, width) for a in self._columns[key]]
        return np.concatenate([np.zeros((0, width)), *parts]).astype(dtype).reshape(-1)

    def finish(self, *, rows: tuple[int, int]) -> dict[str, Any]:
        """Write the rest (the token shard, the image table parts, ``record.json``); return the record."""
        tokens = self._tokens.finish(rows=rows)
        grid = self._column("grid", "<i8", 3)
        if grid.size and int(grid.max()) >= 1 << 32:
            raise SnapshotError(f"rows {rows}: an image grid does not fit uint32")
        image_tokens = self._column("image_tokens", "<u4")
        counts = self._column("images", "<i8")
        reasons = self._column("reasons", "u1")
        parts: dict[str, Any] = {
            "images.i64": np.concatenate([np.zeros(1, "<i8"), np.cumsum(counts, dtype="<i8")]),
            "image_tokens.u32": image_tokens,
            "media_end.u32": self._column("media_end", "<u4"),
            "grid.u32": grid.astype("<u4"),
            "sha256.bin": self._column("sha", "u1", 32),
            "skipped_reasons.u8": reasons,
        }
        parts["paths.bin"], parts["paths.i64"] = encode_strings(self._paths)
        if reasons.size != tokens["skipped"] or counts.size != tokens["samples"]:
            raise SnapshotError(f"rows {rows}: the image table does not match the token shard's samples")
        for name, data in parts.items():
            out = HashingFile(self.directory / name)
            out.write(data)
            out.close()
        record = {
            "rows": list(rows),
            "samples": tokens["samples"],
            "skipped_reasons": np.bincount(reasons, minlength=len(layout.SKIP_REASONS)).tolist(),
            "images": int(counts.sum()),
            "image_tokens": int(image_tokens.sum(dtype=np.int64)),
            "path_bytes": len(parts["paths.bin"]),
        }
        out = HashingFile(self.directory / RECORD)
        out.write(json.dumps(record, sort_keys=True).encode())
        out.close()
        return record | {"tokens": tokens}


def read_vlm_shard_record(directory: Path, rows: tuple[int, int]) -> dict[str, Any] | None:
    """The record of the finished shard in `directory` covering `rows` when its token shard and image
    table parts are there with their sizes; None otherwise (then it is built again)."""
    tokens = read_shard_record(directory / layout.TOKENS, rows)
    try:
        record = load_json(directory / RECORD, "the shard record")
    except SnapshotError:
        return None
    if tokens is None or not isinstance(record, dict) or record.get("rows") != list(rows):
        return None
    n, m, skipped = tokens["samples"], record.get("images"), tokens["skipped"]
    if not isinstance(m, int) or not isinstance(record.get("path_bytes"), int):
        return None
    sizes = {"images.i64": 8 * (n + 1), "image_tokens.u32": 4 * n, "media_end.u32": 4 * n}
    sizes |= {"grid.u32": 12 * m, "sha256.bin": 32 * m, "paths.i64": 8 * (m + 1)}
    sizes |= {"paths.bin": record["path_bytes"], "skipped_reasons.u8": skipped}
    for name, size in sizes.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != size:
            return None
    return record | {"tokens": tokens}


def _append(out: HashingFile, source: Path, base: int = 0) -> int:
    """Append the file `source` to `out`; an int64 offsets file (``.i64``) gives its entries past the first
    plus `base`, and returns its last offset (0 for other files)."""
    if source.suffix == ".i64":
        offsets = np.fromfile(source, dtype="<i8")
        out.write(offsets[1:] + base)
        return int(offsets[-1])
    with open(source, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            out.write(chunk)
    return 0


def assemble_vlm_store(
    tmp: Path,
    shard_dirs: Sequence[Path],
    records: Sequence[Mapping[str, Any]],
    *,
    fields: Mapping[str, Any],
    token_fields: Mapping[str, Any],
    link_shards: bool = True,
) -> dict[str, Any]:
    """Write the store into the empty directory `tmp` from finished shards (in shard order, with their
    `records`): ``tokens/`` by `assemble_store` with ``token_fields``; the image table (offsets rebased)
    with its block checksums; the manifest (``fields``: identity, its hash, processor facts, built_with)
    written last. Returns it. ``link_shards=False``: the token shards' data files are elsewhere (on object
    storage, uploaded already)."""
    (tmp / layout.TOKENS).mkdir()
    assemble_store(
        tmp / layout.TOKENS, [d / layout.TOKENS for d in shard_dirs], [r["tokens"] for r in records],
        fields=token_fields, link_shards=link_shards,
    )  # fmt: skip
    (tmp / "media").mkdir()
    out = {rel: HashingFile(tmp / rel) for rel in _PARTS.values()}
    for rel in (layout.IMAGE_OFFSETS, layout.PATHS_OFFSETS):
        out[rel].write(np.zeros(1, "<i8"))
    bases = dict.fromkeys(_PARTS.values(), 0)  # the offsets files' running ends (images, path bytes)
    for directory in shard_dirs:
        for part, rel in _PARTS.items():
            bases[rel] += _append(out[rel], directory / part, bases[rel])
    files = [{"path": rel, **writer.close()} for rel, writer in out.items()]
    blocks = HashingFile(tmp / layout.BLOCKS)
    for rel in sorted(out):
        blocks.write(np.asarray(out[rel].block_sums, dtype="<u8"))
    files.append({"path": layout.BLOCKS, **blocks.close()})
    raw = (tmp / layout.TOKENS_MANIFEST).read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    files.append({"path": layout.TOKENS_MANIFEST, "bytes": len(raw), "sha256": digest})
    reasons = [sum(r["skipped_reasons"][k] for r in records) for k in range(len(layout.SKIP_REASONS))]
    counts = {
        "rows": sum(r["rows"][1] - r["rows"][0] for r in records),
        "samples": sum(r["samples"] for r in records),
        "skipped": sum(reasons),
        "skipped_reasons": dict(zip(layout.SKIP_REASONS, reasons, strict=True)),
        "images": sum(r["images"] for r in records),
        "image_tokens": sum(r["image_tokens"] for r in records),
    }
    manifest = {
        **fields,
        "format": layout.VLM_STORE_FORMAT,
        "version": layout.VLM_STORE_VERSION,
        "block_checksums": {"algorithm": _blocks.ALGORITHM, "block_size": _blocks.BLOCK_SIZE},
        "counts": counts,
        "files": sorted(files, key=lambda r: r["path"]),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest

"""Verify and describe a token store (``puzzletron-data verify`` / ``inspect`` dispatch here).

`verify_token_store` reads every byte: every manifest field (`_layout.check_manifest`), every file's size,
SHA-256 and block checksums, every token id against the vocabulary, every sample's supervision (at least
one label) from the mask bits, and the index's consistency (offsets from 0 by the lengths, shard ranges
tiling samples, tokens and rows, id offsets, the counts). It reports every problem and never raises for a
damaged store. Memory: one shard's mask and one chunk of the index at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.formats.manifest import MANIFEST, VerifyReport, bytes_on_disk, check_file, human_size
from puzzletron.dataset.formats.token_store import _layout as layout
from puzzletron.dataset.storage.objects import is_url
from puzzletron.dataset.storage.sources import ByteSource, open_source

__all__ = ["describe_token_store", "render_token_store", "verify_token_store"]

_CHUNK = 1 << 24  # bytes of a token file hashed at a time
_INDEX_CHUNK = 1 << 20  # samples of the index checked at a time


def _present(root: Any, source: ByteSource, record: Mapping[str, Any]) -> int:
    """The size of the file `record` names, checked against the record (locally: inside the store, a
    regular file; on object storage: from the listing); `SnapshotError` otherwise."""
    if isinstance(root, Path):
        return check_file(root, record, within=layout.WITHIN).stat().st_size
    size = source.size(record["path"])
    if size != record["bytes"]:
        raise SnapshotError(
            f"{root}: {record['path']} has {size} bytes, the manifest records {record['bytes']}"
        )
    return size


def _scan(
    source: ByteSource, rel: str, size: int, dtype: np.dtype | None = None
) -> tuple[str, np.ndarray, int]:
    """SHA-256 of a file, its block checksums and (with `dtype`) its largest id (-1 when empty), one pass."""
    digest, blocks, largest = hashlib.sha256(), _blocks.BlockHasher(), -1
    for start in range(0, size, _CHUNK):  # a multiple of the block size and of any itemsize
        chunk = np.empty(min(_CHUNK, size - start), np.uint8)
        source.read_into(rel, start, chunk)
        digest.update(chunk)
        blocks.update(chunk)
        if dtype is not None and len(chunk) >= dtype.itemsize:
            whole = len(chunk) - len(chunk) % dtype.itemsize
            largest = max(largest, int(chunk[:whole].view(dtype).max()))
    return digest.hexdigest(), blocks.finish(), largest


def _hash_file(
    root: Any,
    source: ByteSource,
    record: Mapping[str, Any],
    sums: dict[str, np.ndarray],
    problems: list[str],
    dtype=None,
) -> int:
    """Size and SHA-256 of one file against its record; its block checksums into `sums`; its largest id."""
    try:
        size = _present(root, source, record)
        digest, sums[record["path"]], largest = _scan(source, record["path"], size, dtype)
    except (SnapshotError, OSError) as exc:
        problems.append(str(exc))
        return -1
    if digest != record["sha256"]:
        problems.append(f"{root}: {record['path']}: SHA-256 differs from the manifest")
    return largest


def _check_shard(
    root: Any,
    source: ByteSource,
    manifest: Mapping[str, Any],
    k: int,
    offsets: np.ndarray,
    sums: dict[str, np.ndarray],
    problems: list[str],
) -> int:
    """Hash shard `k`'s files, check its ids and its samples' supervision; its supervised labels."""
    records = {r["path"]: r for r in manifest["files"]}
    dtype = np.dtype(manifest["token_dtype"]).newbyteorder("<")
    (t0, t1), (s0, s1) = manifest["shards"][k]["tokens"], manifest["shards"][k]["samples"]
    where = f"{root}: shard {k}"
    mask = records[layout.mask_name(k)]
    largest = _hash_file(root, source, records[layout.tokens_name(k)], sums, problems, dtype)
    try:
        _present(root, source, mask)
        packed = source.read_bytes(mask["path"])
    except (SnapshotError, OSError) as exc:
        problems.append(str(exc))
        return 0
    sums[mask["path"]] = _blocks.block_sums(packed)
    if hashlib.sha256(packed).hexdigest() != mask.get("sha256"):
        problems.append(f"{where}: {layout.mask_name(k)}: SHA-256 differs from the manifest")
    if largest >= manifest["vocab_size"]:
        problems.append(
            f"{where}: token id {largest} is outside the vocabulary ({manifest.get('vocab_size')})"
        )
    bits = np.unpackbits(np.frombuffer(packed, np.uint8), bitorder="little")[: t1 - t0]
    local = np.asarray(offsets[s0 : s1 + 1], dtype=np.int64) - t0
    if local.size == 0 or local[0] != 0 or local[-1] != t1 - t0 or bits.size != t1 - t0:
        problems.append(f"{where}: its samples [{s0}, {s1}) do not cover its tokens [{t0}, {t1})")
        return 0
    if local.size == 1:
        return 0
    # labels of a sample: its masked tokens but the first (samples have >= 2 tokens, checked before)
    starts = local[:-1]
    supervised = np.add.reduceat(bits, starts, dtype=np.int64) - bits[starts]
    if np.any(supervised <= 0):
        bad = s0 + int(np.flatnonzero(supervised <= 0)[0])
        problems.append(f"{where}: sample {bad} has no supervised label (such rows must be skipped)")
    return int(supervised.sum())


def _check_strings(
    root: Any, source: ByteSource, rel_offsets: str, rel_bytes: str, count: int, problems: list[str]
) -> None:
    offsets = np.frombuffer(source.read_bytes(rel_offsets), dtype="<i8")
    size = source.size(rel_bytes)
    if offsets.size != count + 1 or offsets[0] != 0 or offsets[-1] != size or np.any(np.diff(offsets) < 0):
        problems.append(f"{root}: {rel_offsets} does not cut {rel_bytes} ({size} bytes) into {count} strings")


def _check_index(
    root: Any,
    source: ByteSource,
    manifest: Mapping[str, Any],
    sums: dict[str, np.ndarray],
    problems: list[str],
) -> None:
    counts, shards = manifest["counts"], manifest["shards"]
    n, total = counts["samples"], counts["tokens"]
    offsets, lengths = source.map(layout.OFFSETS, "<i8", n + 1), source.map(layout.LENGTHS, "<u4", n)
    if offsets[0] != 0 or offsets[-1] != total:
        problems.append(f"{root}: {layout.OFFSETS} runs from {offsets[0]} to {offsets[-1]}, not 0 to {total}")
    for a in range(0, n, _INDEX_CHUNK):
        b = min(a + _INDEX_CHUNK, n)
        if not np.array_equal(np.diff(offsets[a : b + 1]), lengths[a:b].astype(np.int64)):
            problems.append(f"{root}: {layout.OFFSETS} and {layout.LENGTHS} disagree in samples [{a}, {b})")
            break
        if lengths[a:b].min() < 2:  # a supervised label needs a token after the first
            problems.append(f"{root}: a sample in [{a}, {b}) has fewer than 2 tokens")
            break
    _check_strings(root, source, layout.IDS_OFFSETS, layout.IDS_BIN, n, problems)
    _check_strings(root, source, layout.SKIPPED_OFFSETS, layout.SKIPPED_BIN, counts["skipped"], problems)
    ends = {"rows": 0, "samples": 0, "tokens": 0}
    for k, shard in enumerate(shards):
        for key in ends:
            if shard[key][0] != ends[key] or shard[key][1] < shard[key][0]:
                problems.append(f"{root}: shards[{k}].{key} {shard[key]} does not continue from {ends[key]}")
            ends[key] = shard[key][1]
    wanted = {"rows": counts["rows"], "samples": n, "tokens": total}
    if ends != wanted or counts["shards"] != len(shards) or counts["rows"] - n != counts["skipped"]:
        problems.append(f"{root}: the shards cover {ends}; the counts say {counts}")
    supervised = sum(
        _check_shard(root, source, manifest, k, offsets, sums, problems) for k in range(len(shards))
    )
    if not problems and supervised != counts.get("supervised_tokens"):
        problems.append(
            f"{root}: {supervised} supervised labels; the counts say {counts.get('supervised_tokens')}"
        )


def _root_and_source(path: str | Path) -> tuple[Any, ByteSource]:
    """The store's root (a Path, or its URL) and a source reading it (on object storage: no cache, every
    byte streamed once)."""
    if is_url(path):
        url = str(path).rstrip("/")
        return url, open_source(url, cache=None)
    root = Path(path).absolute()
    return root, open_source(root)


def verify_token_store(path: str | Path) -> VerifyReport:
    """Check a token store (a directory or an URL) against its manifest, reading every byte (see the
    module docstring); ``sample_count`` is the manifest's samples, ``image_count`` is 0."""
    root, source = _root_and_source(path)
    try:
        manifest = layout.load_store_manifest(root, None if isinstance(root, Path) else source)
    except SnapshotError as exc:
        return VerifyReport(str(root), 0, 0, (str(exc),), layout.TOKEN_STORE_FORMAT)
    sizes = layout.expected_sizes(manifest)
    records = {r["path"]: r for r in manifest["files"]}
    problems: list[str] = []
    if [r["path"] for r in manifest["files"]] != sorted(sizes):
        problems.append(f"{root}: the manifest lists {sorted(set(records) ^ set(sizes))} unlike this layout "
                        "(or out of order)")  # fmt: skip
    sums: dict[str, np.ndarray] = {}
    for rel, record in sorted(records.items()):
        if rel in sizes and record["bytes"] != sizes[rel]:
            problems.append(
                f"{root}: {rel} is recorded with {record['bytes']} bytes; counts imply {sizes[rel]}"
            )
        if not rel.startswith("shards/"):  # shard files are hashed by _check_shard, with their checks
            _hash_file(root, source, record, sums, problems)
    if not problems:  # the shards are hashed and checked with the index
        try:
            _check_index(root, source, manifest, sums, problems)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            problems.append(f"{root}: the index is unreadable or inconsistent: {exc}")
    if not problems:
        stored = np.frombuffer(source.read_bytes(layout.BLOCKS), dtype="<u8")
        found = np.concatenate(
            [np.zeros(0, np.uint64), *(sums[rel] for rel, _ in layout.block_files(manifest))]
        )
        if stored.shape != found.shape or not np.array_equal(stored, found):
            problems.append(f"{root}: {layout.BLOCKS} does not hold the block checksums of the files")
    samples = manifest["counts"]["samples"]
    source.close()
    return VerifyReport(str(root), samples, 0, tuple(problems), layout.TOKEN_STORE_FORMAT)


def describe_token_store(path: str | Path) -> dict[str, Any]:
    """What a token store's manifest says (counts, dtype, identity) and its size on disk (on object
    storage: the bytes of its objects)."""
    root, source = _root_and_source(path)
    manifest = layout.load_store_manifest(root, None if isinstance(root, Path) else source)
    size = (
        bytes_on_disk(root)
        if isinstance(root, Path)
        else sum(source.size(r["path"]) for r in manifest["files"])
    )
    return {
        "path": str(root),
        "format": layout.TOKEN_STORE_FORMAT,
        "format_version": manifest.get("version"),
        "counts": manifest.get("counts"),
        "token_dtype": manifest.get("token_dtype"),
        "vocab_size": manifest.get("vocab_size"),
        "pad_token_id": manifest.get("pad_token_id"),
        "rows_per_shard": manifest.get("rows_per_shard"),
        "identity": manifest.get("identity"),
        "identity_sha256": manifest.get("identity_sha256"),
        "bytes_on_disk": size if isinstance(root, Path) else size + source.size(MANIFEST),
    }


def render_token_store(info: Mapping[str, Any]) -> list[str]:
    """`describe_token_store`'s summary as lines of text."""
    counts = info["counts"] if isinstance(info["counts"], Mapping) else {}
    snapshot = (info.get("identity") or {}).get("snapshot") or {}
    lines = [f"token store {info['path']} (format {info['format_version']})"]
    lines.append(
        f"samples      {counts.get('samples')} ({counts.get('skipped')} rows skipped of {counts.get('rows')})"
    )
    supervised = counts.get("supervised_tokens")
    lines.append(
        f"tokens       {counts.get('tokens')} {info['token_dtype']} ({supervised} supervised labels)"
    )
    lines.append(f"shards       {counts.get('shards')} of {info['rows_per_shard']} rows")
    if snapshot.get("source"):
        lines.append(
            f"source       {snapshot['source']} @ {snapshot.get('revision')} [{snapshot.get('split')}]"
        )
    lines.append(f"identity     {info['identity_sha256']}")
    lines.append(f"on disk      {human_size(info['bytes_on_disk'])} ({info['bytes_on_disk']} bytes)")
    return lines

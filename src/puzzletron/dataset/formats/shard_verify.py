"""Verifying what the sharded stores share (token store, VLM store), reading every byte: the manifest's file
records against their sizes and SHA-256s, every shard's token ids against the vocabulary and its samples'
supervision from the mask bits, and the token index (offsets from 0 by the lengths, shard ranges tiling
rows, samples and tokens, strings cut by their offsets, the counts). Problems are appended to a list; nothing
here raises for a damaged store. Memory: one shard's mask and one chunk of the index at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.binary import memmap_array
from puzzletron.dataset.formats.manifest import MANIFEST, VerifyReport, check_file, verify_file
from puzzletron.dataset.formats.shards import (
    IDS_BIN,
    IDS_OFFSETS,
    LENGTHS,
    OFFSETS,
    SKIPPED_BIN,
    SKIPPED_OFFSETS,
    mask_name,
    tokens_name,
)

__all__ = ["check_files", "check_shard", "check_strings", "check_token_index", "verify_sharded"]

_CHUNK = 1 << 24  # bytes of a token file hashed at a time
_INDEX_CHUNK = 1 << 20  # samples of the index checked at a time


def check_files(
    root: Path, records: Mapping[str, Any], sizes: Mapping[str, int], expected: set[str], problems: list[str],
    *, within: str,
) -> None:  # fmt: skip
    """The listed files are exactly `expected`, each recorded with the size its counts imply (`sizes`); every
    file but the shards' (hashed with their checks) has its size and SHA-256."""
    if set(records) != expected:
        problems.append(f"{root}: the manifest lists {sorted(set(records) ^ expected)} unlike this layout")
    for rel, record in sorted(records.items()):
        if rel in sizes and record.get("bytes") != sizes[rel]:
            problems.append(
                f"{root}: {rel} is recorded with {record.get('bytes')} bytes; counts imply {sizes[rel]}"
            )
        if not rel.startswith("shards/"):
            verify_file(root, record, problems, within=within)


def _scan_tokens(path: Path, dtype: np.dtype) -> tuple[str, int]:
    """SHA-256 of a token file and its largest id (-1 when empty), in one pass."""
    digest, largest = hashlib.sha256(), -1
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK - _CHUNK % dtype.itemsize):
            digest.update(chunk)
            if len(chunk) >= dtype.itemsize:
                whole = len(chunk) - len(chunk) % dtype.itemsize
                largest = max(largest, int(np.frombuffer(chunk[:whole], dtype=dtype).max()))
    return digest.hexdigest(), largest


def check_shard(
    root: Path, manifest: Mapping[str, Any], k: int, offsets: np.ndarray, problems: list[str], *, within: str
) -> int:
    """Hash shard `k`'s files, check its ids and its samples' supervision; its supervised labels."""
    records = {r["path"]: r for r in manifest["files"]}
    dtype = np.dtype(manifest["token_dtype"]).newbyteorder("<")
    (t0, t1), (s0, s1) = manifest["shards"][k]["tokens"], manifest["shards"][k]["samples"]
    where = f"{root}: shard {k}"
    tokens, mask = records[tokens_name(k)], records[mask_name(k)]
    try:
        digest, largest = _scan_tokens(check_file(root, tokens, within=within), dtype)
        packed = check_file(root, mask, within=within).read_bytes()
    except (SnapshotError, OSError) as exc:
        problems.append(str(exc))
        return 0
    if digest != tokens.get("sha256"):
        problems.append(f"{where}: {tokens_name(k)}: SHA-256 differs from the manifest")
    if hashlib.sha256(packed).hexdigest() != mask.get("sha256"):
        problems.append(f"{where}: {mask_name(k)}: SHA-256 differs from the manifest")
    if largest >= manifest.get("vocab_size", 0):
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


def check_strings(root: Path, rel_offsets: str, rel_bytes: str, count: int, problems: list[str]) -> None:
    """The int64 offsets file `rel_offsets` cuts the bytes file `rel_bytes` into `count` strings."""
    offsets = np.fromfile(root / rel_offsets, dtype="<i8")
    size = (root / rel_bytes).stat().st_size
    if offsets.size != count + 1 or offsets[0] != 0 or offsets[-1] != size or np.any(np.diff(offsets) < 0):
        problems.append(f"{root}: {rel_offsets} does not cut {rel_bytes} ({size} bytes) into {count} strings")


def check_token_index(
    root: Path,
    manifest: Mapping[str, Any],
    problems: list[str],
    *,
    within: str,
    ranges: Sequence[str] = ("rows", "samples", "tokens"),
) -> None:
    """The token index and the shards; ``ranges`` are the keys of ``shards[k]`` that tile ``counts`` (a
    shard's ``samples`` and ``tokens`` run from where the previous one stopped)."""
    counts, shards = manifest["counts"], manifest["shards"]
    n, total = counts["samples"], counts["tokens"]
    offsets = memmap_array(root / OFFSETS, "<i8", n + 1)
    lengths = memmap_array(root / LENGTHS, "<u4", n)
    if offsets[0] != 0 or offsets[-1] != total:
        problems.append(f"{root}: {OFFSETS} runs from {offsets[0]} to {offsets[-1]}, not 0 to {total}")
    for a in range(0, n, _INDEX_CHUNK):
        b = min(a + _INDEX_CHUNK, n)
        if not np.array_equal(np.diff(offsets[a : b + 1]), lengths[a:b].astype(np.int64)):
            problems.append(f"{root}: {OFFSETS} and {LENGTHS} disagree in samples [{a}, {b})")
            break
        if lengths[a:b].min() < 2:  # a supervised label needs a token after the first
            problems.append(f"{root}: a sample in [{a}, {b}) has fewer than 2 tokens")
            break
    check_strings(root, IDS_OFFSETS, IDS_BIN, n, problems)
    check_strings(root, SKIPPED_OFFSETS, SKIPPED_BIN, counts["skipped"], problems)
    ends = dict.fromkeys(ranges, 0)
    for k, shard in enumerate(shards):
        for key in ends:
            if shard[key][0] != ends[key] or shard[key][1] < shard[key][0]:
                problems.append(f"{root}: shards[{k}].{key} {shard[key]} does not continue from {ends[key]}")
            ends[key] = shard[key][1]
    wanted = {key: counts[key] for key in ranges}
    if ends != wanted or counts["shards"] != len(shards) or counts["rows"] - n != counts["skipped"]:
        problems.append(f"{root}: the shards cover {ends}; the counts say {counts}")
    supervised = sum(
        check_shard(root, manifest, k, offsets, problems, within=within) for k in range(len(shards))
    )
    if not problems and supervised != counts.get("supervised_tokens"):
        problems.append(
            f"{root}: {supervised} supervised labels; the counts say {counts.get('supervised_tokens')}"
        )


def verify_sharded(
    path: str | Path,
    *,
    fmt: str,
    what: str,
    load: Callable[[Path], dict[str, Any]],
    expected_sizes: Callable[[Mapping[str, Any], Path], dict[str, int]],
    unsized: set[str],
    within: str,
    ranges: Sequence[str] = ("rows", "samples", "tokens"),
    more: Callable[[Path, Mapping[str, Any], list[str]], None] | None = None,
) -> VerifyReport:
    """Verify a sharded store of format `fmt` reading every byte: its files (`check_files`), the token index
    and shards (`check_token_index`), then the format's own checks (`more`), each only when the ones before
    found nothing. The report counts ``counts.samples`` and ``counts.images`` (0 when absent)."""
    root = Path(path).absolute()
    try:
        manifest = load(root)
        sizes = expected_sizes(manifest, root / MANIFEST)
        records = {r["path"]: r for r in manifest["files"]}
    except (SnapshotError, KeyError, TypeError) as exc:
        return VerifyReport(str(root), 0, 0, (f"{root}: unreadable {what} manifest: {exc}",), fmt)
    problems: list[str] = []
    check_files(root, records, sizes, set(sizes) | unsized, problems, within=within)
    if not problems:  # the shards are hashed and checked with the index
        try:
            check_token_index(root, manifest, problems, within=within, ranges=ranges)
            if not problems and more is not None:
                more(root, manifest, problems)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            problems.append(f"{root}: the index is unreadable or inconsistent: {exc}")
    counts = manifest.get("counts", {})
    return VerifyReport(str(root), counts.get("samples", 0), counts.get("images", 0), tuple(problems), fmt)

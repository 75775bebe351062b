"""Verify and describe a VLM store (``puzzletron-data verify`` / ``inspect`` dispatch here).

`verify_vlm_store` reads every byte: every manifest field, every media file's size, SHA-256 and block
checksums, ``tokens/`` as the token store's verifier checks it (every file, ids in the vocabulary, every
sample supervised, the index) and that it is this store's (its manifest's SHA-256, identity and counts),
then the image table: image ranges from 0 to the image count, each grid non-empty with ``t * h * w`` a
multiple of ``merge**2``, every sample's image tokens the sum of its grids, every sample's tokens holding
one run of image tokens per image, in order, as long as its grid says, and ``media_end`` where the last run
ends. It reports every problem and never raises for a damaged store. Memory: one chunk of samples at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.formats.manifest import VerifyReport, bytes_on_disk, check_file, human_size, load_json
from puzzletron.dataset.formats.token_store import TokenStore, verify_token_store
from puzzletron.dataset.formats.vlm_store import _layout as layout

__all__ = ["describe_vlm_store", "render_vlm_store", "verify_vlm_store"]

_SAMPLES_AT_ONCE = 1 << 14
_CHUNK = 1 << 24


def _hash_file(root: Path, record: Mapping[str, Any], problems: list[str]) -> np.ndarray:
    """Size and SHA-256 of one file against its record (problems appended); its block checksums."""
    try:
        path = check_file(root, record, within=layout.WITHIN)
    except SnapshotError as exc:
        problems.append(str(exc))
        return np.zeros(0, np.uint64)
    digest, blocks = hashlib.sha256(), _blocks.BlockHasher()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            blocks.update(chunk)
    if digest.hexdigest() != record["sha256"]:
        problems.append(f"{root}: {record['path']}: SHA-256 differs from the manifest")
    return blocks.finish()


def _check_files(root: Path, manifest: Mapping[str, Any], problems: list[str]) -> None:
    sizes = layout.expected_sizes(manifest)
    records = {r["path"]: r for r in manifest["files"]}
    if list(records) != sorted(sizes):
        problems.append(f"{root}: the manifest lists {sorted(set(records) ^ set(sizes))} unlike this layout "
                        "(or out of order)")  # fmt: skip
        return
    sums = {}
    for rel, record in records.items():
        if record["bytes"] != sizes[rel]:
            problems.append(
                f"{root}: {rel} is recorded with {record['bytes']} bytes; counts imply {sizes[rel]}"
            )
        sums[rel] = _hash_file(root, record, problems)
    if not problems:
        found = np.concatenate(
            [np.zeros(0, np.uint64), *(sums[rel] for rel, _ in layout.block_files(manifest))]
        )
        stored = np.fromfile(root / layout.BLOCKS, dtype="<u8")
        if not np.array_equal(stored, found):
            problems.append(f"{root}: {layout.BLOCKS} does not hold the block checksums of the media files")


def _check_tokens(root: Path, manifest: Mapping[str, Any], problems: list[str]) -> None:
    report = verify_token_store(root / layout.TOKENS)
    problems.extend(report.problems)
    if report.problems:
        return
    recorded = load_json(root / layout.TOKENS_MANIFEST, "the token store manifest")
    if recorded.get("identity") != layout.token_identity(manifest["identity"]):
        problems.append(f"{root}: {layout.TOKENS}/ holds another identity than this VLM store's")
    counts = manifest["counts"]
    if any(recorded["counts"][k] != counts[k] for k in ("rows", "samples", "skipped")):
        problems.append(f"{root}: {layout.TOKENS}/ counts {recorded['counts']} differ from {counts}")


def _map(root: Path, rel: str, dtype: str, count: int) -> np.ndarray:
    return np.fromfile(root / rel, dtype=dtype, count=count) if count else np.zeros(0, dtype)


def _check_images(root: Path, manifest: Mapping[str, Any], problems: list[str]) -> None:
    counts, processor = manifest["counts"], manifest["processor"]
    n, m, merge = counts["samples"], counts["images"], processor["merge_size"]
    starts = _map(root, layout.IMAGE_OFFSETS, "<i8", n + 1)
    grid = _map(root, layout.GRID, "<u4", 3 * m).reshape(-1, 3).astype(np.int64)
    paths = _map(root, layout.PATHS_OFFSETS, "<i8", m + 1)
    if paths[0] != 0 or paths[-1] != (root / layout.PATHS_BIN).stat().st_size or np.any(np.diff(paths) < 0):
        problems.append(f"{root}: {layout.PATHS_OFFSETS} does not cut {layout.PATHS_BIN} into {m} paths")
    reasons = _map(root, layout.SKIPPED_REASONS, "u1", counts["skipped"])
    found = np.bincount(reasons, minlength=len(layout.SKIP_REASONS)).tolist()
    if found != [counts["skipped_reasons"][k] for k in layout.SKIP_REASONS]:
        problems.append(f"{root}: {layout.SKIPPED_REASONS} does not hold counts.skipped_reasons")
    if starts[0] != 0 or starts[-1] != m or np.any(np.diff(starts) < 0):
        problems.append(f"{root}: {layout.IMAGE_OFFSETS} does not run from 0 to the {m} images")
        return
    volume = grid.prod(axis=1)
    if m and (grid.min() <= 0 or np.any(volume % merge**2)):
        problems.append(f"{root}: an image grid is empty or not a multiple of merge_size**2 ({merge**2})")
        return
    tokens = volume // merge**2
    image_tokens = _map(root, layout.IMAGE_TOKENS, "<u4", n).astype(np.int64)
    cum = np.concatenate([[0], np.cumsum(tokens)])
    if not np.array_equal(cum[starts[1:]] - cum[starts[:-1]], image_tokens):
        problems.append(f"{root}: {layout.IMAGE_TOKENS} is not the sum of each sample's image grids")
    if int(image_tokens.sum()) != counts["image_tokens"]:
        problems.append(
            f"{root}: {int(image_tokens.sum())} image tokens; the counts say {counts['image_tokens']}"
        )
    _check_runs(root, manifest, starts, tokens, problems)


def _check_runs(
    root: Path, manifest: Mapping[str, Any], starts: np.ndarray, tokens: np.ndarray, problems: list[str]
) -> None:
    """Every sample's image-token runs are its images' token counts, in order; ``media_end`` ends the
    last run. Reads the tokens a chunk of samples at a time."""
    n, image_id = manifest["counts"]["samples"], manifest["processor"]["image_token_id"]
    media_end = _map(root, layout.MEDIA_END, "<u4", n)
    with TokenStore(root / layout.TOKENS) as store:
        offsets = np.asarray(store.offsets)
        for a in range(0, n, _SAMPLES_AT_ONCE):
            b = min(a + _SAMPLES_AT_ONCE, n)
            ids, _ = store.read(offsets[a : a + 1], offsets[b : b + 1])
            edges = np.flatnonzero(np.diff(np.concatenate([[0], (ids == image_id).astype(np.int8), [0]])))
            run_start, run_end = edges[0::2] + offsets[a], edges[1::2] + offsets[a]
            owner = np.searchsorted(offsets, run_start, side="right") - 1
            want_owner = np.repeat(np.arange(a, b), np.diff(starts[a : b + 1]))
            if not (
                np.array_equal(run_end - run_start, tokens[starts[a] : starts[b]])
                and np.array_equal(owner, want_owner)
                and np.all(run_end <= offsets[owner + 1])
            ):
                problems.append(f"{root}: the image tokens of samples [{a}, {b}) are not one run per image "
                                "as long as its grid says")  # fmt: skip
                return
            last = np.zeros(b - a, dtype=np.int64)
            if owner.size:
                last[owner - a] = run_end - offsets[owner]  # runs are in order: the last one wins
            if not np.array_equal(last, media_end[a:b].astype(np.int64)):
                problems.append(
                    f"{root}: {layout.MEDIA_END} is not where samples [{a}, {b}) end their images"
                )
                return


def verify_vlm_store(path: str | Path) -> VerifyReport:
    """Check a VLM store against its manifest, reading every byte (see the module docstring);
    ``sample_count`` is the manifest's samples, ``image_count`` its images."""
    root = layout.local_root(path)
    try:
        manifest = layout.load_vlm_manifest(root)
    except SnapshotError as exc:
        return VerifyReport(str(root), 0, 0, (str(exc),), layout.VLM_STORE_FORMAT)
    problems: list[str] = []
    _check_files(root, manifest, problems)
    _check_tokens(root, manifest, problems)
    if not problems:
        try:
            _check_images(root, manifest, problems)
        except (OSError, ValueError, KeyError, IndexError) as exc:
            problems.append(f"{root}: the image table is unreadable or inconsistent: {exc}")
    counts = manifest["counts"]
    return VerifyReport(
        str(root), counts["samples"], counts["images"], tuple(problems), layout.VLM_STORE_FORMAT
    )


def describe_vlm_store(path: str | Path) -> dict[str, Any]:
    """What a VLM store's manifest says (counts, processor facts, identity, its tokens) and its size on
    disk."""
    root = layout.local_root(path)
    manifest = layout.load_vlm_manifest(root)
    tokens = load_json(root / layout.TOKENS_MANIFEST, "the token store manifest")
    tokens = tokens if isinstance(tokens, Mapping) else {}
    token_counts = tokens.get("counts") if isinstance(tokens.get("counts"), Mapping) else {}
    return {
        "path": str(root),
        "format": layout.VLM_STORE_FORMAT,
        "format_version": manifest["version"],
        "counts": manifest["counts"]
        | {k: token_counts.get(k) for k in ("tokens", "supervised_tokens", "shards")},
        **{key: tokens.get(key) for key in ("token_dtype", "vocab_size", "pad_token_id", "rows_per_shard")},
        "processor": manifest["processor"],
        "identity": manifest["identity"],
        "identity_sha256": manifest["identity_sha256"],
        "bytes_on_disk": bytes_on_disk(root),
    }


def render_vlm_store(info: Mapping[str, Any]) -> list[str]:
    """`describe_vlm_store`'s summary as lines of text."""
    counts = info["counts"] if isinstance(info["counts"], Mapping) else {}
    processor = info.get("processor") or {}
    subset = (info.get("identity") or {}).get("subset") or {}
    lines = [f"VLM store {info['path']} (format {info['format_version']})"]
    lines.append(
        f"samples      {counts.get('samples')} ({counts.get('skipped')} rows skipped of "
        f"{counts.get('rows')}: {counts.get('skipped_reasons')})"
    )
    lines.append(
        f"tokens       {counts.get('tokens')} {info['token_dtype']} ({counts.get('supervised_tokens')} "
        f"supervised labels, {counts.get('image_tokens')} image tokens)"
    )
    lines.append(f"images       {counts.get('images')} (referenced in the subset, no pixels stored)")
    lines.append(
        f"processor    {processor.get('image_processor')}: patch {processor.get('patch_size')}, merge "
        f"{processor.get('merge_size')}, pixels [{processor.get('min_pixels')}, "
        f"{processor.get('max_pixels')}]"
    )
    lines += [
        f"shards       {counts.get('shards')} of {info['rows_per_shard']} rows",
        *([f"subset       {subset.get('sample_count')} samples, manifest {subset['manifest_sha256']}"]
          if subset.get("manifest_sha256") else []),
        f"identity     {info['identity_sha256']}",
        f"on disk      {human_size(info['bytes_on_disk'])} ({info['bytes_on_disk']} bytes)",
    ]  # fmt: skip
    return lines

"""Verify and describe a VLM store (``puzzletron-data verify`` / ``inspect`` dispatch here).

`verify_vlm_store` reads every byte: every file's size and SHA-256, the token shards and index as the token
store's verifier checks them (ids in the vocabulary, every sample supervised, offsets and shard ranges,
counts), and the image table: image ranges from 0 to the image count, each image's grid (``t * h * w`` a
multiple of ``merge**2``), every sample's image tokens and last image end, and that every sample's tokens
hold one run of image tokens per image, in order, as long as its grid says. It reports every problem and
never raises for a damaged store. Memory: one chunk of samples at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.formats.binary import memmap_array
from puzzletron.dataset.formats.manifest import VerifyReport, bytes_on_disk, human_size
from puzzletron.dataset.formats.shard_verify import check_strings, verify_sharded
from puzzletron.dataset.formats.shards import tokens_name
from puzzletron.dataset.formats.vlm_store import _layout as layout

__all__ = ["describe_vlm_store", "render_vlm_store", "verify_vlm_store"]

_SAMPLES_AT_ONCE = 1 << 14


def _check_images(root: Path, manifest: Mapping[str, Any], problems: list[str]) -> None:
    counts, processor = manifest["counts"], manifest["processor"]
    n, m, merge = counts["samples"], counts["images"], int(processor["merge_size"])
    image_id = int(processor["image_token_id"])
    starts = memmap_array(root / layout.IMAGE_OFFSETS, "<i8", n + 1)
    grid = memmap_array(root / layout.GRID, "<u4", 3 * m).reshape(-1, 3).astype(np.int64)
    check_strings(root, layout.PATHS_OFFSETS, layout.PATHS_BIN, m, problems)
    reasons = memmap_array(root / layout.SKIPPED_REASONS, "u1", counts["skipped"])
    if reasons.size and int(reasons.max()) >= len(layout.SKIP_REASONS):
        problems.append(f"{root}: {layout.SKIPPED_REASONS} holds an unknown reason {int(reasons.max())}")
    if starts[0] != 0 or starts[-1] != m or np.any(np.diff(starts) < 0):
        problems.append(f"{root}: {layout.IMAGE_OFFSETS} does not run from 0 to the {m} images")
        return
    volume = grid.prod(axis=1)
    if m and (grid.min() <= 0 or np.any(volume % merge**2)):
        problems.append(f"{root}: an image grid is empty or not a multiple of merge_size**2 ({merge**2})")
        return
    tokens = volume // merge**2
    image_tokens = memmap_array(root / layout.IMAGE_TOKENS, "<u4", n).astype(np.int64)
    cum = np.concatenate([[0], np.cumsum(tokens)])
    if not np.array_equal(cum[starts[1:]] - cum[starts[:-1]], image_tokens):
        problems.append(f"{root}: {layout.IMAGE_TOKENS} is not the sum of each sample's image grids")
    if int(image_tokens.sum()) != counts["image_tokens"]:
        problems.append(
            f"{root}: {int(image_tokens.sum())} image tokens; the counts say {counts['image_tokens']}"
        )
    _check_runs(root, manifest, starts, tokens, image_id, problems)


def _check_runs(
    root: Path, manifest: Mapping[str, Any], starts: np.ndarray, tokens: np.ndarray, image_id: int,
    problems: list[str],
) -> None:  # fmt: skip
    """Every sample's image-token runs are its images' token counts, in order; ``media_end`` ends the
    last run. Reads each shard's tokens a chunk of samples at a time."""
    offsets = memmap_array(root / layout.OFFSETS, "<i8", manifest["counts"]["samples"] + 1)
    media_end = memmap_array(root / layout.MEDIA_END, "<u4", manifest["counts"]["samples"])
    dtype = np.dtype(manifest["token_dtype"]).newbyteorder("<")
    for k, shard in enumerate(manifest["shards"]):
        (s0, s1), t0 = shard["samples"], shard["tokens"][0]
        ids_file = memmap_array(root / tokens_name(k), dtype.str, shard["tokens"][1] - t0)
        for a in range(s0, s1, _SAMPLES_AT_ONCE):
            b = min(a + _SAMPLES_AT_ONCE, s1)
            ids = np.asarray(ids_file[offsets[a] - t0 : offsets[b] - t0])
            edges = np.flatnonzero(np.diff(np.concatenate([[0], (ids == image_id).astype(np.int8), [0]])))
            run_start, run_end = edges[0::2] + offsets[a], edges[1::2] + offsets[a]
            owner = np.searchsorted(offsets, run_start, side="right") - 1
            want = tokens[starts[a] : starts[b]]
            want_owner = np.repeat(np.arange(a, b), np.diff(starts[a : b + 1]))
            if not (
                np.array_equal(run_end - run_start, want)
                and np.array_equal(owner, want_owner)
                and np.all(run_end <= offsets[owner + 1])
            ):
                problems.append(
                    f"{root}: shard {k}: the image tokens of samples [{a}, {b}) are not one run per image "
                    "as long as its grid says"
                )
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
    return verify_sharded(
        path,
        fmt=layout.VLM_STORE_FORMAT,
        what="VLM store",
        load=layout.load_vlm_manifest,
        expected_sizes=layout.expected_sizes,
        unsized=layout.UNSIZED,
        within=layout.WITHIN,
        ranges=("rows", "samples", "tokens", "images"),
        more=_check_images,
    )


def describe_vlm_store(path: str | Path) -> dict[str, Any]:
    """What a VLM store's manifest says (counts, processor facts, identity) and its size on disk."""
    root = Path(path).absolute()
    manifest = layout.load_vlm_manifest(root)
    keys = ("counts", "token_dtype", "vocab_size", "pad_token_id", "rows_per_shard", "processor", "identity")
    return {
        "path": str(root),
        "format": layout.VLM_STORE_FORMAT,
        "format_version": manifest.get("version"),
        **{key: manifest.get(key) for key in keys},
        "identity_sha256": manifest.get("identity_sha256"),
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
    lines.append(f"shards       {counts.get('shards')} of {info['rows_per_shard']} rows")
    if subset.get("manifest_sha256"):
        lines.append(
            f"subset       {subset.get('sample_count')} samples, manifest {subset['manifest_sha256']}"
        )
    lines.append(f"identity     {info['identity_sha256']}")
    lines.append(f"on disk      {human_size(info['bytes_on_disk'])} ({info['bytes_on_disk']} bytes)")
    return lines

"""The VLM store's names, constants and manifest checks, shared by its writer, reader and verifier.

The format: ``docs/vlm-store-format.md``. It is the token store's sibling (the same shards and token
index, `puzzletron.dataset.formats.shards`) plus, per sample, its images (a range of the image table), its
image tokens and where its last image ends, and per image its grid and a reference to the image file in
the subset (path and SHA-256; no pixels). "Complete" (what the reader and reuse check, cheap): the
manifest names this format and version, lists exactly this layout's files, each there with the size its
counts imply. `verify` reads every byte.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from puzzletron.dataset.formats.manifest import MANIFEST
from puzzletron.dataset.formats.shards import (
    IDS_BIN,
    IDS_OFFSETS,
    LENGTHS,
    OFFSETS,
    SKIPPED_BIN,
    SKIPPED_OFFSETS,
    check_complete,
    count_of,
    load_format_manifest,
    shard_file_sizes,
)

__all__ = [
    "GRID",
    "IDS_BIN",
    "IDS_OFFSETS",
    "IMAGE_OFFSETS",
    "IMAGE_TOKENS",
    "LENGTHS",
    "MEDIA_END",
    "OFFSETS",
    "PATHS_BIN",
    "PATHS_OFFSETS",
    "SHA256",
    "SKIPPED_BIN",
    "SKIPPED_OFFSETS",
    "SKIPPED_REASONS",
    "SKIP_REASONS",
    "UNSIZED",
    "VLM_STORE_FORMAT",
    "VLM_STORE_VERSION",
    "WITHIN",
    "expected_sizes",
    "load_vlm_manifest",
    "read_complete_manifest",
]

VLM_STORE_FORMAT = "puzzletron-vlm-store"
VLM_STORE_VERSION = 1
WITHIN = "the VLM store"

# the token store's index (OFFSETS, LENGTHS, IDS_BIN, IDS_OFFSETS, SKIPPED_*), and:
IMAGE_OFFSETS = "index/images.i64"  # [n + 1] int64: first image of each sample in images/
IMAGE_TOKENS = "index/image_tokens.u32"  # [n] uint32: image tokens of each sample
MEDIA_END = "index/media_end.u32"  # [n] uint32: tokens through the last image token (0: no image)
GRID = "images/grid.u32"  # [m, 3] uint32: (t, h, w) patches of each image
SHA256 = "images/sha256.bin"  # [m, 32] bytes: the subset manifest's SHA-256 of each image file
PATHS_BIN = "images/paths.bin"  # image file paths inside the subset, UTF-8, concatenated
PATHS_OFFSETS = "images/paths.i64"  # [m + 1] int64
SKIPPED_REASONS = "skipped/reasons.u8"  # [skipped] uint8: why (SKIP_REASONS)

# Why a row of the subset is not a sample of the store (the code is its index here).
SKIP_REASONS = ("no_supervised_label", "image_placeholder_in_text", "image_aspect_ratio")


def expected_sizes(manifest: Mapping[str, Any], where: Path) -> dict[str, int]:
    """Path -> the byte size the manifest's counts imply, for every file but the string bytes (ids, paths),
    whose sizes only their offsets tell; `SnapshotError` for a malformed manifest."""
    n, skipped = count_of(manifest, "samples", where), count_of(manifest, "skipped", where)
    m = count_of(manifest, "images", where)
    sizes = {OFFSETS: 8 * (n + 1), LENGTHS: 4 * n, IDS_OFFSETS: 8 * (n + 1), IMAGE_OFFSETS: 8 * (n + 1)}
    sizes |= {IMAGE_TOKENS: 4 * n, MEDIA_END: 4 * n}
    sizes |= {GRID: 12 * m, SHA256: 32 * m, PATHS_OFFSETS: 8 * (m + 1)}
    sizes |= {SKIPPED_OFFSETS: 8 * (skipped + 1), SKIPPED_REASONS: skipped}
    return sizes | shard_file_sizes(manifest, where)


UNSIZED = {IDS_BIN, PATHS_BIN, SKIPPED_BIN}


def load_vlm_manifest(root: Path) -> dict[str, Any]:
    """The VLM store manifest at `root`, checked for its format and version (not for completeness)."""
    return load_format_manifest(root, VLM_STORE_FORMAT, VLM_STORE_VERSION, "VLM store")


def read_complete_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the complete VLM store at `path`; `SnapshotError` saying what is wrong otherwise
    (format, version, exactly this layout's files, each with the size its counts imply). Reads no token."""
    root = Path(path).absolute()
    manifest = load_vlm_manifest(root)
    sizes = expected_sizes(manifest, root / MANIFEST)
    check_complete(root, manifest, sizes, UNSIZED, within=WITHIN, what="VLM store")
    return manifest

"""The VLM store's names, constants and manifest checks, shared by its writer, reader and verifier.

The format: ``docs/vlm-store-format.md``. A VLM store is a complete token store in ``tokens/`` (the ids
with image placeholders expanded, the assistant mask, lengths, sample ids and skipped ids: read, checked
and verified by `puzzletron.dataset.formats.token_store`) plus the image table in ``media/``. The VLM
manifest records the SHA-256 of ``tokens/manifest.json`` (which records every token file's SHA-256 and
block checksums) and of every media file, and the block checksums of the media files. `check_manifest`
checks every field; "complete" (`read_complete_manifest`: what the reader and reuse check) adds that the
files are exactly this layout's, each with the size its counts imply, and the token manifest's SHA-256.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.formats import manifest as _manifest
from puzzletron.dataset.formats.manifest import MANIFEST, check_file, load_json, load_source_json
from puzzletron.dataset.formats.token_store import TOKEN_STORE_FORMAT, TOKEN_STORE_VERSION
from puzzletron.dataset.formats.vlm_store.settings import pixel_problems
from puzzletron.dataset.storage.objects import is_url, join_url
from puzzletron.dataset.storage.sources import open_source

__all__ = [
    "BLOCKS",
    "GRID",
    "IMAGE_OFFSETS",
    "IMAGE_TOKENS",
    "MEDIA_END",
    "PATHS_BIN",
    "PATHS_OFFSETS",
    "SHA256",
    "SKIPPED_REASONS",
    "SKIP_REASONS",
    "TOKENS",
    "TOKENS_MANIFEST",
    "VLM_STORE_FORMAT",
    "VLM_STORE_VERSION",
    "WITHIN",
    "at",
    "block_files",
    "check_manifest",
    "expected_sizes",
    "load_vlm_manifest",
    "local_root",
    "read_complete_manifest",
    "token_identity",
]

VLM_STORE_FORMAT = "puzzletron-vlm-store"
VLM_STORE_VERSION = 3
WITHIN = "the VLM store"

TOKENS = "tokens"  # a complete token store (docs/token-store-format.md)
TOKENS_MANIFEST = f"{TOKENS}/{MANIFEST}"
IMAGE_OFFSETS = "media/images.i64"  # [n + 1] int64: first image of each sample
IMAGE_TOKENS = "media/image_tokens.u32"  # [n] uint32: image tokens of each sample
MEDIA_END = "media/media_end.u32"  # [n] uint32: tokens through the last image token (0: no image)
GRID = "media/grid.u32"  # [m, 3] uint32: (t, h, w) patches of each image
SHA256 = "media/sha256.bin"  # [m, 32] bytes: the subset manifest's SHA-256 of each image file
PATHS_BIN = "media/paths.bin"  # image file paths inside the subset, UTF-8, concatenated
PATHS_OFFSETS = "media/paths.i64"  # [m + 1] int64
SKIPPED_REASONS = "media/skipped_reasons.u8"  # [skipped] uint8: why (SKIP_REASONS), the token store's order
BLOCKS = "media/blocks.u64"  # uint64 block checksums of the other media files, in path order

# Why a row of the subset is not a sample of the store (the code is its index here).
SKIP_REASONS = ("no_supervised_label", "image_placeholder_in_text", "image_aspect_ratio")

_KEYS = {
    "block_checksums", "built_with", "counts", "files", "format", "identity", "identity_sha256",
    "processor", "version",
}  # fmt: skip
SUBSET_PATH = "subset_path"  # optional: where the subset was when the store was built (a hint, checked)
_COUNTS = ("rows", "samples", "skipped", "images", "image_tokens")
_PROCESSOR_INTS = ("image_token_id", "patch_size", "merge_size", "temporal_patch_size")
_PROCESSOR_KEYS = {"image_processor", "image_token", "min_pixels", "max_pixels", "pixels", *_PROCESSOR_INTS}
_MAX = 2**62


def token_identity(identity: Mapping[str, Any]) -> dict[str, Any]:
    """The identity of the token store in ``tokens/`` of the VLM store of `identity`: a token store's
    (format, version, snapshot, tokenizer, options) made of the VLM identity's subset, processor and options,
    so it names the same inputs and differs from any text token store's."""
    return {
        "format": TOKEN_STORE_FORMAT,
        "version": TOKEN_STORE_VERSION,
        "snapshot": identity["subset"],
        "tokenizer": identity["processor"],
        "options": identity["options"],
        "vlm_store": {"format": identity["format"], "version": identity["version"]},
    }


def local_root(path: str | Path) -> Path | str:
    """The store's location: an absolute folder, or an URL prefix without its trailing slash (read
    through the object layer, ``docs/object-storage.md``)."""
    return str(path).rstrip("/") if is_url(path) else Path(path).absolute()


def at(root: Path | str, rel: str) -> Any:
    """File `rel` of the store at `root` (a path, or an URL string)."""
    return join_url(root, rel) if isinstance(root, str) else root / rel


def _int(value: Any, what: str, where: Path, low: int = 0, high: int = _MAX) -> int:
    if type(value) is not int or not low <= value <= high:  # not True, 1.0 or "1"
        raise SnapshotError(f"{where}: {what} is {value!r:.40}; expected an integer {low}..{high}")
    return value


def _check_counts(raw: Any, where: Path) -> None:
    if not isinstance(raw, Mapping) or set(raw) != {*_COUNTS, "skipped_reasons"}:
        raise SnapshotError(
            f"{where}: counts is {raw!r:.120}; expected {', '.join(_COUNTS)}, skipped_reasons"
        )
    counts = {key: _int(raw[key], f"counts.{key}", where) for key in _COUNTS}
    reasons = raw["skipped_reasons"]
    if not isinstance(reasons, Mapping) or set(reasons) != set(SKIP_REASONS):
        raise SnapshotError(f"{where}: counts.skipped_reasons is {reasons!r:.120}; expected {SKIP_REASONS}")
    total = sum(_int(reasons[k], f"counts.skipped_reasons.{k}", where) for k in SKIP_REASONS)
    if counts["rows"] != counts["samples"] + counts["skipped"] or total != counts["skipped"]:
        raise SnapshotError(f"{where}: counts {dict(raw)} do not add up (rows = samples + skipped, reasons)")


def _check_processor(raw: Any, where: Path) -> None:
    if not isinstance(raw, Mapping) or set(raw) != _PROCESSOR_KEYS:
        raise SnapshotError(
            f"{where}: processor is {raw!r:.120}; expected the keys {sorted(_PROCESSOR_KEYS)}"
        )
    for key in _PROCESSOR_INTS:
        _int(raw[key], f"processor.{key}", where, 0 if key == "image_token_id" else 1)
    if not (isinstance(raw["image_processor"], str) and isinstance(raw["image_token"], str)):
        raise SnapshotError(f"{where}: processor.image_processor and image_token must be strings")
    low = _int(raw["min_pixels"], "processor.min_pixels", where)
    _int(raw["max_pixels"], "processor.max_pixels", where, max(low, 1))
    problems = pixel_problems(raw["pixels"])
    if problems:
        raise SnapshotError(f"{where}: processor.pixels: {problems[0]}")


def check_manifest(manifest: Any, where: Path) -> dict[str, Any]:
    """`manifest` (a parsed VLM ``manifest.json``, named `where` in errors) with every field checked:
    format and version, identity and its hash, processor facts, counts, block checksums, file records.
    `SnapshotError` naming the first field that is wrong. Reads nothing else."""
    _manifest.check_store_header(
        manifest, where, fmt=VLM_STORE_FORMAT, version=VLM_STORE_VERSION, what="VLM store"
    )
    keys = set(manifest) - {SUBSET_PATH}
    if keys != _KEYS:
        raise SnapshotError(f"{where}: keys {sorted(_KEYS - keys)} are missing and "
                            f"{sorted(keys - _KEYS, key=str)} unexpected")  # fmt: skip
    if not isinstance(manifest.get(SUBSET_PATH, ""), str):
        raise SnapshotError(f"{where}: {SUBSET_PATH} is {manifest[SUBSET_PATH]!r:.80}; expected a path")
    identity = manifest["identity"]
    if not isinstance(identity, Mapping) or identity.get("format") != VLM_STORE_FORMAT:
        raise SnapshotError(f"{where}: identity is {identity!r:.80}; expected a VLM store identity")
    if identity.get("version") != manifest["version"]:
        raise SnapshotError(f"{where}: identity names version {identity.get('version')!r}, not this store's")
    if manifest["identity_sha256"] != _manifest.canonical_sha256(identity):
        raise SnapshotError(f"{where}: identity_sha256 is not the SHA-256 of its identity")
    _check_processor(manifest["processor"], where)
    _check_counts(manifest["counts"], where)
    _manifest.check_store_records(manifest, where)
    return manifest


def expected_sizes(manifest: Mapping[str, Any]) -> dict[str, int]:
    """Path -> the byte size a checked manifest implies for each file (the paths' bytes and the token
    manifest: as recorded; the block checksums: from the other media files' sizes)."""
    counts = manifest["counts"]
    n, m = counts["samples"], counts["images"]
    sizes = {IMAGE_OFFSETS: 8 * (n + 1), IMAGE_TOKENS: 4 * n, MEDIA_END: 4 * n}
    sizes |= {GRID: 12 * m, SHA256: 32 * m, PATHS_OFFSETS: 8 * (m + 1), SKIPPED_REASONS: counts["skipped"]}
    recorded = {r["path"]: r["bytes"] for r in manifest["files"]}
    sizes[PATHS_BIN] = recorded.get(PATHS_BIN, 0)
    sizes[BLOCKS] = 8 * sum(_blocks.block_count(size) for size in sizes.values())
    sizes[TOKENS_MANIFEST] = recorded.get(TOKENS_MANIFEST, 0)
    return sizes


def block_files(manifest: Mapping[str, Any]) -> list[tuple[str, int]]:
    """``(path, bytes)`` of the media files the block checksums cover, in path order."""
    return [(r["path"], r["bytes"]) for r in manifest["files"] if r["path"] not in (BLOCKS, TOKENS_MANIFEST)]


def load_vlm_manifest(root: Path | str, source: Any = None) -> dict[str, Any]:
    """The VLM store manifest at `root` (read through `source`, an URL's by default), every field checked
    (`check_manifest`), no other file read."""
    where = at(root, MANIFEST)
    if isinstance(root, Path) and source is None:
        return check_manifest(load_json(where, "the manifest"), where)
    source = source if source is not None else open_source(root)
    return check_manifest(load_source_json(source, MANIFEST, where), where)


def read_complete_manifest(path: str | Path, source: Any = None) -> dict[str, Any]:
    """The manifest of the complete VLM store at `path` (a folder or an URL, read through `source` when
    given); `SnapshotError` saying what is wrong otherwise: every field, exactly this layout's files each
    with the size its counts imply (at an URL: from one listing), and ``tokens/``'s manifest with its
    recorded SHA-256 (the token store's own completeness: `TokenStore`). Reads no token."""
    root = local_root(path)
    if isinstance(root, str) and source is None:
        source = open_source(root)
    manifest = load_vlm_manifest(root, source)
    sizes = expected_sizes(manifest)
    paths = [r["path"] for r in manifest["files"]]
    if paths != sorted(sizes):
        raise SnapshotError(
            f"{root}: the manifest's files are not this layout's (missing {sorted(set(sizes) - set(paths))}, "
            f"unexpected {sorted(set(paths) - set(sizes))}, or out of order)"
        )
    problems = []
    for record in manifest["files"]:
        rel, recorded = record["path"], record["bytes"]
        try:
            if isinstance(root, Path):
                check_file(root, record, within=WITHIN)
            elif source.size(rel) != recorded:
                raise SnapshotError(f"{root}: {rel} has {source.size(rel)} bytes, the manifest records "
                                    f"{recorded} (truncated or replaced)")  # fmt: skip
        except SnapshotError as exc:
            problems.append(str(exc))
            continue
        if recorded != sizes[rel]:
            problems.append(f"{root}: {rel} has {recorded} bytes; its counts imply {sizes[rel]}")
    if not problems:
        local = isinstance(root, Path)
        raw = (root / TOKENS_MANIFEST).read_bytes() if local else source.read_bytes(TOKENS_MANIFEST)
        digest = next(r["sha256"] for r in manifest["files"] if r["path"] == TOKENS_MANIFEST)
        if hashlib.sha256(raw).hexdigest() != digest:
            problems.append(f"{root}: {TOKENS_MANIFEST} differs from the SHA-256 the manifest records")
    if problems:
        raise SnapshotError(f"{root}: incomplete or damaged VLM store: {'; '.join(problems[:5])}")
    return manifest

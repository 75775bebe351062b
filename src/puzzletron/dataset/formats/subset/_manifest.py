"""The subset's manifest, checked before anything else is read (`subset_manifest`), and its completeness
(`read_manifest`): for a folder, or an URL prefix (``s3://bucket/subsets/vlm``) read through its
`storage.sources.ByteSource` (sizes from one listing). The format: ``docs/subset-format.md``."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.manifest import (
    MANIFEST,
    MAX_JSON_DEPTH,
    check_file,
    load_json,
    load_source_json,
)
from puzzletron.dataset.formats.media_shards import check_record as check_media
from puzzletron.dataset.formats.subset._layout import (
    IDX_HEADER,
    IDX_MAGIC,
    LEGACY_SAMPLES,
    SUBSET_FORMAT,
    SUBSET_FORMAT_VERSION,
    SUBSET_SHARDED_VERSION,
    is_original_layout,
    is_sharded,
)
from puzzletron.dataset.storage.objects import is_url, join_url
from puzzletron.dataset.storage.sources import open_source

__all__ = ["manifest_sha256", "read_manifest", "subset_manifest", "subset_root"]


def subset_root(path: str | Path) -> Path | str:
    """A subset's location: an absolute folder, or an URL without its trailing slash."""
    return str(path).rstrip("/") if is_url(path) else Path(path).absolute()


def manifest_sha256(root: Path | str) -> str | None:
    """The SHA-256 hex of the subset's ``manifest.json`` at `root` (a folder or an URL; what a VLM store's
    identity names it by), None when there is none."""
    try:
        raw = open_source(root).read_bytes(MANIFEST)
    except (SnapshotError, OSError):
        return None
    return hashlib.sha256(raw).hexdigest()


def _at(root: Path | str, rel: str) -> Any:
    return join_url(root, rel) if isinstance(root, str) else root / rel


def _count(manifest: Mapping[str, Any], key: str, where: Path) -> int:
    value = manifest.get(key)
    if type(value) is not int or value < 0:  # not bool, not "2", not 2.0
        raise SnapshotError(f"{where}: {key!r} is {value!r}; expected a non-negative integer")
    return value


def _image_record(record: Any) -> bool:
    """A manifest image record has integer indices and a string path (what readers key and join on)."""
    return (
        isinstance(record, Mapping)
        and isinstance(record.get("path"), str)
        and all(type(record.get(k)) is int for k in ("sample_index", "image_index"))
    )


def subset_manifest(
    root: Path | str, *, counts: bool = True, records: bool = True, source: Any = None
) -> dict[str, Any]:
    """The manifest at `root`, checked before anything else is read (not for completeness): a JSON object of
    this format and a version this code reads (exactly ``2``; the original layout: ``1``), integer counts,
    ``images`` a list of ``image_count`` records with integer indices and a string path (`counts=False`: of
    any length; `verify_subset` reports a mismatch among its problems), and (version 2) records for the
    sample file and index. `SnapshotError` naming what is wrong otherwise (``docs/trust-model.md``).
    ``records=False`` (`SubsetReader`, which reads no image record) skips checking each image record and
    the nesting of their values: a 100k-image manifest then costs its parse alone. An URL `root` (or a
    `source`) is read through its `ByteSource`."""
    where = _at(root, MANIFEST)
    depth = MAX_JSON_DEPTH if records else None
    if isinstance(root, str) or source is not None:
        source = source if source is not None else open_source(root)
        manifest = load_source_json(source, MANIFEST, where, max_depth=depth)
    else:
        manifest = load_json(where, "the manifest", max_depth=depth)
    if not isinstance(manifest, dict):
        raise SnapshotError(f"{where}: expected a JSON object, got {type(manifest).__name__}")
    fmt = manifest.get("format")
    if fmt is not None and fmt != SUBSET_FORMAT:
        raise SnapshotError(f"{where}: a {fmt!r} manifest, not a conversation subset")
    version = manifest.get("version")
    wanted = (1,) if is_original_layout(manifest) else (SUBSET_FORMAT_VERSION, SUBSET_SHARDED_VERSION)
    if type(version) is not int or version not in wanted:
        raise SnapshotError(
            f"{where}: format version {version!r} is not supported (this code reads "
            f"{SUBSET_FORMAT_VERSION}, {SUBSET_SHARDED_VERSION} with media shards and the original layout, 1)"
        )
    image_count = _count(manifest, "image_count", where)
    _count(manifest, "sample_count", where)
    images = manifest.get("images")
    if not isinstance(images, list):
        raise SnapshotError(f"{where}: 'images' is {images!r}; expected a list of records")
    if counts and len(images) != image_count:
        raise SnapshotError(f"{where}: 'images' does not list image_count={image_count} images")
    for record in images if records else ():
        if not _image_record(record):
            raise SnapshotError(
                f"{where}: image record {record!r} is not {{sample_index, image_index: int, path: str}}"
            )
    if not is_original_layout(manifest):
        for key in ("samples", "index"):
            record = manifest.get(key)
            if not isinstance(record, Mapping) or not isinstance(record.get("path"), str):
                raise SnapshotError(f"{where}: {key!r} is {record!r}; expected a file record with a path")
    if is_sharded(manifest):
        samples = manifest["sample_count"]
        check_media(manifest.get("media"), str(where), images=image_count, samples=samples)
    return manifest


def _check_index_count(source: Any, rel: str, sample_count: int, where: Any) -> None:
    """The sample count in the index header must be the manifest's (24 bytes read: cheap enough for reuse)."""
    header = bytearray(IDX_HEADER.size)
    try:
        source.read_into(rel, 0, memoryview(header))
    except SnapshotError:
        header = bytearray()
    if len(header) != IDX_HEADER.size or header[:8] != IDX_MAGIC:
        raise SnapshotError(f"{where}: not a sample index (bad header)")
    count = IDX_HEADER.unpack(bytes(header))[1]
    if count != sample_count:
        parent = where.parent if isinstance(where, Path) else where.rsplit("/", 1)[0]
        raise SnapshotError(f"{parent}: {count} samples on disk, the manifest records {sample_count}")


def _check_sized(root: Path | str, source: Any, record: Any, what: str) -> None:
    """`check_file` for a folder; for an URL the listed object's size against the record."""
    if isinstance(root, Path):
        check_file(root, record, what)
        return
    rel = record.get("path") if isinstance(record, Mapping) else None
    try:
        size = source.size(rel)
    except SnapshotError:
        raise SnapshotError(f"{root}: {what} {rel!r} is missing") from None
    if record.get("bytes") is not None and size != record["bytes"]:
        recorded = record["bytes"]
        raise SnapshotError(f"{root}: {what} {rel!r} has {size} bytes, the manifest records {recorded} "
                            "(truncated or replaced)")  # fmt: skip


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the complete subset at `path` (a folder or an URL); `SnapshotError` saying what is
    missing otherwise.

    Complete means: the manifest passes `subset_manifest`, and the sample file, the index and every image it
    lists (or every media file) exist with their recorded sizes. (Hashes are checked by `verify_subset`,
    which reads every byte.)
    """
    root = subset_root(path) if is_url(path) else Path(path)
    if isinstance(root, Path) and not root.is_dir():
        raise SnapshotError(f"{root}: no subset directory there")
    source = open_source(root)
    manifest = subset_manifest(root, source=source if isinstance(root, str) else None)
    if is_original_layout(manifest):
        if isinstance(root, Path) and not (root / LEGACY_SAMPLES).is_file():
            raise SnapshotError(f"{root}: {LEGACY_SAMPLES} is missing")
    else:
        _check_sized(root, source, manifest["samples"], "sample file")
        _check_sized(root, source, manifest["index"], "sample index")
        rel = manifest["index"]["path"]
        _check_index_count(source, rel, manifest["sample_count"], _at(root, rel))
    if is_sharded(manifest):  # the images are named in the shards' index, not files
        for record in manifest["media"]["files"]:
            _check_sized(root, source, record, "media file")
        return manifest
    for record in manifest["images"]:
        where = "image"
        if isinstance(record, Mapping):
            where = f"image of sample {record.get('sample_index')} (row {record.get('row_id')!r})"
        _check_sized(root, source, record, where)
    return manifest

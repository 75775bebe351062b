"""Verify (every byte) and describe an offline conversation subset.

The format: ``docs/subset-format.md``. `verify_subset` never raises for a damaged subset: it reports every
problem it finds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.conversation import validate_conversation
from puzzletron.dataset.conversation.images import shown_size
from puzzletron.dataset.errors import ConversationError, ImageError, SnapshotError
from puzzletron.dataset.formats.manifest import (
    MANIFEST,
    VerifyReport,
    bytes_on_disk,
    human_size,
    inside,
    load_json,
    parse_json,
    verify_file,
)
from puzzletron.dataset.formats.media_shards import MediaShards, verify_media
from puzzletron.dataset.formats.subset._layout import (
    IMAGES,
    INDEX,
    LEGACY_SAMPLES,
    SAMPLES,
    SUBSET_FORMAT,
    image_items,
    is_original_layout,
    is_sharded,
    label,
)
from puzzletron.dataset.formats.subset.reader import SubsetReader, read_manifest, subset_manifest
from puzzletron.dataset.storage.local import LocalFiles

__all__ = ["describe_subset", "render_subset", "verify_subset"]


def _iter_lines(root: Path, manifest: Mapping[str, Any], problems: list[str]) -> Iterator[tuple[int, Any]]:
    """``(index, sample or None)`` for every line of the sample file, checking the index offsets on the way
    (the original layout: every element of ``samples.json``)."""
    if is_original_layout(manifest):
        samples = load_json(root / LEGACY_SAMPLES, "the sample list")
        if not isinstance(samples, list):
            problems.append(f"{root / LEGACY_SAMPLES}: expected a JSON array")
            return
        yield from enumerate(samples)
        return
    try:
        reader = SubsetReader(root)
    except SnapshotError as exc:
        problems.append(str(exc))
        reader = None
    offset = 0
    if not (root / SAMPLES).is_file():
        return
    with open(root / SAMPLES, "rb") as fh:
        for i, line in enumerate(fh):
            if reader is not None and i < len(reader) and reader.offset(i) != offset:
                problems.append(f"{root / INDEX}: offset of sample {i} is wrong")
            offset += len(line)
            try:
                yield i, parse_json(line, f"line {i + 1}")
            except ValueError as exc:
                problems.append(f"{root / SAMPLES}: {exc}")
                yield i, None
    if reader is not None:
        reader.close()


def _image_records(manifest: Mapping[str, Any], problems: list[str]) -> dict[tuple[Any, Any], Any]:
    """The manifest's image records by ``(sample_index, image_index)``; problems with the list itself."""
    images = manifest["images"]  # a list: `subset_manifest` checked it
    records = {(r.get("sample_index"), r.get("image_index")): r for r in images if isinstance(r, Mapping)}
    if len(records) != manifest.get("image_count"):
        problems.append(f"lists {len(records)} images, image_count says {manifest.get('image_count')}")
    return records


def _check_sample(root: Path, i: int, sample: Any, original: bool, problems: list[str]) -> list[Any]:
    """The image items of sample `i` after checking its shape; problems appended."""
    name = label(i, sample)
    if not isinstance(sample, dict):
        problems.append(f"{root}: {name} is {type(sample).__name__}, not a JSON object")
        return []
    items = list(image_items(sample))
    if not original:  # every sample we write passed this check (images as paths)
        try:
            validate_conversation(sample, where=f"{root}: {name}")
        except ConversationError as exc:
            problems.append(str(exc))
    elif sample.get("image_count") != len(items):
        problems.append(f"{root}: {name}: image_count {sample.get('image_count')!r} but {len(items)} images")
    return items


def verify_subset(path: str | Path) -> VerifyReport:
    """Check every count, size and SHA-256 of the subset at `path` against its manifest.

    Reads every byte; reports every mismatch (not just the first) in `VerifyReport.problems`.
    """
    root = Path(path).absolute()
    problems: list[str] = []
    try:  # format, version and the counts' types first: nothing else means anything without them
        manifest = subset_manifest(root, counts=False)
    except SnapshotError as exc:
        return VerifyReport(str(root), 0, 0, (str(exc),), SUBSET_FORMAT)
    original = is_original_layout(manifest)
    if not original:
        for key, what in (("samples", "sample file"), ("index", "sample index")):
            verify_file(root, manifest.get(key), problems, what)
    listing: list[str] = []
    records = _image_records(manifest, listing)
    problems += [f"{root / MANIFEST}: {p}" for p in listing]
    seen_sources, sample_count, image_count, used = set(), 0, 0, set()
    try:
        lines = list(_iter_lines(root, manifest, problems)) if original else None
    except SnapshotError as exc:
        problems.append(str(exc))
        lines = []
    for i, sample in lines if lines is not None else _iter_lines(root, manifest, problems):
        sample_count += 1
        if sample is None:
            continue
        items = _check_sample(root, i, sample, original, problems)
        source = sample.get("source") if isinstance(sample, dict) else None
        key = (source.get("dataset"), source.get("revision")) if isinstance(source, Mapping) else None
        if key is not None and all(isinstance(part, str) for part in key):  # else `_check_sample` said so
            seen_sources.add(key)
        for k, (field, item) in enumerate(items):
            image_count += 1
            try:
                inside(root, item.get("image"), f"{root}: {label(i, sample)} {field}")
            except SnapshotError as exc:
                problems.append(str(exc))
                continue
            record = records.get((i, k))
            if record is None or record.get("path") != item.get("image"):
                name = f"{root}: {label(i, sample)} {field}"
                problems.append(f"{name}: {item.get('image')!r} is not in the manifest")
                continue
            used.add((i, k))
    _check_totals(root, manifest, sample_count, image_count, seen_sources, problems)
    _check_images(root, manifest, records, used, problems)
    unique = tuple(dict.fromkeys(problems))  # the reader and the totals may both report one count
    return VerifyReport(str(root), sample_count, image_count, unique, SUBSET_FORMAT)


def _check_totals(
    root: Path,
    manifest: Mapping[str, Any],
    sample_count: int,
    image_count: int,
    seen_sources: set[tuple[Any, Any]],
    problems: list[str],
) -> None:
    if sample_count != manifest.get("sample_count"):
        problems.append(
            f"{root}: {sample_count} samples on disk, the manifest records {manifest.get('sample_count')}"
        )
    if image_count != manifest.get("image_count"):
        problems.append(
            f"{root}: {image_count} image items in the samples, "
            f"the manifest records {manifest.get('image_count')}"
        )
    sources = sorted(seen_sources, key=lambda s: (str(s[0]), str(s[1])))
    listed = [
        (s.get("dataset"), s.get("revision"))
        for s in _list(manifest.get("sources"))
        if isinstance(s, Mapping)
    ]
    if listed != sources:
        problems.append(f"{root / MANIFEST}: sources {listed} differ from the samples' sources {sources}")


def _check_images(
    root: Path,
    manifest: Mapping[str, Any],
    records: Mapping[tuple[Any, Any], Any],
    used: set[tuple[Any, Any]],
    problems: list[str],
) -> None:
    """Every listed image: used by a sample, there with its size and SHA-256 (a file, or its range of a
    media shard); no unlisted image file or media file."""

    def order(kv: tuple[Any, Any]) -> tuple[int, ...]:
        return tuple(x if isinstance(x, int) else -1 for x in kv[0])

    ordered = sorted(records.items(), key=order)
    for key, record in ordered:
        if key not in used:
            problems.append(f"{root / MANIFEST}: image {record.get('path')!r} is used by no sample")
        what = f"image of sample {key[0]} (row {record.get('row_id')!r})"
        found = len(problems)
        if not is_sharded(manifest):
            verify_file(root, record, problems, what)
            if len(problems) == found:  # there, with its SHA-256: is it the size the manifest records?
                _check_size(root, record, what, problems)
    if is_sharded(manifest):
        _check_media(root, manifest, [r for _, r in ordered], problems)
    listed_paths = {r.get("path") for r in records.values()} if not is_sharded(manifest) else set()
    if (root / IMAGES).is_dir():
        for file in sorted((root / IMAGES).iterdir()):
            if f"{IMAGES}/{file.name}" not in listed_paths:
                problems.append(f"{root}: unexpected file {IMAGES}/{file.name} not in the manifest")


def _check_media(root: Path, manifest: Mapping[str, Any], ordered: list[Any], problems: list[str]) -> None:
    """A version-3 subset's media shards (`verify_media`), no unlisted file under ``media/``, and (when
    they are sound) every image's size as displayed against its record, read back from its shard."""
    found = len(problems)
    verify_media(LocalFiles(root), manifest["media"], ordered, str(root), problems)
    listed = {r["path"] for r in manifest["media"]["files"]}
    files = {p.relative_to(root).as_posix() for p in (root / "media").rglob("*") if p.is_file()}
    problems += [f"{root}: unexpected file {rel} not in the manifest" for rel in sorted(files - listed)]
    if len(problems) > found:
        return
    media = MediaShards(LocalFiles(root), manifest["media"], where=str(root))
    for start in range(0, len(ordered), 256):  # 256 images at a time
        batch = ordered[start : start + 256]
        for record, data in zip(batch, media.read(np.arange(start, start + len(batch))), strict=True):
            what = f"image of sample {record.get('sample_index')} (row {record.get('row_id')!r})"
            _check_size(root, record, what, problems, data)


def _check_size(
    root: Path, record: Mapping[str, Any], what: str, problems: list[str], data: bytes | None = None
) -> None:
    """The image's size as displayed (from its header; `data`, else its file) against the manifest's
    ``width`` x ``height``: the grid of its tokens is computed from those, so a manifest that lies about
    them gives wrong tokens."""
    where = f"{root}: {what} {record['path']!r}"
    try:
        data = data if data is not None else (root / record["path"]).read_bytes()
        size = shown_size(data, where=where)
    except (OSError, ImageError) as exc:
        problems.append(str(exc))
        return
    recorded = (record.get("width"), record.get("height"))
    if size != recorded:
        problems.append(f"{where}: is {size[0]}x{size[1]}, the manifest records {recorded[0]}x{recorded[1]}")


def _image_format(record: Mapping[str, Any]) -> str:
    fmt = record.get("format")
    return fmt if isinstance(fmt, str) and fmt else Path(record["path"]).suffix.lstrip(".").upper()


def _media(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """How the images are stored: one file each, or media shards (their count and target size)."""
    if not is_sharded(manifest):
        return {"layout": "files"}
    media = manifest["media"]
    return {"layout": "shards", "shards": media["shards"], "shard_bytes": media["shard_bytes"]}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def describe_subset(path: str | Path) -> dict[str, Any]:
    """A summary of a complete subset: counts, sources, image formats and sizes, bytes on disk."""
    root = Path(path).absolute()
    manifest = read_manifest(root)
    images = manifest["images"]
    widths = [r.get("width") for r in images if isinstance(r.get("width"), int)]
    heights = [r.get("height") for r in images if isinstance(r.get("height"), int)]
    formats = Counter(_image_format(r) for r in images)
    return {
        "path": str(root),
        "format": SUBSET_FORMAT,
        "format_version": "original" if is_original_layout(manifest) else manifest.get("version"),
        "sample_count": manifest["sample_count"],
        "image_count": manifest["image_count"],
        "sources": [s for s in _list(manifest.get("sources")) if isinstance(s, Mapping)],
        "image_formats": dict(sorted(formats.items())),
        "image_width": {"min": min(widths), "max": max(widths)} if widths else None,
        "image_height": {"min": min(heights), "max": max(heights)} if heights else None,
        "image_bytes": sum(r.get("bytes") or (root / r["path"]).stat().st_size for r in images),
        "media": _media(manifest),
        "bytes_on_disk": bytes_on_disk(root),
        "acquisition": manifest.get("acquisition"),
    }


def render_subset(info: Mapping[str, Any]) -> list[str]:
    """`describe_subset`'s summary as lines of text."""
    lines = [
        f"subset       {info['path']} (format {info['format_version']})",
        f"samples      {info['sample_count']}",
        f"images       {info['image_count']} ({human_size(info['image_bytes'])})",
    ]
    lines += [f"source       {s.get('dataset')} @ {s.get('revision')}" for s in info["sources"]]
    lines += [f"format       {fmt}: {count}" for fmt, count in info["image_formats"].items()]
    if info["image_width"]:
        w, h = info["image_width"], info["image_height"]
        lines.append(f"image size   width {w['min']}..{w['max']}, height {h['min']}..{h['max']}")
    media = info.get("media") or {"layout": "files"}
    if media["layout"] == "shards":
        lines.append(f"media        {media['shards']} shards of up to {human_size(media['shard_bytes'])}")
    lines.append(f"on disk      {human_size(info['bytes_on_disk'])} ({info['bytes_on_disk']} bytes)")
    return lines

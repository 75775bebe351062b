"""A snapshot at an URL copied to a local folder, for the verifiers and describers that read folders (a
conversation subset with its images or media shards, a text snapshot, a VLM store): only the objects its
manifest lists (a VLM store: and its token store's, under ``tokens/``), never the rest of the prefix.

    problems = fetch_listed("s3://b/subsets/vlm", folder, manifest)   # manifest: the parsed manifest.json

Each listed file is fetched only when the prefix's listing has it with the size the manifest records (a
missing one is left for the verifier to report; one of another size is reported here, unread); a record
without a size (the original subset layout) is fetched up to `MAX_UNSIZED_BYTES`. Objects the format does
not allow (a text snapshot holds exactly its listed files; a subset's ``images/`` exactly its listed
images) are reported as unexpected, never fetched. So a 300 MiB object someone put under a subset's prefix
costs one listing entry, not a download (``docs/object-storage.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from puzzletron.dataset.formats.manifest import MANIFEST
from puzzletron.dataset.formats.subset import SUBSET_FORMAT
from puzzletron.dataset.formats.text_snapshot import TEXT_SNAPSHOT_FORMAT
from puzzletron.dataset.formats.vlm_store import VLM_STORE_FORMAT
from puzzletron.dataset.storage.objects import ObjectInfo, Objects

__all__ = ["MAX_UNSIZED_BYTES", "fetch_listed", "listed_files"]

MAX_UNSIZED_BYTES = 256 << 20  # a file a manifest lists without its size (an image, samples.json)
_IMAGES = "images/"


def _record(record: Any) -> tuple[str, int | None] | None:
    """``(path, bytes)`` of a manifest's file record; None when it names no path (the verifier says so)."""
    if not isinstance(record, Mapping) or not isinstance(record.get("path"), str):
        return None
    size = record.get("bytes")
    return record["path"], size if type(size) is int and size >= 0 else None


def listed_files(
    fmt: str, manifest: Mapping[str, Any], listing: Mapping[str, ObjectInfo]
) -> tuple[dict[str, int | None], str | None]:
    """The files the manifest of format `fmt` lists (path -> recorded bytes, or None), and the part of the
    prefix that may hold nothing else (``""``: all of it; None: no such part)."""
    records: list[Any] = []
    if fmt == SUBSET_FORMAT and isinstance(manifest.get("media"), Mapping):  # images in media shards
        media = manifest["media"].get("files")
        records += [
            manifest.get("samples"),
            manifest.get("index"),
            *(media if isinstance(media, list) else []),
        ]
        strict: str | None = "media/"
    elif fmt == SUBSET_FORMAT:
        images = manifest.get("images")
        records += images if isinstance(images, list) else []
        if "format" in manifest:
            records += [manifest.get("samples"), manifest.get("index")]
        else:  # the original layout: samples.json, no sizes
            records.append({"path": "samples.json"})
        strict = _IMAGES
    elif fmt == VLM_STORE_FORMAT:  # its media files, and tokens/: a token store (its own manifest lists it)
        files = manifest.get("files")
        records += files if isinstance(files, list) else []
        records += [
            {"path": rel, "bytes": info.size} for rel, info in listing.items() if rel.startswith("tokens/")
        ]
        strict = "media/"
    elif fmt == TEXT_SNAPSHOT_FORMAT:
        files = manifest.get("files")
        if isinstance(files, list):
            records += files
        else:  # written before manifests listed files: the splits' folders and the dataset dict
            splits = manifest.get("splits")
            names = set(splits) if isinstance(splits, Mapping) else set()
            records += [{"path": rel} for rel in listing if rel.split("/")[0] in names]
            records.append({"path": "dataset_dict.json"})
        strict = "" if isinstance(files, list) else None
    else:
        raise ValueError(f"{fmt}: not a format read from a local copy")
    found = [r for r in map(_record, records) if r is not None]
    return dict(found), strict


def fetch_listed(
    url: str, folder: Path, fmt: str, manifest_bytes: bytes, manifest: Any, *, unexpected: bool = True
) -> list[str]:
    """Write the manifest and fetch the files it lists into `folder` (created); the problems seen in the
    listing (unexpected objects, listed objects of another size), each naming its URL. ``unexpected=False``
    (a reader's copy): objects the manifest does not list are passed over unsaid (never fetched either)."""
    objects = Objects(url)
    listing = objects.list()
    files, strict = listed_files(fmt, manifest if isinstance(manifest, Mapping) else {}, listing)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).write_bytes(manifest_bytes)
    problems, wanted = [], {}
    for rel, size in sorted(files.items()):
        info = listing.get(rel)
        if info is None or rel == MANIFEST or rel.startswith("/") or ".." in rel.split("/"):
            continue  # missing or no relative path: the verifier, reading the local copy, reports it
        if size is not None and info.size != size:
            problems.append(f"{objects.url_of(rel)} has {info.size} bytes, the manifest records {size}")
        elif size is None and info.size > MAX_UNSIZED_BYTES:
            problems.append(f"{objects.url_of(rel)} has {info.size} bytes, over the {MAX_UNSIZED_BYTES}-byte "
                            "bound of a file listed without its size")  # fmt: skip
        else:
            wanted[rel] = info.size
    if strict is not None and unexpected:
        problems += [
            f"{objects.url_of(rel)}: unexpected object not in the manifest ({listing[rel].size} bytes, not "
            "fetched)"
            for rel in sorted(listing)
            if rel.startswith(strict) and rel != MANIFEST and rel not in files
        ]
    objects.download(folder, wanted)
    return problems

"""Every on-disk format of the data stage, and `verify` / `describe` dispatching on the manifest.

One sub-package per format (``subset/``, ``text_snapshot/``, ``token_store/``, ``vlm_store/``, and
``media_shards/``, the images of a version-3 subset: ``docs/media-shard-format.md``),
``manifest`` (what they all share: hashing, manifest reading, file checks), and what the two sharded stores
share: ``binary`` (files hashed as written, strings, ragged ranges) and ``blocks`` (block checksums,
verified on first read). Each snapshot is a directory whose ``manifest.json``
names its format (``"format"``) and version:

================================== ============================== =====================================
``format``                         written by                     documented in
================================== ============================== =====================================
``puzzletron-conversation-subset`` `subset.writer`                ``docs/subset-format.md``
``puzzletron-text-snapshot``       `text_snapshot.snapshot`       ``docs/text-snapshot-format.md``
``puzzletron-token-store``         `token_store.writer`           ``docs/token-store-format.md``
``puzzletron-vlm-store``           `vlm_store.writer`             ``docs/vlm-store-format.md``
================================== ============================== =====================================

Detection (`detect`): the manifest's ``format`` when it has one (an unknown name is an error). Manifests
written before formats were named have none; for them each format's ``unnamed`` rule decides: ``splits``
and no ``images`` is a text snapshot (version 1), ``images`` is a conversation subset (the original
layout). Adding a format is one entry in `FORMATS`.

>>> sorted(FORMATS)  # doctest: +NORMALIZE_WHITESPACE
['puzzletron-conversation-subset', 'puzzletron-text-snapshot', 'puzzletron-token-store',
 'puzzletron-vlm-store']
>>> format_of({"format": "puzzletron-text-snapshot", "version": 1})
'puzzletron-text-snapshot'
>>> format_of({"version": 1, "splits": {"train": 3}, "files": []})
'puzzletron-text-snapshot'
>>> format_of({"version": 1, "sample_count": 0, "image_count": 0, "images": []})
'puzzletron-conversation-subset'
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats._fetch import fetch_listed
from puzzletron.dataset.formats.manifest import (
    MANIFEST,
    MAX_JSON_BYTES,
    VerifyReport,
    load_json,
    parse_json,
    read_bounded,
)
from puzzletron.dataset.formats.subset import (
    SUBSET_FORMAT,
    describe_subset,
    is_original_layout,
    render_subset,
    verify_subset,
)
from puzzletron.dataset.formats.text_snapshot import (
    TEXT_SNAPSHOT_FORMAT,
    describe_text_snapshot,
    is_unnamed_text_snapshot,
    render_text_snapshot,
    verify_text_snapshot,
)
from puzzletron.dataset.formats.token_store import (
    TOKEN_STORE_FORMAT,
    describe_token_store,
    render_token_store,
    verify_token_store,
)
from puzzletron.dataset.formats.vlm_store import (
    VLM_STORE_FORMAT,
    describe_vlm_store,
    render_vlm_store,
    verify_vlm_store,
)
from puzzletron.dataset.storage.objects import is_url, join_url, url_name
from puzzletron.dataset.storage.sources import open_source

__all__ = [
    "FORMATS",
    "MANIFEST",
    "Format",
    "VerifyReport",
    "describe",
    "detect",
    "format_of",
    "render",
    "summary",
    "verify",
]


@dataclass(frozen=True)
class Format:
    """What the command line and callers need of one on-disk format."""

    verify: Callable[[Path], VerifyReport]  # every byte; never raises for a damaged snapshot
    describe: Callable[[Path], dict[str, Any]]  # a JSON-ready summary with a "format" key
    render: Callable[[Mapping[str, Any]], list[str]]  # `describe`'s summary as lines of text
    counts: str  # what a report counted, filled from its fields: "{sample_count} samples, ..."
    unnamed: Callable[[Mapping[str, Any]], bool] | None = None  # recognises manifests without "format"


def _unnamed_subset(manifest: Mapping[str, Any]) -> bool:
    return is_original_layout(manifest) and "images" in manifest


FORMATS: dict[str, Format] = {
    SUBSET_FORMAT: Format(
        verify_subset,
        describe_subset,
        render_subset,
        "{sample_count} samples, {image_count} images",
        _unnamed_subset,
    ),
    TEXT_SNAPSHOT_FORMAT: Format(
        verify_text_snapshot,
        describe_text_snapshot,
        render_text_snapshot,
        "{sample_count} rows",
        is_unnamed_text_snapshot,
    ),
    TOKEN_STORE_FORMAT: Format(
        verify_token_store, describe_token_store, render_token_store, "{sample_count} samples"
    ),
    VLM_STORE_FORMAT: Format(
        verify_vlm_store, describe_vlm_store, render_vlm_store, "{sample_count} samples, {image_count} images"
    ),
}


def format_of(manifest: Any, where: str = MANIFEST) -> str:
    """The format name of a parsed manifest (the documented detection above); `SnapshotError` if none."""
    if not isinstance(manifest, Mapping):
        raise SnapshotError(f"{where}: expected a JSON object, got {type(manifest).__name__}")
    name = manifest.get("format")
    if name is None:
        for candidate, entry in FORMATS.items():
            if entry.unnamed is not None and entry.unnamed(manifest):
                return candidate
        raise SnapshotError(
            f"{where}: no 'format', and not a manifest of a known format ({', '.join(FORMATS)})"
        )
    if not isinstance(name, str) or name not in FORMATS:
        raise SnapshotError(f"{where}: unknown format {name!r}; this code reads {', '.join(FORMATS)}")
    return name


def _remote_manifest(url: str) -> tuple[bytes, Any, str]:
    """The manifest at `url`: its bytes (bounded by its listed size, `MAX_JSON_BYTES`), value and format."""
    where = join_url(url, MANIFEST)
    try:
        raw = read_bounded(open_source(url, cache=None), MANIFEST, "the manifest", max_bytes=MAX_JSON_BYTES)
    except SnapshotError as exc:
        raise SnapshotError(f"{where}: no snapshot there ({exc})") from None
    try:
        manifest = parse_json(raw, "the manifest")
    except ValueError as exc:
        raise SnapshotError(f"{where}: {exc}") from None
    return raw, manifest, format_of(manifest, where)


def detect(path: str | Path) -> str:
    """The format name of the snapshot at `path` (a folder or an URL), read from its ``manifest.json``."""
    if is_url(path):
        return _remote_manifest(str(path).rstrip("/"))[2]
    manifest_path = _folder(path) / MANIFEST
    return format_of(load_json(manifest_path, "the manifest"), str(manifest_path))


def _downloaded(url: str, run: Callable[[Path, list[str]], Any]) -> Any:
    """`run(folder, problems)` on a temporary local copy of the snapshot at `url` (formats read whole: a
    subset, a text snapshot): only the files its manifest lists (`_fetch.fetch_listed`), with the problems
    the listing showed."""
    raw, manifest, name = _remote_manifest(url)
    with tempfile.TemporaryDirectory(prefix="puzzletron-fetch-") as tmp:
        folder = Path(tmp) / url_name(url)
        problems = fetch_listed(url, folder, name, raw, manifest)
        return run(folder, problems)


def verify(path: str | Path) -> VerifyReport:
    """Verify the snapshot at `path` (a folder or an URL) with its format's verifier; a directory whose
    format cannot be told is a report with that one problem (never an exception). A token store at an URL
    is streamed once; another format's listed files are downloaded to a temporary folder and verified
    there (anything else under the prefix is never fetched)."""
    root: Any = str(path).rstrip("/") if is_url(path) else Path(path).absolute()
    try:
        name = detect(root)
    except SnapshotError as exc:
        return VerifyReport(str(root), 0, 0, (str(exc),))
    if isinstance(root, Path) or name == TOKEN_STORE_FORMAT:
        return FORMATS[name].verify(root)

    def local(folder: Path, listed: list[str]) -> VerifyReport:
        report = FORMATS[name].verify(folder)
        problems = tuple(p.replace(str(folder), root) for p in report.problems) + tuple(listed)
        return dataclasses.replace(report, path=root, problems=problems)

    try:
        return _downloaded(root, local)
    except SnapshotError as exc:
        return VerifyReport(root, 0, 0, (str(exc),), name)


def _folder(path: str | Path) -> Path:
    """`path` made absolute; `SnapshotError` when there is no such folder (before looking for a manifest)."""
    root = Path(path).absolute()
    if not root.is_dir():
        raise SnapshotError(f"{root}: {'not a folder' if root.exists() else 'no such folder'}")
    return root


def describe(path: str | Path) -> dict[str, Any]:
    """The summary of the snapshot at `path` its format gives (``format`` names it); `SnapshotError` when the
    directory holds no snapshot of a known format."""
    if is_url(path):
        url, name = str(path).rstrip("/"), detect(path)
        if name == TOKEN_STORE_FORMAT:
            return FORMATS[name].describe(url)
        return _downloaded(url, lambda folder, _: {**FORMATS[name].describe(folder), "path": url})
    root = Path(path).absolute()
    return FORMATS[detect(root)].describe(root)


def summary(report: VerifyReport) -> str:
    """What `report` counted, in its format's words (``"3 samples, 4 images"``, ``"5 rows"``)."""
    entry = FORMATS.get(report.format)
    template = entry.counts if entry is not None else "{sample_count} items"
    return template.format(sample_count=report.sample_count, image_count=report.image_count)


def render(info: Mapping[str, Any]) -> list[str]:
    """A `describe` summary as lines of text, in its format's layout."""
    return FORMATS[info["format"]].render(info)

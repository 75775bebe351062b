"""Where the token store of an identity lives in a cache directory: wherever it already is, else at its hash.

With a ``cache_dir`` (`build_token_store`, `build_batches`, ``puzzletron-data tokenize --cache-dir``) a
complete store of the wanted identity is reused wherever it lies under that directory: at
``<cache_dir>/<16 hex digits of its identity hash>`` (where a build with ``cache_dir`` puts one), or at any
path a user chose, such as ``puzzletron-data tokenize ... --output <cache_dir>/puzzle-kd``. So one store is
never built twice. Only when none is found is a new one built at ``<cache_dir>/<hash>``.

The search reads manifests only: it looks at the hashed name first, then walks the directory in sorted
order without entering a folder that holds a ``manifest.json`` (a store, a snapshot), a hidden folder (build
and transaction directories) or a symbolic link. A manifest whose ``identity_sha256`` matches is taken
when its full identity is equal and the store is complete (every file there with its size); an incomplete
one is passed over. Under an URL prefix (``s3://bucket/stores``) the same rules hold, read from one
listing of the prefix.

A cache directory is a shared place anyone may write, so what the search reads is bounded
(`formats.manifest.read_regular`, ``read_bounded``, ``parse_json``): only a regular file named
``manifest.json`` of at most `MAX_MANIFEST_BYTES` (64 MiB; a store's manifest is ~130 bytes a shard
file), nested at most 64 levels, is parsed; a FIFO, a device, a larger file or a deeper one is passed
over with a warning naming it, without blocking or reading it whole.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    parse_json,
    read_bounded,
    read_regular,
)
from puzzletron.dataset.formats.token_store import read_complete_manifest
from puzzletron.dataset.storage.objects import Objects, is_url, join_url
from puzzletron.dataset.storage.remote import RemoteFiles
from puzzletron.dataset.tokenize.identity import identity_sha256

__all__ = ["cache_path", "find_store"]

_LOG = logging.getLogger(__name__)


Complete = Callable[[Any], dict[str, Any]]  # a format's completeness check: the manifest, or SnapshotError


def _matches(
    location: Path | str, identity: Mapping[str, Any], digest: str, complete: Complete | None = None
) -> bool:
    """Whether ``location`` (a folder or an URL) holds a complete store of ``identity`` (its manifest's
    hash first; ``complete`` checks it, the token store's check by default)."""
    try:
        if isinstance(location, Path):
            raw = read_regular(location / MANIFEST, "the manifest", max_bytes=MAX_MANIFEST_BYTES)
        else:
            raw = read_bounded(RemoteFiles(location, cache=None), MANIFEST, "the manifest")
        recorded = parse_json(raw, "the manifest")
    except (OSError, ValueError) as exc:  # SnapshotError is a ValueError
        _LOG.warning("passing over %s: %s", location, exc)
        return False
    if not isinstance(recorded, dict) or recorded.get("identity_sha256") != digest:
        return False
    try:
        manifest = (complete or read_complete_manifest)(location)
    except SnapshotError as exc:
        _LOG.warning(
            "passing over %s, a store of the wanted identity that is not complete: %s", location, exc
        )
        return False
    return manifest.get("identity") == identity


def _find_remote(cache_dir: str, identity: Mapping[str, Any], digest: str) -> str | None:
    """`find_store` under an URL prefix: one listing; manifests inside a store or a hidden folder are not
    looked at."""
    cache_dir = cache_dir.rstrip("/")
    folders = {
        rel[: -len(MANIFEST)].rstrip("/")
        for rel in Objects(cache_dir).list()
        if rel == MANIFEST or rel.endswith("/" + MANIFEST)
    }

    def visible(folder: str) -> bool:  # not hidden, not inside another folder holding a manifest
        parts = folder.split("/") if folder else []
        return not any(p.startswith(".") for p in parts) and not any(
            "/".join(parts[:i]) in folders for i in range(len(parts))
        )

    for folder in sorted(filter(visible, folders), key=lambda f: (f != digest[:16], f)):
        url = join_url(cache_dir, folder) if folder else cache_dir
        if _matches(url, identity, digest):
            return url
    return None


def find_store(
    cache_dir: str | Path, identity: Mapping[str, Any], *, complete: Complete | None = None
) -> Path | str | None:
    """The complete token store of ``identity`` under ``cache_dir`` (absolute; an URL prefix gives an URL),
    or None (module doc); ``complete`` checks a local candidate of another format (a VLM store's)."""
    digest = identity_sha256(identity)
    if is_url(cache_dir):
        return _find_remote(str(cache_dir), identity, digest)
    root = Path(os.path.abspath(cache_dir))
    named = root / digest[:16]
    if (named / MANIFEST).is_file() and _matches(named, identity, digest, complete):
        return named
    if not root.is_dir():
        return None
    for folder, subfolders, files in os.walk(root):
        if MANIFEST in files:
            subfolders.clear()  # a store or a snapshot: nothing to find inside it
            if _matches(Path(folder), identity, digest, complete):
                return Path(folder)
            continue
        subfolders[:] = sorted(
            name
            for name in subfolders
            if not name.startswith(".") and not os.path.islink(os.path.join(folder, name))
        )
    return None


def cache_path(
    cache_dir: str | Path, identity: Mapping[str, Any], *, complete: Complete | None = None
) -> Path | str:
    """Where the store of ``identity`` is in ``cache_dir``: the one found (`find_store`), else
    ``<cache_dir>/<16 hex digits of its identity hash>`` (absolute; an URL for an URL)."""
    found = find_store(cache_dir, identity, complete=complete)
    if found is not None:
        return found
    if is_url(cache_dir):
        return join_url(str(cache_dir), identity_sha256(identity)[:16])
    return Path(os.path.abspath(cache_dir)) / identity_sha256(identity)[:16]

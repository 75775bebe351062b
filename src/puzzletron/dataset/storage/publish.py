"""A finished local snapshot (a folder with its manifest) published at an URL prefix, complete or not at all.

    publish_folder(folder, "s3://b/snapshots/pk", digest=identity_sha256, what="text snapshot")

Object storage has no rename, so the manifest is the publication: the prefix is claimed for the snapshot's
identity (`claims.take_claim`: a publish of another identity is refused before anything is written), every
other file is uploaded, and the manifest is written last, once (`Objects.create_once`, ``If-None-Match:
*``). A reader that finds the manifest finds every file it lists; a publish killed or failed before it leaves
no manifest. Its rerun (any node) uploads only what is not there yet as it was uploaded: the publish keeps a
journal of its uploads in the staging prefix (`storage.upload_journal`: each file's size, xxh3_128 and the
ETag its object got), removed once the manifest is written. A prefix that already holds the same manifest
bytes is reused (nothing uploaded); one whose manifest records another ``acquisition`` is refused, naming
both.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from contextlib import suppress
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.storage.claims import release_claim, take_claim
from puzzletron.dataset.storage.objects import Objects
from puzzletron.dataset.storage.upload_journal import UploadJournal

__all__ = ["MAX_PUBLISHED_MANIFEST_BYTES", "publish_folder", "published_manifest"]

MAX_PUBLISHED_MANIFEST_BYTES = 1 << 30  # a subset's manifest: ~200 bytes an image
_MANIFEST = "manifest.json"
_LOG = logging.getLogger(__name__)


def published_manifest(url: str, *, manifest: str = _MANIFEST) -> bytes | None:
    """The bytes of the manifest at `url`, None when there is none (nothing is published there); one over
    `MAX_PUBLISHED_MANIFEST_BYTES` is refused from its listed size before a byte is fetched."""
    objects = Objects(url)
    info = objects.info(manifest)
    if info is None:
        return None
    if info.size > MAX_PUBLISHED_MANIFEST_BYTES:
        raise SnapshotError(f"{objects.url_of(manifest)} has {info.size} bytes; a manifest has at most "
                            f"{MAX_PUBLISHED_MANIFEST_BYTES}")  # fmt: skip
    return objects.get(manifest)


def _acquisition(data: bytes, where: str) -> Any:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise SnapshotError(f"{where}: not a JSON manifest ({exc})") from None
    return value.get("acquisition") if isinstance(value, dict) else None


def _check_same(url: str, there: bytes, mine: bytes, what: str, manifest: str) -> None:
    """Refuse when the manifest `there` at `url` is another snapshot than `mine` (another acquisition)."""
    if there == mine:
        return
    where = f"{url.rstrip('/')}/{manifest}"
    theirs, ours = _acquisition(there, where), _acquisition(mine, "the local manifest")
    if theirs != ours or theirs is None:
        raise SnapshotError(
            f"{url}: another {what} is published here (acquisition {json.dumps(theirs, sort_keys=True)}); "
            f"this one is acquisition {json.dumps(ours, sort_keys=True)}. A prefix holds one {what}: choose "
            "another output, or remove the published one first"
        )


def publish_folder(
    folder: str | os.PathLike[str], url: str, *, digest: str, what: str, manifest: str = _MANIFEST
) -> bool:
    """Publish the snapshot in the local `folder` at the prefix `url`: True when this call wrote its manifest,
    False when the same snapshot was there already (the same manifest bytes, or another manifest of the same
    acquisition: the first published stands). `digest` is the snapshot's identity hash, the claim's.
    `SnapshotError` when another snapshot (or a publish of another identity) holds the prefix."""
    local = Path(folder, manifest)
    try:
        mine = local.read_bytes()
    except OSError as exc:
        raise SnapshotError(f"{folder}: no {manifest} to publish ({exc})") from None
    there = published_manifest(url, manifest=manifest)
    if there is not None:
        _check_same(url, there, mine, what, manifest)
        return False
    owner = secrets.token_hex(8)
    take_claim(url, digest, owner, what=what)
    journal = UploadJournal(url, digest, owner)
    try:
        there = published_manifest(url, manifest=manifest)  # published by another while we claimed
        if there is None:
            objects = Objects(url)
            _upload(objects, Path(folder), journal, last=manifest)
            if not objects.create_once(manifest, mine):
                there = published_manifest(url, manifest=manifest)
                if there is None:
                    raise SnapshotError(f"{objects.url_of(manifest)}: written by another and then removed")
        if there is not None:
            _check_same(url, there, mine, what, manifest)
    except BaseException:  # a clean failure leaves the claim of a live publish it joined alone
        release_claim(url, digest, owner=owner)
        raise
    journal.clear()  # the parts of this publish and of those it resumed
    release_claim(url, digest)  # the manifest says what the prefix holds from now on
    return there is None


def _upload(objects: Objects, folder: Path, journal: UploadJournal, *, last: str) -> None:
    """Upload every regular file under `folder` by relative path but `last` (the manifest), passing over
    those an earlier publish of this identity uploaded as they are now (`UploadJournal.holds`); what this
    call uploads is journaled, also when it fails part-way."""
    journal.load()
    listing = objects.list()
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
    files = [(p.relative_to(folder).as_posix(), p) for p in files]
    kept = 0
    try:
        for rel, local in files:
            if rel == last:
                continue
            if journal.holds(rel, local, listing.get(rel)):
                kept += 1
                continue
            objects.put_file(rel, local)
            journal.record(rel, local, objects.info(rel))
    except BaseException:
        with suppress(OSError):  # the upload's own error is the one to see
            journal.flush()
        raise
    journal.flush()
    if kept:
        total = sum(rel != last for rel, _ in files)
        _LOG.info("%s: %d of %d files were there from an earlier publish; uploaded the rest", objects.url,
                  kept, total)  # fmt: skip

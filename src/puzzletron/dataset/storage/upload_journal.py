"""What a publish at an URL has uploaded so far, so that its rerun after a kill or a failure uploads only
the rest (`storage.publish.publish_folder`).

    journal = UploadJournal(url, digest, owner)          # after the prefix is claimed for `digest`
    done = journal.load()                                # what earlier publishes of this identity recorded
    if not journal.holds(rel, local_file, listing.get(rel)):
        objects.put_file(rel, local_file)
        journal.record(rel, local_file, objects.info(rel))
    journal.flush()                                      # also on a failure: what went up stays known
    journal.clear()                                      # once the manifest is published

The journal lives in the build's staging prefix beside the destination (`claims.staging_url`, as a token
store build's seals do), so a rerun on another node resumes too: parts ``uploads/<owner>-<k>.json``, each
``{"format": "puzzletron-upload-journal", "files": {rel: {"bytes", "xxh3_128", "etag"}}}``, written (one
PUT, so whole or absent) after every `PART_FILES` files or `PART_BYTES` bytes uploaded. A kill loses at
most the entries of one part: those files are uploaded again.

A file is passed over only when a part records it with the local file's size and xxh3_128 and the object
at the URL has that size and the ETag recorded when it was uploaded. An object overwritten since (another
ETag), a local file that changed, a backend without ETags, or a part that is not a journal (too large, not
JSON, another shape): the file is uploaded again; nothing from the prefix is trusted beyond saving an
upload. The manifest written last holds every file's SHA-256, which readers check (``docs/trust-model.md``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from puzzletron.dataset.storage.claims import staging_url
from puzzletron.dataset.storage.objects import ObjectInfo, Objects
from puzzletron.dataset.storage.seals import file_digest

__all__ = ["JOURNAL_FORMAT", "PART_BYTES", "PART_FILES", "UploadJournal"]

JOURNAL_FORMAT = "puzzletron-upload-journal"
PART_FILES = 256  # files a part records at most (about 100 bytes each)
PART_BYTES = 1 << 30  # bytes uploaded before a part is written: what a kill can cost again
_MAX_PART_BYTES = 1 << 20
_PREFIX = "uploads/"
_LOG = logging.getLogger(__name__)

Entry = tuple[int, str, str]  # (bytes, xxh3_128, ETag)


def _entries(data: bytes | None) -> dict[str, Entry]:
    """The entries of one part, or none when `data` is not a journal part."""
    try:
        value = json.loads(data or b"")
    except (ValueError, RecursionError, UnicodeDecodeError):
        return {}
    files = value.get("files") if isinstance(value, dict) and value.get("format") == JOURNAL_FORMAT else None
    if not isinstance(files, dict):
        return {}
    out = {}
    for rel, entry in files.items():
        if not isinstance(entry, dict):
            continue
        size, digest, etag = entry.get("bytes"), entry.get("xxh3_128"), entry.get("etag")
        if type(size) is int and isinstance(digest, str) and isinstance(etag, str) and etag:
            out[rel] = (size, digest, etag)
    return out


class UploadJournal:
    """The uploads of the publishes of identity `digest` at `url`; `owner` names this publish's parts."""

    def __init__(self, url: str, digest: str, owner: str) -> None:
        self.staging = Objects(staging_url(url, digest))
        self.owner = owner
        self.known: dict[str, set[Entry]] = {}
        self._pending: dict[str, dict[str, Any]] = {}
        self._pending_bytes = 0
        self._parts = 0

    def load(self) -> int:
        """Read every part earlier publishes left (each at most 1 MiB; others ignored); the files they
        record."""
        for rel, info in sorted(self.staging.list(_PREFIX.rstrip("/")).items()):
            if not rel.startswith(_PREFIX) or info.size > _MAX_PART_BYTES:
                continue
            for name, entry in _entries(self.staging.get(rel)).items():
                self.known.setdefault(name, set()).add(entry)
        return len(self.known)

    def holds(self, rel: str, local: Path, there: ObjectInfo | None) -> bool:
        """Whether the object `there` (the listing's for `rel`) is the local file as a part recorded it."""
        entries = self.known.get(rel)
        if not entries or there is None or there.etag is None:
            return False
        size = os.path.getsize(local)
        if there.size != size or not any(e[0] == size and e[2] == there.etag for e in entries):
            return False
        return (size, file_digest(local), there.etag) in entries

    def record(self, rel: str, local: Path, info: ObjectInfo | None) -> None:
        """Note that `local` went up as `rel` (`info`: the object's, after the upload); a part is written
        when enough is noted. Nothing is noted without an ETag (then a rerun uploads it again)."""
        if info is None or info.etag is None:
            return
        self._pending[rel] = {"bytes": info.size, "xxh3_128": file_digest(local), "etag": info.etag}
        self._pending_bytes += info.size
        if len(self._pending) >= PART_FILES or self._pending_bytes >= PART_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write what is noted as one part (nothing when nothing is)."""
        if not self._pending:
            return
        body = {"format": JOURNAL_FORMAT, "files": self._pending}
        rel = f"{_PREFIX}{self.owner}-{self._parts:06d}.json"
        self.staging.put_bytes(rel, json.dumps(body, sort_keys=True).encode())
        self._parts += 1
        self._pending, self._pending_bytes = {}, 0

    def clear(self) -> None:
        """Remove every part (once the manifest is published); best effort, a leftover is only bytes."""
        try:
            self.staging.delete(sorted(self.staging.list(_PREFIX.rstrip("/"))))
        except OSError as exc:
            _LOG.info("left the upload journal under %s: %s", self.staging.url, exc)

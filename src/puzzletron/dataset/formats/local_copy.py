"""A text snapshot at an URL as a local folder, for the readers that take folders (`open_split`, the token
store build, the in-memory tokenisation): the files its manifest lists, copied once a node, verified before
first use.

    folder = local_text_snapshot("s3://b/snapshots/pk")   # <object cache>/snapshots/<manifest SHA-256>
    build_token_store(folder, ...)                          # what build_token_store("s3://...") does

The copy is keyed by content: its folder is named by the SHA-256 of the manifest's bytes (which hold every
file's SHA-256), under the node's object cache (``PUZZLETRON_OBJECT_CACHE``), so one snapshot is copied
once a node whatever its URL, and a snapshot changed at the URL (another manifest) is another copy. It is
fetched under the folder's lock (`storage.atomic.locked`: the node's other ranks wait, then reuse it) into
a transaction directory with `formats._fetch.fetch_listed` (only the listed files, each at its recorded
size; an object nobody listed is never fetched, and passed over: a reader of a local folder ignores an
unlisted file too), checked there with `verify_text_snapshot` (every byte's
SHA-256, every split's rows) and published with one rename: a damaged object at the URL is a
`SnapshotError` naming it, and nothing is published or built. Everything from an URL is untrusted
(``docs/trust-model.md``).

Reuse needs no GET of a data file: beside the folder, ``<name>.verified.json`` pins every file of the copy
as it was verified (size, inode, modification time); a copy whose files all match is used as it is, any
other (a file changed, removed or added since, no pins: a killed copy) is removed and fetched again under
the lock, never trusted. The identity of a store built from the copy is that of the same snapshot read
from any folder (it is taken from the manifest's file hashes, never a path).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats import _remote_manifest
from puzzletron.dataset.formats._fetch import fetch_listed
from puzzletron.dataset.formats.manifest import MANIFEST, load_json
from puzzletron.dataset.formats.text_snapshot import TEXT_SNAPSHOT_FORMAT, verify_text_snapshot
from puzzletron.dataset.storage.atomic import locked, staging_dir
from puzzletron.dataset.storage.objects import is_url
from puzzletron.dataset.storage.settings import object_settings

__all__ = ["COPIES", "PINS_SUFFIX", "local_text_snapshot", "snapshot_folder"]

_LOG = logging.getLogger(__name__)
COPIES = "snapshots"  # the folder of the copies in the node's object cache
PINS_SUFFIX = ".verified.json"
_MAX_PINS_BYTES = 16 << 20


def _pins_of(folder: Path) -> Path:
    return folder.with_name(folder.name + PINS_SUFFIX)


def _files(folder: Path) -> dict[str, list[int]] | None:
    """``{relative path: [size, inode, modification time in ns]}`` of every file under `folder`; None when
    an entry is neither a folder nor a regular file (a symlink, a FIFO: a copy holds regular files only)."""
    out: dict[str, list[int]] = {}
    for base, dirs, names in os.walk(folder):  # symlinked folders are listed in `dirs`, never followed
        if any(os.path.islink(os.path.join(base, name)) for name in dirs):
            return None
        for name in names:
            st = os.lstat(os.path.join(base, name))
            if not stat.S_ISREG(st.st_mode):
                return None
            rel = os.path.relpath(os.path.join(base, name), folder).replace(os.sep, "/")
            out[rel] = [st.st_size, st.st_ino, st.st_mtime_ns]
    return out


def _pinned(folder: Path, key: str) -> bool:
    """Whether `folder` is a copy verified for the manifest of SHA-256 `key` and unchanged since (every
    file as pinned, none added; the manifest's bytes rehashed)."""
    pins_path = _pins_of(folder)
    if not folder.is_dir() or not pins_path.is_file():
        return False
    try:
        pins = load_json(pins_path, "the pins of a verified copy", max_bytes=_MAX_PINS_BYTES)
        files = _files(folder)
        manifest = (folder / MANIFEST).read_bytes()
    except (SnapshotError, OSError):
        return False
    return (
        isinstance(pins, dict)
        and pins.get("manifest_sha256") == key
        and hashlib.sha256(manifest).hexdigest() == key
        and files is not None
        and pins.get("files") == files
    )


def _write_pins(folder: Path, key: str, url: str) -> None:
    """Pin the verified copy `folder` (written to a temporary file and renamed)."""
    pins_path = _pins_of(folder)
    files = _files(folder)
    blob = json.dumps({"manifest_sha256": key, "from": url, "files": files}, indent=1, sort_keys=True)
    tmp = pins_path.with_name(f".{pins_path.name}.tmp-{os.getpid()}")
    tmp.write_text(blob + "\n", encoding="utf-8")
    os.replace(tmp, pins_path)


def _fetch_verified(url: str, tmp: Path, raw: bytes, manifest: Any) -> None:
    """Fetch the listed files into `tmp` and verify them there; `SnapshotError` naming every problem (at
    its URL) when the snapshot at `url` is not exactly what its manifest records."""
    listed = fetch_listed(url, tmp, TEXT_SNAPSHOT_FORMAT, raw, manifest, unexpected=False)
    report = verify_text_snapshot(tmp)
    problems = [p.replace(str(tmp.absolute()), url) for p in report.problems] + listed
    if problems:
        shown = "; ".join(problems[:5]) + (f"; ... {len(problems) - 5} more" if len(problems) > 5 else "")
        raise SnapshotError(
            f"{url}: the text snapshot there is not what its manifest records, nothing was built from it: "
            f"{shown} (`puzzletron-data verify {url}` lists every problem; rematerialise it)"
        )


def local_text_snapshot(url: str, *, root: str | Path | None = None) -> Path:
    """The verified local copy of the text snapshot at `url` (see the module docstring), fetched when this
    node holds none; ``root``: where the copies live (default ``<object cache>/snapshots``). `SnapshotError`
    when there is no text snapshot at `url` or it differs from its manifest (naming the object)."""
    url = str(url).rstrip("/")
    raw, manifest, fmt = _remote_manifest(url)
    if fmt != TEXT_SNAPSHOT_FORMAT:
        raise SnapshotError(f"{url}: a {fmt}, not a text snapshot ({TEXT_SNAPSHOT_FORMAT})")
    if not isinstance(manifest.get("files"), list):
        raise SnapshotError(
            f"{url}/{MANIFEST}: lists no files (written by an older version), so a copy cannot be checked; "
            "rematerialise the snapshot"
        )
    key = hashlib.sha256(raw).hexdigest()
    base = Path(root) if root is not None else object_settings().cache / COPIES
    folder = Path(os.path.abspath(base)) / key
    if _pinned(folder, key):
        return folder
    with locked(folder):  # the node's other processes wait here, then reuse the copy
        if _pinned(folder, key):
            return folder
        if os.path.lexists(folder):
            _LOG.warning("%s: the copy of %s changed since it was verified; fetching it again", folder, url)
            _pins_of(folder).unlink(missing_ok=True)
            if folder.is_dir() and not folder.is_symlink():
                shutil.rmtree(folder)
            else:
                folder.unlink()
        _LOG.info("copying the text snapshot %s to %s", url, folder)
        with staging_dir(folder) as tmp:
            _fetch_verified(url, tmp, raw, manifest)
        _write_pins(folder, key, url)
    return folder


def snapshot_folder(location: str | Path) -> Path:
    """The local folder of a text snapshot: `location` itself, or for an URL its verified local copy
    (`local_text_snapshot`)."""
    return local_text_snapshot(str(location)) if is_url(location) else Path(location)

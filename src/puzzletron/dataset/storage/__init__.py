"""Where bytes live: crash-safe publication of a directory (`atomic`: a lock per destination, a
transaction directory, fsync, one rename) on a local or shared POSIX file system, and reading one
(`sources.ByteSource`, implemented for local files by `local.LocalFiles`: positional reads, pinned files).

This package is the seam for other storage: a reader or publisher for another medium (object storage) is
one more module here, and the formats reach storage only through it (``docs/architecture.md``).
"""

from __future__ import annotations

from puzzletron.dataset.storage.atomic import (
    NAME_MAX,
    check_destination,
    fsync_path,
    fsync_tree,
    locked,
    publications,
    staging_dir,
    sweep_stale,
    tidy,
    with_path,
)
from puzzletron.dataset.storage.local import FileIdentity, LocalFiles, pread_into
from puzzletron.dataset.storage.sources import ByteSource, open_source

__all__ = [
    "NAME_MAX",
    "ByteSource",
    "FileIdentity",
    "LocalFiles",
    "check_destination",
    "fsync_path",
    "fsync_tree",
    "locked",
    "open_source",
    "pread_into",
    "publications",
    "staging_dir",
    "sweep_stale",
    "tidy",
    "with_path",
]

"""Where bytes live: crash-safe publication of a directory (`atomic`: a lock per destination, a
transaction directory, fsync, one rename) on a local or shared POSIX file system.

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
)

__all__ = [
    "NAME_MAX",
    "check_destination",
    "fsync_path",
    "fsync_tree",
    "locked",
    "publications",
    "staging_dir",
    "sweep_stale",
    "tidy",
]

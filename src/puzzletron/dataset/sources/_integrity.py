"""What a downloaded file must be before it is used: the size and hash the Hub gives for it.

A file in the Hub cache may have been truncated or replaced since it was downloaded (a full disk, a killed
copy, a hand edit); read as it is, a tar shard cut at a member boundary is still a valid tar with fewer
members, and a snapshot would silently hold other rows under the same pinned identity. So every downloaded
file is hashed before use and compared with what the Hub says of it (``docs/trust-model.md``):

- the repository listing at the pinned commit (``list_repo_tree``): the size, and the SHA-256 of an LFS
  file or the git blob id (SHA-1 of ``"blob <size>\\0" + content``) of any other file;
- where no listing is at hand (the endpoint is unreachable and the file is cached), the ETag the file was
  downloaded under, which names its blob in the cache: 64 hex digits are the SHA-256, 40 the git blob id.

This module only reads local files; `_hub` asks the Hub and re-fetches a file that does not match.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as tmp:
...     path = Path(tmp) / "f"
...     _ = path.write_bytes(b"hello")
...     mismatch(path, Digest(5, "git-sha1", "b6fc4c620b67d95f953a5c1c1230aaab5db5a1b0"))
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Digest", "from_cache_blob", "from_listing", "mismatch"]

_CHUNK = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHA1 = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class Digest:
    """What a file must be: its size (None: unknown) and its hash under `algorithm` (``"sha256"`` of the
    content, or ``"git-sha1"``: the git blob id)."""

    size: int | None
    algorithm: str
    hexdigest: str


def from_listing(entry: Any) -> Digest | None:
    """The digest a repository listing entry (`huggingface_hub.RepoFile`) gives: the LFS SHA-256 when the
    file is in LFS, else its git blob id; None when the entry carries neither."""
    size = getattr(entry, "size", None)
    lfs = getattr(entry, "lfs", None)
    sha256 = getattr(lfs, "sha256", None) if lfs is not None else None
    if isinstance(sha256, str) and _SHA256.fullmatch(sha256):
        lfs_size = getattr(lfs, "size", None)
        return Digest(lfs_size if isinstance(lfs_size, int) else size, "sha256", sha256)
    blob_id = getattr(entry, "blob_id", None)
    if isinstance(blob_id, str) and _SHA1.fullmatch(blob_id):
        return Digest(size if isinstance(size, int) else None, "git-sha1", blob_id)
    return None


def from_cache_blob(local: Path) -> Digest | None:
    """The digest the Hub cache records for `local` (a snapshot entry pointing at ``blobs/<etag>``): the
    ETag the file was downloaded under, when it is a SHA-256 or a git blob id; None otherwise."""
    name = Path(os.path.realpath(local)).name
    if _SHA256.fullmatch(name):
        return Digest(None, "sha256", name)
    if _SHA1.fullmatch(name):
        return Digest(None, "git-sha1", name)
    return None


def _hash(path: Path, algorithm: str, size: int) -> str:
    digest = hashlib.sha256() if algorithm == "sha256" else hashlib.sha1(usedforsecurity=False)
    if algorithm == "git-sha1":
        digest.update(b"blob %d\0" % size)
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def mismatch(local: Path, expected: Digest) -> str | None:
    """None when the file `local` is `expected`; otherwise how it differs (one phrase)."""
    size = os.stat(local).st_size
    if expected.size is not None and size != expected.size:
        return f"it has {size} bytes, the Hub lists {expected.size}"
    actual = _hash(local, expected.algorithm, size)
    if actual != expected.hexdigest:
        return f"its {expected.algorithm} is {actual}, the Hub gives {expected.hexdigest}"
    return None

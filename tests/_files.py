"""Files on disk as the acquisition and subset tests compare them: a tree's bytes or SHA-256 digests, the
names beside a destination (debris), the files of a repository in the Hub cache (what was downloaded), and a
private copy of a fixture repository under another name (safe to commit to)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from puzzletron.fixtures.hub import FixtureHub, repo_path

__all__ = ["cached_files", "copy_repo", "siblings", "tree_bytes", "tree_digest"]


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def siblings(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir())


def cached_files(hf_home: Path, repo_id: str) -> list[str]:
    """Files of `repo_id` in the Hub cache (what was downloaded), relative to the snapshot."""
    folder = hf_home / "hub" / ("datasets--" + repo_id.replace("/", "--")) / "snapshots"
    return sorted(str(p.relative_to(next(folder.iterdir()))) for p in folder.rglob("*") if p.is_file())


def copy_repo(hub: FixtureHub, repo_id: str, new_id: str) -> Path:
    """A private copy of a fixture repository under another name in the same mirror (safe to commit to)."""
    target = repo_path(hub.root, new_id)
    if not target.exists():
        shutil.copytree(hub.repo_dir(repo_id), target)
    return target

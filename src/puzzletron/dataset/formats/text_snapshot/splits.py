"""`open_split`: the one place a split of a text snapshot is found, checked and opened.

A text snapshot is a Puzzle-KD snapshot folder (``manifest.json`` plus one ``save_to_disk`` folder per
split, as acquisition writes it); a plain saved ``DatasetDict`` (one folder per split) or a saved single
``Dataset`` (the folder itself; ``split`` is then not used) is read too. With a manifest, its format and
completeness are checked before a byte of the split is read, the split must be one it lists, and the
split's files and their SHA-256 come from it (`TextSplit.file_hashes`); without one they are hashed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.manifest import MANIFEST, check_file, load_json, sha256_file
from puzzletron.dataset.formats.text_snapshot.snapshot import read_text_snapshot

__all__ = ["TextSplit", "load_text_split", "open_split"]

# Per-process cache of memory-mapped splits, keyed by the split's files (path, device, inode, size, time of
# each): a split rewritten between two loads (new files) is loaded again, never served from the old mapping.
_DATASETS: dict[tuple[Any, ...], Any] = {}


@dataclass(frozen=True)
class TextSplit:
    """One split of a text snapshot, found and checked (no row read yet).

    Attributes:
        root: the snapshot folder.
        split: the split's name.
        folder: its ``save_to_disk`` folder (``root / split``, or ``root`` for a saved single Dataset).
        manifest: the text snapshot's manifest (complete), or None for a plain ``save_to_disk`` folder.
    """

    root: Path
    split: str
    folder: Path
    manifest: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def rows(self) -> int | None:
        """Rows of the split the manifest records (None without a manifest)."""
        return None if self.manifest is None else self.manifest["splits"][self.split]

    def file_hashes(self) -> dict[str, str]:
        """``{path relative to the split folder: SHA-256}`` of every file of the split, sorted: from the
        manifest when it lists its files, else hashed here (every byte)."""
        if self.manifest is not None and "files" in self.manifest:
            prefix = f"{self.folder.relative_to(self.root).as_posix()}/"
            files = {
                r["path"][len(prefix) :]: r["sha256"]
                for r in self.manifest["files"]
                if r["path"].startswith(prefix)
            }
        else:
            files = {
                p.relative_to(self.folder).as_posix(): sha256_file(p)
                for p in sorted(self.folder.rglob("*"))
                if p.is_file()
            }
        if not files:
            raise SnapshotError(f"snapshot {self.root}: split {self.split!r} has no files")
        return dict(sorted(files.items()))

    def check_bytes(self) -> None:
        """Hash every file of the split and compare it with the text snapshot's manifest: a build that
        takes its identity from the manifest's SHA-256s must not read other bytes under it
        (``docs/trust-model.md``). `SnapshotError` naming the first file that differs. Without a manifest
        the identity was hashed from these very files: nothing to compare. Reads every byte of the split."""
        if self.manifest is None or "files" not in self.manifest:
            return
        prefix = f"{self.folder.relative_to(self.root).as_posix()}/"
        for record in self.manifest["files"]:
            if not record["path"].startswith(prefix):
                continue
            path = check_file(self.root, record, within="the snapshot")
            if sha256_file(path) != record.get("sha256"):
                raise SnapshotError(
                    f"{self.root}: {record['path']} differs from the SHA-256 its manifest records (changed "
                    "since the snapshot was written); nothing was built from it: run `puzzletron-data verify "
                    f"{self.root}` and rematerialise the snapshot"
                )

    def load(self) -> Any:
        """The split as a memory-mapped `datasets.Dataset` (opened once per process and set of files)."""
        folder = self.folder.resolve()
        stats = ((p, p.stat()) for p in sorted(folder.rglob("*")) if p.is_file())
        key = (str(folder), *((str(p), s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns) for p, s in stats))
        if key not in _DATASETS:
            import datasets

            _DATASETS[key] = datasets.load_from_disk(str(folder))
        return _DATASETS[key]


def _saved_splits(root: Path) -> list[str] | None:
    """The splits a saved ``DatasetDict`` at `root` declares (its ``dataset_dict.json``), else None."""
    if not (root / "dataset_dict.json").is_file():
        return None
    saved = load_json(root / "dataset_dict.json", "the dataset dict")
    splits = saved.get("splits") if isinstance(saved, dict) else None
    return sorted(str(s) for s in splits) if isinstance(splits, list) else None


def open_split(snapshot: str | Path, split: str = "train") -> TextSplit:
    """Find split `split` of the text snapshot at `snapshot` (see the module docstring); `SnapshotError`
    naming what is wrong (no folder, an incomplete snapshot, a split that is not there and the ones that
    are)."""
    root = Path(snapshot)
    if not root.is_dir():
        raise SnapshotError(f"text snapshot {root} does not exist")
    manifest = read_text_snapshot(root) if (root / MANIFEST).is_file() else None
    if manifest is not None and split not in manifest["splits"]:
        raise SnapshotError(f"snapshot {root} has no split {split!r} (splits: {sorted(manifest['splits'])})")
    if (root / split).is_dir():
        return TextSplit(root, split, root / split, manifest)
    if manifest is None and (root / "state.json").is_file():
        return TextSplit(root, split, root, None)  # a saved single Dataset: the folder is the split
    known = sorted(manifest["splits"]) if manifest is not None else _saved_splits(root)
    listed = f" (splits: {known})" if known is not None else ""
    raise SnapshotError(f"snapshot {root} has no split {split!r}{listed}")


def load_text_split(snapshot: str | Path, *, split: str = "train") -> Any:
    """One split of a text snapshot as a `datasets.Dataset`, offline (`open_split` then `TextSplit.load`)."""
    return open_split(snapshot, split).load()

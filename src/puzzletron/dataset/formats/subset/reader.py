"""Read an offline conversation subset: its manifest (with the completeness check), lazily sample by
sample (`SubsetReader`), or whole (`load_materialized_conversation_subset`).

The format: ``docs/subset-format.md``. The original layout (a ``samples.json`` array, no ``format`` in the
manifest) is read unchanged.
"""

from __future__ import annotations

import array
import contextlib
import copy
import hashlib
import operator
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.conversation.images import decode_rgb
from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.manifest import (
    MANIFEST,
    inside,
    load_json,
    parse_json,
)
from puzzletron.dataset.formats.media_shards import MediaShards
from puzzletron.dataset.formats.subset._layout import (
    IDX_HEADER,
    IDX_MAGIC,
    INDEX,
    LEGACY_SAMPLES,
    SAMPLES,
    image_items,
    is_original_layout,
    is_sharded,
    label,
    little_endian,
)
from puzzletron.dataset.formats.subset._manifest import read_manifest, subset_manifest, subset_root
from puzzletron.dataset.storage.local import LocalFiles
from puzzletron.dataset.storage.objects import join_url
from puzzletron.dataset.storage.sources import open_source

__all__ = [
    "SubsetReader",
    "load_materialized_conversation_subset",
    "load_materialized_intersyn_subset",
    "read_manifest",
    "subset_manifest",
]


class SubsetReader(Sequence):
    """Random access to the samples of a subset without parsing the whole sample file.

    `reader[i]` reads one line through the offset index and returns a fresh sample dict whose image items
    hold absolute paths (checked to exist and to stay inside the subset); in a subset whose images are in
    media shards, or at an URL (``s3://bucket/subsets/vlm``: read through the node's object cache, every
    object pinned by its ETag), they hold the decoded RGB PIL images instead (SHA-256 checked). Original-
    layout subsets are read whole (they are small). Safe to share with forked DataLoader workers
    (positional reads only).
    """

    def __init__(self, path: str | Path) -> None:
        self.root: Any = subset_root(path)
        self._manifest: dict[str, Any] | None = None
        self._legacy: list[dict[str, Any]] | None = None
        self._fds: tuple[int, int] | None = None
        self._media: MediaShards | None = None
        self._source = open_source(self.root) if isinstance(self.root, str) else None
        if self._source is None and not (self.root / MANIFEST).is_file():
            raise SnapshotError(f"{self.root}: no {MANIFEST}; not a complete subset")
        # format, version and counts before any sample is served (image records: when one is used)
        header = subset_manifest(self.root, records=False, source=self._source)
        self.sharded = is_sharded(header)
        self._media_record = header.get("media") if self.sharded else None
        self._image_sha = None
        if not is_original_layout(header):
            if self._source is not None:
                for rel in (INDEX, SAMPLES):
                    self._source.pin(rel)
            elif not ((self.root / INDEX).is_file() and (self.root / SAMPLES).is_file()):
                raise SnapshotError(f"{self.root}: {SAMPLES} or {INDEX} is missing; not a complete subset")
            self._open()
        elif self._source is None and (self.root / LEGACY_SAMPLES).is_file():
            samples = load_json(self.root / LEGACY_SAMPLES, "the sample list")
            if not isinstance(samples, list):
                raise SnapshotError(f"{self.root / LEGACY_SAMPLES}: expected a JSON array of samples")
            self._legacy = samples
            self._count = len(samples)
            self._group_count = len(set(map(self._group_key, enumerate(samples))))
        else:
            raise SnapshotError(f"{self.root}: {LEGACY_SAMPLES} is missing; not a complete subset")
        if self._count != header["sample_count"]:
            self.close()
            raise SnapshotError(
                f"{self.root}: {self._count} samples on disk, the manifest records {header['sample_count']}"
            )

    @staticmethod
    def _group_key(entry: tuple[int, Any]) -> tuple[str, str]:
        index, sample = entry
        source = sample.get("source") if isinstance(sample, Mapping) else None
        if not isinstance(source, Mapping):
            raise SnapshotError(
                f"sample {index}: missing 'source' mapping; cannot group by dataset and revision"
            )
        return (str(source.get("dataset")), str(source.get("revision")))

    def _at(self, rel: str) -> Any:
        return join_url(self.root, rel) if isinstance(self.root, str) else self.root / rel

    def _read(self, which: int, size: int, offset: int) -> bytes:
        """`size` bytes at `offset` of the index (0) or the sample file (1); fewer where it ends."""
        if self._source is None:
            return os.pread(self._fd(which), size, offset)
        rel = (INDEX, SAMPLES)[which]
        size = max(0, min(size, self._source.size(rel) - offset))
        out = np.empty(size, np.uint8)
        self._source.read_into(rel, offset, out)
        return out.tobytes()

    def _open(self) -> None:
        if self._source is None:
            index_fd = os.open(self.root / INDEX, os.O_RDONLY | os.O_CLOEXEC)
            samples_fd = os.open(self.root / SAMPLES, os.O_RDONLY | os.O_CLOEXEC)
            self._fds = (index_fd, samples_fd)
        header = self._read(0, IDX_HEADER.size, 0)
        if len(header) != IDX_HEADER.size or header[:8] != IDX_MAGIC:
            self.close()
            raise SnapshotError(f"{self._at(INDEX)}: not a sample index (bad header)")
        _, count, group_count = IDX_HEADER.unpack(header)
        expected = IDX_HEADER.size + 8 * (count + 1) + 4 * count
        actual = self._filesize(0)
        if actual != expected:
            self.close()
            raise SnapshotError(f"{self._at(INDEX)}: {actual} bytes, expected {expected} for {count} samples")
        self._count, self._group_count = count, group_count
        end = self.offset(count)
        self._size = self._filesize(1)
        if self._size != end:
            self.close()
            raise SnapshotError(f"{self._at(SAMPLES)}: {self._size} bytes, the index ends at byte {end}")

    def _filesize(self, which: int) -> int:
        if self._source is None:
            return os.fstat(self._fd(which)).st_size
        return self._source.size((INDEX, SAMPLES)[which])

    def _fd(self, which: int) -> int:
        if self._fds is None:
            self._open()
        return self._fds[which]  # type: ignore[index]

    def offset(self, i: int) -> int:
        """Where line `i` of ``samples.jsonl`` starts, as the index says (``i == len(self)``: its end)."""
        return struct.unpack("<Q", self._read(0, 8, IDX_HEADER.size + 8 * i))[0]

    def close(self) -> None:
        """Close the file descriptors (reopened on the next access)."""
        if self._fds is not None:
            for fd in self._fds:
                os.close(fd)
            self._fds = None

    def __enter__(self) -> SubsetReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": None}  # the media shards pickle with their pins

    def __len__(self) -> int:
        return self._count

    @property
    def group_count(self) -> int:
        """Number of distinct `(source.dataset, source.revision)` groups."""
        return self._group_count

    @property
    def manifest(self) -> dict[str, Any]:
        """The parsed manifest (read on first use: it lists every image)."""
        if self._manifest is None:
            self._manifest = read_manifest(self.root)
        return self._manifest

    def groups(self) -> list[int]:
        """Per sample, its group id; ids number groups in order of first appearance (0, 1, ...)."""
        if self._legacy is not None:
            ids: dict[tuple[str, str], int] = {}
            return [ids.setdefault(self._group_key(e), len(ids)) for e in enumerate(self._legacy)]
        start = IDX_HEADER.size + 8 * (self._count + 1)
        raw = self._read(0, 4 * self._count, start)
        values = array.array("I")
        values.frombytes(raw)
        return list(little_endian(values))

    def raw(self, i: int) -> dict[str, Any]:
        """Sample `i` as stored (image paths relative to the subset)."""
        if isinstance(i, bool):
            raise TypeError("sample index must be an integer, got a bool")  # the sequence protocol's error
        i = operator.index(i)  # ints, numpy and torch integer scalars
        if not -self._count <= i < self._count:
            raise IndexError(f"sample index {i} out of range for a subset of {self._count} samples")
        i %= self._count
        if self._legacy is not None:
            return copy.deepcopy(self._legacy[i])
        start, end = struct.unpack("<QQ", self._read(0, 16, IDX_HEADER.size + 8 * i))
        if not start <= end <= self._size:
            raise SnapshotError(
                f"{self._at(INDEX)}: sample {i} spans bytes {start}..{end}, not inside the "
                f"{self._size}-byte {SAMPLES}; the index is damaged (run verify)"
            )
        line = self._read(1, end - start, start)
        try:
            sample = parse_json(line, f"sample {i} (bytes {start}..{end})")
        except ValueError as exc:
            raise SnapshotError(f"{self._at(SAMPLES)}: {exc}") from exc
        if not isinstance(sample, dict):
            raise SnapshotError(f"{self._at(SAMPLES)}: sample {i} is not a JSON object")
        return sample

    @property
    def media(self) -> MediaShards:
        """The media shards of a version-3 subset (opened on first use)."""
        if self._media is None:
            if self._media_record is None:
                raise SnapshotError(f"{self.root}: its images are files, not media shards")
            source = self._source if self._source is not None else LocalFiles(self.root)
            self._media = MediaShards(source, self._media_record, where=str(self.root))
        return self._media

    def image_bytes(self, i: int, rel: str) -> bytes:
        """The bytes of the image file `rel` of sample `i` of a one-file-per-image subset at an URL, checked
        against the manifest's SHA-256 (read once, when first needed)."""
        if self._image_sha is None:
            self._image_sha = {r["path"]: r.get("sha256") for r in self.manifest["images"]}
        if rel not in self._image_sha:
            raise SnapshotError(f"{self.root}: sample {i}: image {rel!r} is not in the manifest")
        data = self._source.read_bytes(rel)  # type: ignore[union-attr]
        if hashlib.sha256(data).hexdigest() != self._image_sha[rel]:
            raise SnapshotError(f"{self._at(rel)}: SHA-256 differs from the manifest (changed?)")
        return data

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        sample = self.raw(i)
        name = label(i % self._count, sample)
        if self.sharded:  # each image decoded from its shard (SHA-256 checked), as transformers loads one
            items = [item for _, item in image_items(sample)]
            first, stop = (int(v) for v in self.media.sample_images()[i % self._count : i % self._count + 2])
            if stop - first != len(items):
                raise SnapshotError(f"{self.root}: {name} has {len(items)} image items; the media index "
                                    f"gives it {stop - first} images")  # fmt: skip
            for k, (item, data) in enumerate(
                zip(items, self.media.read(np.arange(first, stop)), strict=True)
            ):
                item["image"] = decode_rgb(data, where=f"{self.root}: {name} image {k}")
            return sample
        for field, item in image_items(sample):
            if self._source is not None:
                data = self.image_bytes(i % self._count, item.get("image"))
                item["image"] = decode_rgb(data, where=f"{self.root}: {name} {field}")
                continue
            path = inside(self.root, item.get("image"), f"{self.root}: {name} {field}")
            if not path.is_file():
                raise SnapshotError(
                    f"{self.root}: {name} {field}: image file {item.get('image')!r} is missing"
                )
            item["image"] = str(path)
        return sample


def load_materialized_conversation_subset(output_dir: str | Path) -> list[dict[str, Any]]:
    """Load a materialized conversation subset without contacting Hugging Face.

    Returns every sample with absolute image paths, after checking the counts, that each sample's images are
    the manifest's images (in order) and that every image file exists with its recorded size.
    """
    root = Path(output_dir).absolute()
    manifest = read_manifest(root)
    expected = {(r.get("sample_index"), r.get("image_index")): r for r in manifest["images"]}
    samples = []
    with SubsetReader(root) as reader:
        if len(reader) != manifest["sample_count"]:
            raise SnapshotError(
                f"{root}: {len(reader)} samples on disk, the manifest records {manifest['sample_count']}"
            )
        for i in range(len(reader)):
            sample = reader[i]
            for k, (field, item) in enumerate(image_items(sample)):
                record = expected.pop((i, k), None)
                path = None if reader.sharded else str(root / record["path"]) if record else ""
                if record is None or (path is not None and path != item["image"]):
                    raise SnapshotError(
                        f"{root}: {label(i, sample)} {field}: image {item['image']!r:.80} is not the "
                        f"manifest's image {k} of that sample ({record and record['path']!r})"
                    )
            samples.append(sample)
    if expected:
        missing = sorted(expected)[:5]
        raise SnapshotError(f"{root}: the manifest lists images that no sample uses: {missing}")
    return samples


def load_materialized_intersyn_subset(output_dir: str | Path) -> list[dict[str, Any]]:
    """Compatibility wrapper for the original InterSyn loader."""
    return load_materialized_conversation_subset(output_dir)

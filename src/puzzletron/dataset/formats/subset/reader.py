"""Read an offline conversation subset: its manifest (with the completeness check), lazily sample by
sample (`SubsetReader`), or whole (`load_materialized_conversation_subset`).

The format: ``docs/subset-format.md``. The original layout (a ``samples.json`` array, no ``format`` in the
manifest) is read unchanged.
"""

from __future__ import annotations

import array
import contextlib
import copy
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
    MAX_JSON_DEPTH,
    check_file,
    inside,
    load_json,
    parse_json,
)
from puzzletron.dataset.formats.media_shards import MediaShards
from puzzletron.dataset.formats.media_shards import check_record as check_media
from puzzletron.dataset.formats.subset._layout import (
    IDX_HEADER,
    IDX_MAGIC,
    INDEX,
    LEGACY_SAMPLES,
    SAMPLES,
    SUBSET_FORMAT,
    SUBSET_FORMAT_VERSION,
    SUBSET_SHARDED_VERSION,
    image_items,
    is_original_layout,
    is_sharded,
    label,
    little_endian,
)
from puzzletron.dataset.storage.local import LocalFiles

__all__ = [
    "SubsetReader",
    "load_materialized_conversation_subset",
    "load_materialized_intersyn_subset",
    "read_manifest",
    "subset_manifest",
]


def _count(manifest: Mapping[str, Any], key: str, where: Path) -> int:
    value = manifest.get(key)
    if type(value) is not int or value < 0:  # not bool, not "2", not 2.0
        raise SnapshotError(f"{where}: {key!r} is {value!r}; expected a non-negative integer")
    return value


def _image_record(record: Any) -> bool:
    """A manifest image record has integer indices and a string path (what readers key and join on)."""
    return (
        isinstance(record, Mapping)
        and isinstance(record.get("path"), str)
        and all(type(record.get(k)) is int for k in ("sample_index", "image_index"))
    )


def subset_manifest(root: Path, *, counts: bool = True, records: bool = True) -> dict[str, Any]:
    """The manifest at `root`, checked before anything else is read (not for completeness): a JSON object of
    this format and a version this code reads (exactly ``2``; the original layout: ``1``), integer counts,
    ``images`` a list of ``image_count`` records with integer indices and a string path (`counts=False`: of
    any length; `verify_subset` reports a mismatch among its problems), and (version 2) records for the
    sample file and index. `SnapshotError` naming what is wrong otherwise (``docs/trust-model.md``).
    ``records=False`` (`SubsetReader`, which reads no image record) skips checking each image record and
    the nesting of their values: a 100k-image manifest then costs its parse alone."""
    where = root / MANIFEST
    manifest = load_json(where, "the manifest", max_depth=MAX_JSON_DEPTH if records else None)
    if not isinstance(manifest, dict):
        raise SnapshotError(f"{where}: expected a JSON object, got {type(manifest).__name__}")
    fmt = manifest.get("format")
    if fmt is not None and fmt != SUBSET_FORMAT:
        raise SnapshotError(f"{where}: a {fmt!r} manifest, not a conversation subset")
    version = manifest.get("version")
    wanted = (1,) if is_original_layout(manifest) else (SUBSET_FORMAT_VERSION, SUBSET_SHARDED_VERSION)
    if type(version) is not int or version not in wanted:
        raise SnapshotError(
            f"{where}: format version {version!r} is not supported (this code reads "
            f"{SUBSET_FORMAT_VERSION}, {SUBSET_SHARDED_VERSION} with media shards and the original layout, 1)"
        )
    image_count = _count(manifest, "image_count", where)
    _count(manifest, "sample_count", where)
    images = manifest.get("images")
    if not isinstance(images, list):
        raise SnapshotError(f"{where}: 'images' is {images!r}; expected a list of records")
    if counts and len(images) != image_count:
        raise SnapshotError(f"{where}: 'images' does not list image_count={image_count} images")
    for record in images if records else ():
        if not _image_record(record):
            raise SnapshotError(
                f"{where}: image record {record!r} is not {{sample_index, image_index: int, path: str}}"
            )
    if not is_original_layout(manifest):
        for key in ("samples", "index"):
            record = manifest.get(key)
            if not isinstance(record, Mapping) or not isinstance(record.get("path"), str):
                raise SnapshotError(f"{where}: {key!r} is {record!r}; expected a file record with a path")
    if is_sharded(manifest):
        samples = manifest["sample_count"]
        check_media(manifest.get("media"), str(where), images=image_count, samples=samples)
    return manifest


def _check_index_count(index: Path, sample_count: int) -> None:
    """The sample count in the index header must be the manifest's (24 bytes read: cheap enough for reuse)."""
    with open(index, "rb") as fh:
        header = fh.read(IDX_HEADER.size)
    if len(header) != IDX_HEADER.size or header[:8] != IDX_MAGIC:
        raise SnapshotError(f"{index}: not a sample index (bad header)")
    count = IDX_HEADER.unpack(header)[1]
    if count != sample_count:
        raise SnapshotError(f"{index.parent}: {count} samples on disk, the manifest records {sample_count}")


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the complete subset at `path`; `SnapshotError` saying what is missing otherwise.

    Complete means: the manifest passes `subset_manifest`, and the sample file, the index and every image it
    lists exist with their recorded sizes. (Hashes are checked by `verify_subset`, which reads every byte.)
    """
    root = Path(path)
    if not root.is_dir():
        raise SnapshotError(f"{root}: no subset directory there")
    manifest = subset_manifest(root)
    if is_original_layout(manifest):
        if not (root / LEGACY_SAMPLES).is_file():
            raise SnapshotError(f"{root}: {LEGACY_SAMPLES} is missing")
    else:
        check_file(root, manifest["samples"], "sample file")
        _check_index_count(check_file(root, manifest["index"], "sample index"), manifest["sample_count"])
    if is_sharded(manifest):  # the images are named in the shards' index, not files
        for record in manifest["media"]["files"]:
            check_file(root, record, "media file")
        return manifest
    for record in manifest["images"]:
        where = "image"
        if isinstance(record, Mapping):
            where = f"image of sample {record.get('sample_index')} (row {record.get('row_id')!r})"
        check_file(root, record, where)
    return manifest


class SubsetReader(Sequence):
    """Random access to the samples of a subset without parsing the whole sample file.

    `reader[i]` reads one line through the offset index and returns a fresh sample dict whose image items
    hold absolute paths (checked to exist and to stay inside the subset). Original-layout subsets are read
    whole (they are small). Safe to share with forked DataLoader workers (positional reads only).
    """

    def __init__(self, path: str | Path) -> None:
        self.root = Path(path).absolute()
        self._manifest: dict[str, Any] | None = None
        self._legacy: list[dict[str, Any]] | None = None
        self._fds: tuple[int, int] | None = None
        self._media: MediaShards | None = None
        if not (self.root / MANIFEST).is_file():
            raise SnapshotError(f"{self.root}: no {MANIFEST}; not a complete subset")
        # format, version and counts before any sample is served (image records: when one is used)
        header = subset_manifest(self.root, records=False)
        self.sharded = is_sharded(header)
        self._media_record = header.get("media") if self.sharded else None
        if not is_original_layout(header):
            if not ((self.root / INDEX).is_file() and (self.root / SAMPLES).is_file()):
                raise SnapshotError(f"{self.root}: {SAMPLES} or {INDEX} is missing; not a complete subset")
            self._open()
        elif (self.root / LEGACY_SAMPLES).is_file():
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

    def _open(self) -> None:
        index_fd = os.open(self.root / INDEX, os.O_RDONLY | os.O_CLOEXEC)
        samples_fd = os.open(self.root / SAMPLES, os.O_RDONLY | os.O_CLOEXEC)
        self._fds = (index_fd, samples_fd)
        header = os.pread(index_fd, IDX_HEADER.size, 0)
        if len(header) != IDX_HEADER.size or header[:8] != IDX_MAGIC:
            self.close()
            raise SnapshotError(f"{self.root / INDEX}: not a sample index (bad header)")
        _, count, group_count = IDX_HEADER.unpack(header)
        expected = IDX_HEADER.size + 8 * (count + 1) + 4 * count
        actual = os.fstat(index_fd).st_size
        if actual != expected:
            self.close()
            raise SnapshotError(
                f"{self.root / INDEX}: {actual} bytes, expected {expected} for {count} samples"
            )
        self._count, self._group_count = count, group_count
        end = self.offset(count)
        self._size = os.fstat(samples_fd).st_size
        if self._size != end:
            self.close()
            raise SnapshotError(f"{self.root / SAMPLES}: {self._size} bytes, the index ends at byte {end}")

    def _fd(self, which: int) -> int:
        if self._fds is None:
            self._open()
        return self._fds[which]  # type: ignore[index]

    def offset(self, i: int) -> int:
        """Where line `i` of ``samples.jsonl`` starts, as the index says (``i == len(self)``: its end)."""
        return struct.unpack("<Q", os.pread(self._fd(0), 8, IDX_HEADER.size + 8 * i))[0]

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
        raw = os.pread(self._fd(0), 4 * self._count, start)
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
        start, end = struct.unpack("<QQ", os.pread(self._fd(0), 16, IDX_HEADER.size + 8 * i))
        if not start <= end <= self._size:
            raise SnapshotError(
                f"{self.root / INDEX}: sample {i} spans bytes {start}..{end}, not inside the "
                f"{self._size}-byte {SAMPLES}; the index is damaged (run verify)"
            )
        line = os.pread(self._fd(1), end - start, start)
        try:
            sample = parse_json(line, f"sample {i} (bytes {start}..{end})")
        except ValueError as exc:
            raise SnapshotError(f"{self.root / SAMPLES}: {exc}") from exc
        if not isinstance(sample, dict):
            raise SnapshotError(f"{self.root / SAMPLES}: sample {i} is not a JSON object")
        return sample

    @property
    def media(self) -> MediaShards:
        """The media shards of a version-3 subset (opened on first use)."""
        if self._media is None:
            if self._media_record is None:
                raise SnapshotError(f"{self.root}: its images are files, not media shards")
            self._media = MediaShards(LocalFiles(self.root), self._media_record, where=str(self.root))
        return self._media

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

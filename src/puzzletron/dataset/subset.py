"""The on-disk offline conversation subset: materialise (atomically), load, read lazily, verify.

Layout (format version 2, documented in `docs/subset-format.md`)::

    <dir>/manifest.json      counts, sources, one record per image, file sizes and SHA-256s
    <dir>/samples.jsonl      one normalised sample per line (sorted keys), image items hold relative paths
    <dir>/samples.idx        binary: header, N+1 little-endian u64 line offsets, N u32 source-group ids
    <dir>/images/<sample:06d>_<image:02d>.<ext>   the image bytes as they came (or PNG when they had none)

The original layout (`manifest.json`, a `samples.json` array and `images/NNNN_MM.png`) is read unchanged.
Writes go through `_atomic`: a destination either does not exist or holds a complete subset.
"""

from __future__ import annotations

import array
import contextlib
import copy
import hashlib
import json
import logging
import operator
import os
import secrets
import struct
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from puzzletron.dataset._atomic import locked, staging_dir
from puzzletron.dataset._images import encode_image
from puzzletron.dataset.conversation import validate_conversation
from puzzletron.dataset.errors import ConversationError, SubsetError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "SubsetReader",
    "VerifyReport",
    "describe_subset",
    "load_materialized_conversation_subset",
    "load_materialized_intersyn_subset",
    "materialize_normalized_conversation_samples",
    "materialize_normalized_intersyn_samples",
    "read_manifest",
    "verify_subset",
]

logger = logging.getLogger(__name__)

FORMAT = "puzzletron-conversation-subset"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
SAMPLES = "samples.jsonl"
INDEX = "samples.idx"
IMAGES = "images"
LEGACY_SAMPLES = "samples.json"

# samples.idx: magic, sample_count, group_count; then (N+1) u64 offsets; then N u32 group ids.
_IDX_MAGIC = b"PZSUBIX2"
_IDX_HEADER = struct.Struct("<8sQQ")
_CHUNK = 1 << 20


def _dumps_line(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _canonical(value: Any, what: str) -> Any:
    """A JSON round-trip of `value` (tuples become lists, keys sorted), or `SubsetError` naming `what`."""
    if value is None:
        return None
    try:
        return json.loads(_dumps_line(value))
    except (TypeError, ValueError) as exc:
        raise SubsetError(f"{what} must be JSON-serialisable: {exc}") from exc


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _inside(root: Path, rel: Any, what: str) -> Path:
    """Resolve `rel` under `root`; reject absolute paths, `..`, and symlinks that leave `root`."""
    if not isinstance(rel, str) or not rel:
        raise SubsetError(f"{what}: image path {rel!r} must be a non-empty relative path string")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or rel.startswith("\\") or (len(rel) > 1 and rel[1] == ":"):
        raise SubsetError(f"{what}: image path {rel!r} is absolute; expected a path inside {root}")
    if ".." in pure.parts:
        raise SubsetError(f"{what}: image path {rel!r} contains '..'; expected a path inside {root}")
    path = root / pure
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise SubsetError(f"{what}: image path {rel!r} resolves to {real}, outside the subset {root}")
    return path


def _image_items(sample: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The image items of `sample`; parts that are not shaped like a conversation are skipped (a sample
    read from disk may be damaged: `verify_subset` reports that, nothing here may crash on it)."""
    turns = sample.get("conversation") if isinstance(sample, Mapping) else None
    if not isinstance(turns, list):
        return
    for t, turn in enumerate(turns):
        content = turn.get("content") if isinstance(turn, Mapping) else None
        for c, item in enumerate(content if isinstance(content, list) else ()):
            if isinstance(item, dict) and item.get("type") == "image":
                yield f"conversation[{t}].content[{c}].image", item


def _label(index: int, sample: Mapping[str, Any]) -> str:
    source = sample.get("source") if isinstance(sample, Mapping) else None
    if isinstance(source, Mapping):
        return f"sample {index} ({source.get('dataset')} row {source.get('row_id')!r})"
    return f"sample {index}"


# --------------------------------------------------------------------------------------------------- writing


def _store_sample(tmp: Path, index: int, sample: Mapping[str, Any], table: Any) -> tuple[bytes, int]:
    """Write sample `index`'s images under `tmp/images` and their manifest records (one JSON line each) to
    `table`; return the sample's `samples.jsonl` line (image items now hold relative paths) and its image
    count. The caller's sample is not modified."""
    label = _label(index, sample)
    validate_conversation(sample, where=label)
    stored = copy.deepcopy({key: v for key, v in sample.items() if key != "conversation"})
    stored["conversation"], k = [], 0
    for t, turn in enumerate(sample["conversation"]):
        content = []
        for c, item in enumerate(turn["content"]):
            if item.get("type") != "image":
                content.append(copy.deepcopy(dict(item)))
                continue
            encoded = encode_image(
                item["image"], where=f"{label} image {k} (conversation[{t}].content[{c}].image)"
            )
            rel = f"{IMAGES}/{index:06d}_{k:02d}{encoded.extension}"
            with open(tmp / rel, "xb") as fh:
                fh.write(encoded.data)
            record = {
                "bytes": encoded.size,
                "format": encoded.format,
                "height": encoded.height,
                "image_index": k,
                "path": rel,
                "row_id": sample["source"]["row_id"],
                "sample_index": index,
                "sha256": encoded.sha256,
                "width": encoded.width,
            }
            table.write(_dumps_line(_canonical(record, f"{label} source.row_id")) + "\n")
            content.append({**copy.deepcopy({a: b for a, b in item.items() if a != "image"}), "image": rel})
            k += 1
        rest = copy.deepcopy({a: b for a, b in turn.items() if a != "content"})
        stored["conversation"].append({**rest, "content": content})
    try:
        return (_dumps_line(stored) + "\n").encode("utf-8"), k
    except (TypeError, ValueError) as exc:
        raise SubsetError(f"{label}: not JSON-serialisable apart from its images: {exc}") from exc


def _write_subset(
    tmp: Path,
    samples: Iterable[Mapping[str, Any]],
    *,
    acquisition: Any,
    diagnostics: Mapping[str, Any] | None,
    expected_count: int | None,
    output_dir: Path,
) -> dict[str, Any]:
    """Stream `samples` into the transaction directory `tmp`; return the manifest written there.

    One sample at a time: its images go to `images/`, its line to `samples.jsonl`, its image records to a
    temporary table (spliced into the manifest at the end), its line offset and source group to arrays that
    become `samples.idx`. Memory is O(samples) for the two arrays (12 bytes a sample), never the samples.
    """
    (tmp / IMAGES).mkdir()
    offsets = array.array("Q", [0])
    group_ids: dict[tuple[str, str], int] = {}
    groups = array.array("I")
    image_count = 0
    samples_digest = hashlib.sha256()
    image_table = tmp / f".images-{secrets.token_hex(4)}.jsonl"
    with open(tmp / SAMPLES, "xb") as out, open(image_table, "x", encoding="utf-8") as table:
        for index, sample in enumerate(samples):
            line, images = _store_sample(tmp, index, sample, table)
            out.write(line)
            samples_digest.update(line)
            offsets.append(offsets[-1] + len(line))
            key = (sample["source"]["dataset"], sample["source"]["revision"])
            groups.append(group_ids.setdefault(key, len(group_ids)))
            image_count += images
    sample_count = len(groups)
    if expected_count is not None and sample_count < expected_count:
        raise SubsetError(
            f"{output_dir}: the samples ran out after {sample_count} of the expected {expected_count}; "
            "nothing was published"
        )
    # Read only now: the caller's generator fills `diagnostics` while we stream.
    diagnostics = _canonical(diagnostics, "diagnostics")
    with open(tmp / INDEX, "xb") as fh:
        fh.write(_IDX_HEADER.pack(_IDX_MAGIC, sample_count, len(group_ids)))
        fh.write(_le(offsets).tobytes())
        fh.write(_le(groups).tobytes())
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "sample_count": sample_count,
        "image_count": image_count,
        "sources": [{"dataset": d, "revision": r} for d, r in sorted(group_ids)],
        "samples": {"path": SAMPLES, "bytes": offsets[-1], "sha256": samples_digest.hexdigest()},
        "index": {"path": INDEX, "bytes": (tmp / INDEX).stat().st_size, "sha256": _sha256_file(tmp / INDEX)},
    }
    if acquisition is not None:
        manifest["acquisition"] = acquisition
    if diagnostics is not None:
        manifest["diagnostics"] = diagnostics
    placeholder = f"@images-{secrets.token_hex(16)}@"
    text = json.dumps({**manifest, "images": placeholder}, sort_keys=True, indent=2, ensure_ascii=False)
    head, tail = text.split(json.dumps(placeholder))
    with open(tmp / MANIFEST, "x", encoding="utf-8") as fh, open(image_table, encoding="utf-8") as table:
        fh.write(head)
        first = True
        for line in table:
            fh.write(("[\n    " if first else ",\n    ") + line.rstrip("\n"))
            first = False
        fh.write("[]" if first else "\n  ]")
        fh.write(tail + "\n")
    image_table.unlink()
    return manifest


def _le(values: array.array) -> array.array:
    if sys.byteorder == "big":
        values = array.array(values.typecode, values)
        values.byteswap()
    return values


def materialize_normalized_conversation_samples(
    samples: Iterable[Mapping[str, Any]],
    output_dir: str | Path,
    *,
    acquisition: Mapping[str, Any] | None = None,
    diagnostics: Mapping[str, Any] | None = None,
    expected_count: int | None = None,
) -> dict[str, Any]:
    """Stream normalized conversations into an atomically published offline subset.

    Returns the manifest. `output_dir` ends up absent or complete: a failure (bad sample, shortfall against
    `expected_count`, a kill) publishes nothing. A complete subset already there is reused (its manifest is
    returned) unless `acquisition` is given and differs; a non-empty directory holding no complete subset is
    an error. Concurrent callers serialise on a lock: one writes, the others reuse.
    """
    if expected_count is not None and (
        isinstance(expected_count, bool) or not isinstance(expected_count, int) or expected_count < 1
    ):
        raise SubsetError(f"expected_count must be a positive integer or None, got {expected_count!r}")
    destination = Path(os.path.abspath(output_dir))  # "." is replaced by the rename: read it back by name
    wanted = _canonical(acquisition, "acquisition")
    with locked(destination):
        if destination.exists() and not (destination.is_dir() and not any(destination.iterdir())):
            try:
                manifest = read_manifest(destination)
            except SubsetError as exc:
                raise SubsetError(f"{destination} is not empty and holds no complete subset: {exc}") from exc
            if wanted is not None and manifest.get("acquisition") != wanted:
                raise SubsetError(
                    f"{destination} holds a subset whose acquisition {manifest.get('acquisition')!r} "
                    f"does not match the requested acquisition {wanted!r}; "
                    "choose another output_dir or remove it"
                )
            if expected_count is not None and manifest["sample_count"] < expected_count:
                raise SubsetError(
                    f"{destination} holds {manifest['sample_count']} samples, fewer than the expected "
                    f"{expected_count}"
                )
            logger.info("reusing the complete subset at %s", destination)
            return manifest
        with staging_dir(destination) as tmp:
            _write_subset(
                tmp,
                samples,
                acquisition=wanted,
                diagnostics=diagnostics,
                expected_count=expected_count,
                output_dir=destination,
            )
        logger.info("published subset at %s", destination)
        return read_manifest(destination)


def materialize_normalized_intersyn_samples(
    samples: Sequence[Mapping[str, Any]], output_dir: str | Path
) -> dict[str, Any]:
    """Compatibility wrapper for the original InterSyn materializer."""
    return materialize_normalized_conversation_samples(samples, output_dir)


# --------------------------------------------------------------------------------------------------- reading


def _load_json(path: Path, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError as exc:
        raise SubsetError(f"{path}: {what} is missing") from exc
    except (OSError, ValueError) as exc:
        raise SubsetError(f"{path}: {what} is unreadable or not valid JSON: {exc}") from exc


def _is_legacy(manifest: Mapping[str, Any]) -> bool:
    return manifest.get("format") != FORMAT


def _check_file(root: Path, record: Any, what: str) -> Path:
    if not isinstance(record, Mapping):
        raise SubsetError(f"{root}: manifest entry for {what} is {record!r}; expected a mapping with a path")
    path = _inside(root, record.get("path"), f"{root}: {what}")
    if not path.is_file():
        raise SubsetError(f"{root}: {what} {record.get('path')!r} is missing")
    size = record.get("bytes")
    if size is not None and path.stat().st_size != size:
        raise SubsetError(
            f"{root}: {what} {record.get('path')!r} has {path.stat().st_size} bytes, "
            f"the manifest records {size} (truncated or replaced)"
        )
    return path


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the complete subset at `path`; `SubsetError` saying what is missing otherwise.

    Complete means: the manifest parses, and the sample file, the index and every image it lists exist with
    their recorded sizes. (Hashes are checked by `verify_subset`, which reads every byte.)
    """
    root = Path(path)
    if not root.is_dir():
        raise SubsetError(f"{root}: no subset directory there")
    manifest = _load_json(root / MANIFEST, "the manifest")
    if not isinstance(manifest, dict):
        raise SubsetError(f"{root / MANIFEST}: expected a JSON object, got {type(manifest).__name__}")
    for key in ("sample_count", "image_count", "images"):
        if key not in manifest:
            raise SubsetError(f"{root / MANIFEST}: missing field {key!r}")
    if _is_legacy(manifest):
        if not (root / LEGACY_SAMPLES).is_file():
            raise SubsetError(f"{root}: {LEGACY_SAMPLES} is missing")
    else:
        if manifest.get("version") != FORMAT_VERSION:
            raise SubsetError(
                f"{root / MANIFEST}: format version {manifest.get('version')!r} is not supported "
                f"(this code reads {FORMAT_VERSION} and the original layout)"
            )
        _check_file(root, manifest.get("samples"), "sample file")
        _check_file(root, manifest.get("index"), "sample index")
    if not isinstance(manifest["images"], list) or len(manifest["images"]) != manifest["image_count"]:
        raise SubsetError(
            f"{root / MANIFEST}: 'images' does not list image_count={manifest['image_count']} images"
        )
    for record in manifest["images"]:
        where = "image"
        if isinstance(record, Mapping):
            where = f"image of sample {record.get('sample_index')} (row {record.get('row_id')!r})"
        _check_file(root, record, where)
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
        if not (self.root / MANIFEST).is_file():
            raise SubsetError(f"{self.root}: no {MANIFEST}; not a complete subset")
        if (self.root / INDEX).is_file() and (self.root / SAMPLES).is_file():
            self._open()
        elif (self.root / LEGACY_SAMPLES).is_file():
            samples = _load_json(self.root / LEGACY_SAMPLES, "the sample list")
            if not isinstance(samples, list):
                raise SubsetError(f"{self.root / LEGACY_SAMPLES}: expected a JSON array of samples")
            self._legacy = samples
            self._count = len(samples)
            self._group_count = len(set(map(self._group_key, enumerate(samples))))
        else:
            raise SubsetError(f"{self.root}: neither {SAMPLES} + {INDEX} nor {LEGACY_SAMPLES}; not a subset")

    @staticmethod
    def _group_key(entry: tuple[int, Any]) -> tuple[str, str]:
        index, sample = entry
        source = sample.get("source") if isinstance(sample, Mapping) else None
        if not isinstance(source, Mapping):
            raise SubsetError(
                f"sample {index}: missing 'source' mapping; cannot group by dataset and revision"
            )
        return (str(source.get("dataset")), str(source.get("revision")))

    def _open(self) -> None:
        index_fd = os.open(self.root / INDEX, os.O_RDONLY | os.O_CLOEXEC)
        samples_fd = os.open(self.root / SAMPLES, os.O_RDONLY | os.O_CLOEXEC)
        self._fds = (index_fd, samples_fd)
        header = os.pread(index_fd, _IDX_HEADER.size, 0)
        if len(header) != _IDX_HEADER.size or header[:8] != _IDX_MAGIC:
            self.close()
            raise SubsetError(f"{self.root / INDEX}: not a sample index (bad header)")
        _, count, group_count = _IDX_HEADER.unpack(header)
        expected = _IDX_HEADER.size + 8 * (count + 1) + 4 * count
        actual = os.fstat(index_fd).st_size
        if actual != expected:
            self.close()
            raise SubsetError(f"{self.root / INDEX}: {actual} bytes, expected {expected} for {count} samples")
        self._count, self._group_count = count, group_count
        end = self._offset(count)
        if os.fstat(samples_fd).st_size != end:
            size = os.fstat(samples_fd).st_size
            self.close()
            raise SubsetError(f"{self.root / SAMPLES}: {size} bytes, the index ends at byte {end}")

    def _fd(self, which: int) -> int:
        if self._fds is None:
            self._open()
        return self._fds[which]

    def _offset(self, i: int) -> int:
        return struct.unpack("<Q", os.pread(self._fd(0), 8, _IDX_HEADER.size + 8 * i))[0]

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
        return {**self.__dict__, "_fds": None}

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
        start = _IDX_HEADER.size + 8 * (self._count + 1)
        raw = os.pread(self._fd(0), 4 * self._count, start)
        values = array.array("I")
        values.frombytes(raw)
        return list(_le(values))

    def raw(self, i: int) -> dict[str, Any]:
        """Sample `i` as stored (image paths relative to the subset)."""
        if isinstance(i, bool):
            raise TypeError("sample index must be an integer, got a bool")
        i = operator.index(i)  # ints, numpy and torch integer scalars
        if not -self._count <= i < self._count:
            raise IndexError(f"sample index {i} out of range for a subset of {self._count} samples")
        i %= self._count
        if self._legacy is not None:
            return copy.deepcopy(self._legacy[i])
        start, end = struct.unpack("<QQ", os.pread(self._fd(0), 16, _IDX_HEADER.size + 8 * i))
        line = os.pread(self._fd(1), end - start, start)
        try:
            sample = json.loads(line)
        except ValueError as exc:
            raise SubsetError(
                f"{self.root / SAMPLES}: sample {i} (bytes {start}..{end}) is not JSON: {exc}"
            ) from exc
        if not isinstance(sample, dict):
            raise SubsetError(f"{self.root / SAMPLES}: sample {i} is not a JSON object")
        return sample

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        sample = self.raw(i)
        label = _label(i % self._count, sample)
        for field, item in _image_items(sample):
            path = _inside(self.root, item.get("image"), f"{self.root}: {label} {field}")
            if not path.is_file():
                raise SubsetError(
                    f"{self.root}: {label} {field}: image file {item.get('image')!r} is missing"
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
    expected = {(r["sample_index"], r["image_index"]): r for r in manifest["images"]}
    samples = []
    with SubsetReader(root) as reader:
        if len(reader) != manifest["sample_count"]:
            raise SubsetError(
                f"{root}: {len(reader)} samples on disk, the manifest records {manifest['sample_count']}"
            )
        for i in range(len(reader)):
            sample = reader[i]
            for k, (field, item) in enumerate(_image_items(sample)):
                record = expected.pop((i, k), None)
                if record is None or str(root / record["path"]) != item["image"]:
                    raise SubsetError(
                        f"{root}: {_label(i, sample)} {field}: image {item['image']!r} is not the manifest's "
                        f"image {k} of that sample ({record and record['path']!r})"
                    )
            samples.append(sample)
    if expected:
        missing = sorted(expected)[:5]
        raise SubsetError(f"{root}: the manifest lists images that no sample uses: {missing}")
    return samples


def load_materialized_intersyn_subset(output_dir: str | Path) -> list[dict[str, Any]]:
    """Compatibility wrapper for the original InterSyn loader."""
    return load_materialized_conversation_subset(output_dir)


# --------------------------------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class VerifyReport:
    """What `verify_subset` found: `ok` only when every count, size and SHA-256 matches the manifest."""

    path: str
    sample_count: int
    image_count: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def _verify_file(root: Path, record: Any, what: str, problems: list[str]) -> None:
    try:
        path = _check_file(root, record, what)
    except SubsetError as exc:
        problems.append(str(exc))
        return
    if record.get("sha256") is not None and _sha256_file(path) != record["sha256"]:
        problems.append(f"{root}: {what} {record['path']!r}: SHA-256 differs from the manifest")


def _iter_lines(root: Path, manifest: Mapping[str, Any], problems: list[str]) -> Iterator[tuple[int, Any]]:
    if _is_legacy(manifest):
        samples = _load_json(root / LEGACY_SAMPLES, "the sample list")
        if not isinstance(samples, list):
            problems.append(f"{root / LEGACY_SAMPLES}: expected a JSON array")
            return
        yield from enumerate(samples)
        return
    try:
        reader = SubsetReader(root)
    except SubsetError as exc:
        problems.append(str(exc))
        reader = None
    offset = 0
    if not (root / SAMPLES).is_file():
        return
    with open(root / SAMPLES, "rb") as fh:
        for i, line in enumerate(fh):
            if reader is not None and i < len(reader) and reader._offset(i) != offset:
                problems.append(f"{root / INDEX}: offset of sample {i} is wrong")
            offset += len(line)
            try:
                yield i, json.loads(line)
            except ValueError:
                problems.append(f"{root / SAMPLES}: line {i + 1} is not JSON")
                yield i, None
    if reader is not None:
        reader.close()


def verify_subset(path: str | Path) -> VerifyReport:
    """Check every count, size and SHA-256 of the subset at `path` against its manifest.

    Reads every byte; reports every mismatch (not just the first) in `VerifyReport.problems`.
    """
    root = Path(path).absolute()
    problems: list[str] = []
    try:
        manifest = _load_json(root / MANIFEST, "the manifest")
    except SubsetError as exc:
        return VerifyReport(str(root), 0, 0, (str(exc),))
    if not isinstance(manifest, dict) or "images" not in manifest:
        return VerifyReport(str(root), 0, 0, (f"{root / MANIFEST}: not a subset manifest",))
    if not _is_legacy(manifest):
        for key, what in (("samples", "sample file"), ("index", "sample index")):
            _verify_file(root, manifest.get(key), what, problems)
    if not isinstance(manifest["images"], list):
        problems.append(f"{root / MANIFEST}: 'images' is {manifest['images']!r}; expected a list of records")
    records = {}
    for r in manifest["images"] if isinstance(manifest["images"], list) else ():
        if isinstance(r, Mapping):
            records[(r.get("sample_index"), r.get("image_index"))] = r
    if len(records) != manifest.get("image_count"):
        problems.append(
            f"{root / MANIFEST}: lists {len(records)} images, image_count says {manifest.get('image_count')}"
        )
    seen_sources, sample_count, image_count, used = set(), 0, 0, set()
    try:
        lines = list(_iter_lines(root, manifest, problems)) if _is_legacy(manifest) else None
    except SubsetError as exc:
        problems.append(str(exc))
        lines = []
    for i, sample in lines if lines is not None else _iter_lines(root, manifest, problems):
        sample_count += 1
        if sample is None:
            continue
        label = _label(i, sample)
        if not isinstance(sample, dict):
            problems.append(f"{root}: {label} is {type(sample).__name__}, not a JSON object")
            continue
        items = list(_image_items(sample))
        if not _is_legacy(manifest):  # every sample we write passed this check (images as paths)
            try:
                validate_conversation(sample, where=f"{root}: {label}")
            except ConversationError as exc:
                problems.append(str(exc))
        elif sample.get("image_count") != len(items):
            problems.append(
                f"{root}: {label}: image_count {sample.get('image_count')!r} but {len(items)} images"
            )
        source = sample.get("source")
        if isinstance(source, Mapping):
            seen_sources.add((source.get("dataset"), source.get("revision")))
        for k, (field, item) in enumerate(items):
            image_count += 1
            try:
                _inside(root, item.get("image"), f"{root}: {label} {field}")
            except SubsetError as exc:
                problems.append(str(exc))
                continue
            record = records.get((i, k))
            if record is None or record.get("path") != item.get("image"):
                problems.append(f"{root}: {label} {field}: {item.get('image')!r} is not in the manifest")
                continue
            used.add((i, k))
    if sample_count != manifest.get("sample_count"):
        problems.append(
            f"{root}: {sample_count} samples on disk, the manifest records {manifest.get('sample_count')}"
        )
    if image_count != manifest.get("image_count"):
        problems.append(
            f"{root}: {image_count} image items in the samples, "
            f"the manifest records {manifest.get('image_count')}"
        )
    sources = sorted(seen_sources, key=lambda s: (str(s[0]), str(s[1])))
    listed = [
        (s.get("dataset"), s.get("revision")) for s in manifest.get("sources") or () if isinstance(s, Mapping)
    ]
    if listed != sources:
        problems.append(f"{root / MANIFEST}: sources {listed} differ from the samples' sources {sources}")

    def order(kv: tuple[Any, Any]) -> tuple[int, int]:
        return tuple(x if isinstance(x, int) else -1 for x in kv[0])

    for key, record in sorted(records.items(), key=order):
        if key not in used:
            problems.append(f"{root / MANIFEST}: image {record.get('path')!r} is used by no sample")
        _verify_file(root, record, f"image of sample {key[0]} (row {record.get('row_id')!r})", problems)
    listed_paths = {r.get("path") for r in records.values()}
    if (root / IMAGES).is_dir():
        for file in sorted((root / IMAGES).iterdir()):
            if f"{IMAGES}/{file.name}" not in listed_paths:
                problems.append(f"{root}: unexpected file {IMAGES}/{file.name} not in the manifest")
    return VerifyReport(str(root), sample_count, image_count, tuple(problems))


def describe_subset(path: str | Path) -> dict[str, Any]:
    """A summary of a complete subset: counts, sources, image formats and sizes, bytes on disk."""
    root = Path(path).absolute()
    manifest = read_manifest(root)
    images = manifest["images"]
    widths = [r.get("width") for r in images if isinstance(r.get("width"), int)]
    heights = [r.get("height") for r in images if isinstance(r.get("height"), int)]
    disk = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())
    formats = Counter(r.get("format") or Path(r["path"]).suffix.lstrip(".").upper() for r in images)
    return {
        "path": str(root),
        "format_version": manifest.get("version") if not _is_legacy(manifest) else "original",
        "sample_count": manifest["sample_count"],
        "image_count": manifest["image_count"],
        "sources": manifest.get("sources", []),
        "image_formats": dict(sorted(formats.items())),
        "image_width": {"min": min(widths), "max": max(widths)} if widths else None,
        "image_height": {"min": min(heights), "max": max(heights)} if heights else None,
        "image_bytes": sum(r.get("bytes") or (root / r["path"]).stat().st_size for r in images),
        "bytes_on_disk": disk,
        "acquisition": manifest.get("acquisition"),
    }

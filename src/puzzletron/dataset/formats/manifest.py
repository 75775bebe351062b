"""What every on-disk format shares: the manifest file, hashing, manifest reading, file records, the
path-inside-root check, the reuse comparison and the report `verify` returns.

A snapshot is a directory with a JSON ``manifest.json`` that lists its files with their sizes and SHA-256s.
Reuse checks sizes (cheap); verify reads every byte. The formats: ``docs/subset-format.md`` and
``docs/text-snapshot-format.md``.

Every JSON file a format reads goes through one bounded reader (``docs/trust-model.md``): `read_regular`
opens without blocking and reads only a regular file (a FIFO, a device or a folder named
``manifest.json`` is refused, never waited on), of at most a bound of bytes (`MAX_JSON_BYTES`, 1 GiB: a
subset's manifest lists every image; `MAX_MANIFEST_BYTES`, 64 MiB: a store's manifest, which grows with
its shards only, and what a store lookup reads); `read_bounded` holds a `ByteSource` (an URL) to the same
bound from its listed size before a byte is fetched; `parse_json` bounds the nesting (64 levels) and
refuses what is not UTF-8 text. Each refusal is one `SnapshotError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.storage.local import hash_file

__all__ = [
    "MANIFEST",
    "VerifyReport",
    "acquisition_mismatch",
    "bytes_on_disk",
    "canonical_sha256",
    "check_block_checksums",
    "check_file",
    "check_file_records",
    "check_store_header",
    "check_store_records",
    "differing_keys",
    "human_size",
    "inside",
    "load_json",
    "load_source_json",
    "parse_json",
    "read_bounded",
    "read_regular",
    "require_same_acquisition",
    "sha256_file",
    "verify_file",
]

MANIFEST = "manifest.json"
MAX_JSON_DEPTH = 64  # deeper than anything we write or read from a source (a Nemotron row is ~6 levels)
MAX_JSON_BYTES = 1 << 30  # any JSON file a format reads (a subset's manifest: ~200 bytes an image)
MAX_MANIFEST_BYTES = 64 << 20  # a store's manifest (~130 bytes a shard file) and what a lookup reads


@dataclass(frozen=True)
class VerifyReport:
    """What a verifier found: `ok` only when every count, size and SHA-256 matches the manifest.

    `format` names the format verified (``""`` when no manifest said); for a text snapshot
    `sample_count` counts rows and `image_count` is 0.
    """

    path: str
    sample_count: int
    image_count: int
    problems: tuple[str, ...]
    format: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of the file at `path`."""
    return hash_file(path, hashlib.sha256())


def canonical_sha256(value: Any) -> str:
    """The hex SHA-256 of `value` as sorted, compact JSON (how an identity is named).

    >>> canonical_sha256({"b": 1, "a": [2]}) == canonical_sha256({"a": [2], "b": 1})
    True
    """
    blob = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def _too_deep(value: Any, limit: int) -> bool:
    """Whether `value` nests lists/objects more than `limit` levels (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _lone_surrogate(value: Any) -> str | None:
    """The first string (key or value) of a parsed JSON value that holds a lone surrogate, or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        texts = list(item) if isinstance(item, dict) else [item] if isinstance(item, str) else []
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                return text[exc.start : exc.end]
        stack.extend(item.values() if isinstance(item, dict) else item if isinstance(item, list) else ())
    return None


_SURROGATE_ESCAPE = re.compile(r"\\[uU][dD][89a-fA-F][0-9a-fA-F]{2}")


def parse_json(data: bytes | str, what: str, *, max_depth: int | None = MAX_JSON_DEPTH) -> Any:
    """The JSON value of `data` (UTF-8 when bytes); `ValueError` saying what is wrong with it: not UTF-8, not
    JSON, a string holding a lone surrogate (``"\\ud800"``: JSON allows the escape, but it is no text and
    nothing can write it back), or nested more than `max_depth` levels (the parser would otherwise hit
    `RecursionError`; with ``max_depth=None`` only that is refused: for a caller that walks no nested value).

    >>> parse_json(b'{"a": [1]}', "x")
    {'a': [1]}
    >>> parse_json("[" * 100 + "]" * 100, "line 3")
    Traceback (most recent call last):
    ValueError: line 3 nests JSON more than 64 levels deep
    """
    if isinstance(data, bytes | bytearray):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{what} is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(data)
    except RecursionError:
        value, deep = None, True
    except ValueError as exc:
        raise ValueError(f"{what} is not JSON: {exc}") from None
    else:
        deep = max_depth is not None and _too_deep(value, max_depth)
    if deep:
        limit = MAX_JSON_DEPTH if max_depth is None else max_depth  # a RecursionError is far past either
        raise ValueError(f"{what} nests JSON more than {limit} levels deep")
    if _SURROGATE_ESCAPE.search(data):  # only then can a decoded string hold a lone surrogate
        lone = _lone_surrogate(value)
        if lone is not None:
            raise ValueError(f"{what} holds {lone!r}, a lone surrogate escape, which is not text")
    return value


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):  # fmt: skip
        if test(mode):
            return name
    return "special file"


def _too_big(where: Any, what: str, size: int, max_bytes: int) -> SnapshotError:
    return SnapshotError(
        f"{where}: {what} is {human_size(size)} ({size} bytes); at most {human_size(max_bytes)} are read"
    )


def read_regular(path: Path, what: str, *, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes`; `SnapshotError` saying `what` is missing,
    unreadable, not a regular file (opened with ``O_NONBLOCK`` and checked with ``fstat`` before a byte is
    read: a FIFO never blocks the caller, a device is never read) or larger than the bound."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise SnapshotError(f"{path}: {what} is missing") from exc
    except OSError as exc:
        raise SnapshotError(f"{path}: {what} is unreadable: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SnapshotError(f"{path}: {what} is a {_kind(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise _too_big(path, what, st.st_size, max_bytes)
        with open(fd, "rb", closefd=False) as fh:
            data = fh.read(max_bytes + 1)  # the file may have grown since fstat
    except OSError as exc:
        raise SnapshotError(f"{path}: {what} is unreadable: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise _too_big(path, what, len(data), max_bytes)
    return data


def read_bounded(source: Any, rel: str, what: str, *, max_bytes: int = MAX_MANIFEST_BYTES) -> bytes:
    """The file `rel` of the `ByteSource` `source` (an URL's objects), refused from its listed size before
    a byte is fetched when it is larger than `max_bytes` (`SnapshotError` naming it)."""
    size = source.size(rel)
    if size > max_bytes:
        raise _too_big(f"{source.root}/{rel}", what, size, max_bytes)
    return source.read_bytes(rel)


def load_json(
    path: Path, what: str, *, max_depth: int | None = MAX_JSON_DEPTH, max_bytes: int = MAX_JSON_BYTES
) -> Any:
    """The JSON value in the file `path`; `SnapshotError` saying `what` is missing or unreadable (not a
    regular file, over `max_bytes`: `read_regular`; not UTF-8, not JSON, nested too deep: `parse_json`)."""
    data = read_regular(path, what, max_bytes=max_bytes)
    try:
        return parse_json(data, what, max_depth=max_depth)
    except ValueError as exc:
        raise SnapshotError(f"{path}: {exc}") from exc


def load_source_json(
    source: Any, rel: str, where: Any, what: str = "the manifest", *, max_depth: int | None = MAX_JSON_DEPTH
) -> Any:
    """The JSON value of file `rel` read through the `storage.sources.ByteSource` `source` (a folder or an
    URL prefix), named `where` in errors; `SnapshotError` when it is missing or not JSON (`parse_json`)."""
    try:
        raw = source.read_bytes(rel)
    except (SnapshotError, OSError) as exc:
        raise SnapshotError(f"{where}: {what} is missing or unreadable ({exc})") from None
    try:
        return parse_json(raw, what, max_depth=max_depth)
    except ValueError as exc:
        raise SnapshotError(f"{where}: {exc}") from None


def inside(root: Path, rel: Any, what: str, *, noun: str = "image path", within: str = "the subset") -> Path:
    """Resolve the relative POSIX path `rel` under `root`; reject absolute paths, ``..`` and symlinks that
    leave `root` (`SnapshotError` starting with `what`).

    >>> inside(Path("/data/s"), "images/0.png", "s").as_posix()
    '/data/s/images/0.png'
    >>> inside(Path("/data/s"), "/x.png", "s")
    Traceback (most recent call last):
    puzzletron.dataset.errors.SnapshotError: s: image path '/x.png' is absolute; expected a path inside ...
    """
    if not isinstance(rel, str) or not rel:
        raise SnapshotError(f"{what}: {noun} {rel!r} must be a non-empty relative path string")
    if "\x00" in rel:
        raise SnapshotError(f"{what}: {noun} {rel!r} contains a NUL byte")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or rel.startswith("\\") or (len(rel) > 1 and rel[1] == ":"):
        raise SnapshotError(f"{what}: {noun} {rel!r} is absolute; expected a path inside {root}")
    if ".." in pure.parts:
        raise SnapshotError(f"{what}: {noun} {rel!r} contains '..'; expected a path inside {root}")
    path = root / pure
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise SnapshotError(f"{what}: {noun} {rel!r} resolves to {real}, outside {within} {root}")
    return path


def _named(root: Path, what: str, rel: Any) -> str:
    return f"{root}: {what} {rel!r}" if what else f"{root}: {rel}"


def check_file(root: Path, record: Any, what: str = "", *, within: str = "the subset") -> Path:
    """The local path of one manifest file record ``{path, bytes?, sha256?}``, checked to stay inside
    `root`, to exist and to have the recorded size (cheap: what reuse checks); `SnapshotError` otherwise.
    `what` says what the file is (``"sample file"``); empty names the file by its path alone."""
    if not isinstance(record, Mapping):
        raise SnapshotError(
            f"{root}: manifest entry for {what or 'a file'} is {record!r}; expected a mapping with a path"
        )
    rel = record.get("path")
    path = inside(root, rel, f"{root}: {what or 'file'}", noun="path", within=within)
    if not path.is_file():
        raise SnapshotError(f"{_named(root, what, rel)} is missing")
    size, recorded = path.stat().st_size, record.get("bytes")
    if recorded is not None and size != recorded:
        raise SnapshotError(
            f"{_named(root, what, rel)} has {size} bytes, the manifest records {recorded} "
            "(truncated or replaced)"
        )
    return path


def verify_file(
    root: Path, record: Any, problems: list[str], what: str = "", *, within: str = "the subset"
) -> None:
    """`check_file`, then the SHA-256 when the record has one; each problem is appended to `problems`."""
    try:
        path = check_file(root, record, what, within=within)
    except SnapshotError as exc:
        problems.append(str(exc))
        return
    if record.get("sha256") is not None and sha256_file(path) != record["sha256"]:
        problems.append(f"{_named(root, what, record['path'])}: SHA-256 differs from the manifest")


def differing_keys(recorded: Any, wanted: Any, *, ignore: Collection[str] = ()) -> list[str]:
    """The sorted keys (but `ignore`) whose values differ between two acquisition mappings.

    >>> differing_keys({"seed": 1, "revision": "a"}, {"seed": 2, "revision": "b"}, ignore=("revision",))
    ['seed']
    """
    recorded = recorded if isinstance(recorded, Mapping) else {}
    wanted = wanted if isinstance(wanted, Mapping) else {}
    keys = set(recorded) | set(wanted)
    return sorted(k for k in keys if k not in ignore and recorded.get(k) != wanted.get(k))


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, Mapping) else None


def acquisition_mismatch(
    where: Path | str, recorded: Any, wanted: Any, keys: Collection[str]
) -> SnapshotError:
    """The error for a snapshot at `where` recorded with another acquisition than the one requested."""
    if keys:
        detail = ", ".join(
            f"{k}: existing {_get(recorded, k)!r} vs requested {_get(wanted, k)!r}" for k in keys
        )
    else:
        detail = f"existing {recorded!r} vs requested {wanted!r}"
    return SnapshotError(
        f"{where}: the existing snapshot does not match requested acquisition ({detail}); "
        "choose another output directory or delete this one"
    )


def require_same_acquisition(where: Path | str, recorded: Any, wanted: Any) -> None:
    """Raise `acquisition_mismatch` unless the recorded acquisition equals the requested one."""
    if recorded != wanted:
        raise acquisition_mismatch(where, recorded, wanted, differing_keys(recorded, wanted))


def bytes_on_disk(root: Path) -> int:
    """The size of every regular file under `root` (symlinks not followed)."""
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())


def human_size(size: int) -> str:
    """A byte count for people.

    >>> human_size(512), human_size(1536), human_size(5 * 2**40)
    ('512 B', '1.5 KiB', '5120.0 GiB')
    """
    value, unit = float(size), "B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            break
        value /= 1024
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"


_HEX_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_BYTES = 2**62


def check_store_header(manifest: Any, where: Path | str, *, fmt: str, version: int, what: str) -> None:
    """A sharded store's manifest is a JSON object of format `fmt` at `version` (`what` names the format
    in errors: "token store"); `SnapshotError` naming `where` otherwise (for another version: what to do)."""
    if not isinstance(manifest, dict):
        raise SnapshotError(f"{where}: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != fmt:
        raise SnapshotError(f"{where}: a {manifest.get('format')!r} manifest, not a {what}")
    if type(manifest.get("version")) is not int or manifest["version"] != version:
        raise SnapshotError(
            f"{where}: {what} version {manifest.get('version')!r} is not supported (this code reads "
            f"{version}; build the store again with `puzzletron-data tokenize`)"
        )


def check_block_checksums(value: Any, where: Path | str) -> None:
    """A manifest's ``block_checksums`` names this code's algorithm and block size (`formats.blocks`);
    `SnapshotError` naming `where` otherwise."""
    if value != {"algorithm": _blocks.ALGORITHM, "block_size": _blocks.BLOCK_SIZE}:
        raise SnapshotError(f"{where}: block_checksums is {value!r:.80}; this code reads "
                            f"{_blocks.ALGORITHM} blocks of {_blocks.BLOCK_SIZE} bytes")  # fmt: skip


def check_file_records(files: Any, where: Path | str) -> None:
    """``files`` is a list of ``{path, bytes, sha256}`` records (a string path, a byte count, a hex
    SHA-256); `SnapshotError` naming `where` otherwise."""
    if not isinstance(files, list) or not all(
        isinstance(r, Mapping)
        and set(r) == {"path", "bytes", "sha256"}
        and isinstance(r["path"], str)
        and type(r["bytes"]) is int
        and 0 <= r["bytes"] <= _MAX_BYTES
        and isinstance(r["sha256"], str)
        and _HEX_SHA256.fullmatch(r["sha256"])
        for r in files
    ):
        raise SnapshotError(f"{where}: 'files' is not a list of {{path, bytes, sha256}} records")


def check_store_records(manifest: Mapping[str, Any], where: Path | str) -> None:
    """The fields every sharded store's manifest (token store, VLM store) shares, checked:
    ``block_checksums`` (this code's algorithm and block size), ``built_with`` (library versions as
    strings) and ``files`` (a list of ``{path, bytes, sha256}`` records). `SnapshotError` naming `where` and
    the first field that is wrong."""
    check_block_checksums(manifest["block_checksums"], where)
    built = manifest["built_with"]
    if not isinstance(built, Mapping) or not all(isinstance(v, str) for v in built.values()):
        raise SnapshotError(f"{where}: built_with is {built!r:.80}; expected library versions")
    check_file_records(manifest["files"], where)

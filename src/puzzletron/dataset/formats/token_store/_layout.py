"""The token store's names, dtypes and manifest checks, shared by its writer, reader and verifier.

The format: ``docs/token-store-format.md``. `check_manifest` checks every field of a manifest (types,
ranges, cross-field consistency: O(shards), reads no other file); "complete" (`read_complete_manifest`,
what the reader and reuse check) adds that the files are exactly this layout's, each there with its
recorded size, the size its counts imply. The block checksums of every file make any other damage visible
on first read; `verify` reads every byte.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.formats.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    canonical_sha256,
    check_file,
    check_store_header,
    check_store_records,
    load_json,
    parse_json,
    read_bounded,
)
from puzzletron.dataset.storage.objects import is_url, join_url
from puzzletron.dataset.storage.sources import ByteSource, open_source

__all__ = [
    "BLOCKS",
    "IDS_BIN",
    "IDS_OFFSETS",
    "LENGTHS",
    "MAX_TOKENS",
    "OFFSETS",
    "SKIPPED_BIN",
    "SKIPPED_OFFSETS",
    "TOKEN_STORE_FORMAT",
    "TOKEN_STORE_VERSION",
    "WITHIN",
    "block_files",
    "check_manifest",
    "content_sha256",
    "expected_sizes",
    "load_store_manifest",
    "mask_name",
    "memmap_array",
    "read_complete_manifest",
    "token_dtype",
    "tokens_name",
]

TOKEN_STORE_FORMAT = "puzzletron-token-store"
TOKEN_STORE_VERSION = 3  # 3: content_sha256 binds the identity to the files
WITHIN = "the token store"
MAX_TOKENS = 2**62  # far beyond any store; every offset fits int64 with room

OFFSETS = "index/offsets.i64"  # [n + 1] int64: global token offset of each sample
LENGTHS = "index/lengths.u32"  # [n] uint32: tokens of each sample
IDS_BIN = "index/ids.bin"  # sample ids, UTF-8, concatenated
IDS_OFFSETS = "index/ids.i64"  # [n + 1] int64: byte offset of each id in ids.bin
BLOCKS = "index/blocks.u64"  # uint64 block checksums of every other file, in the manifest's files order
SKIPPED_BIN = "skipped/ids.bin"  # ids of the rows without a supervised token
SKIPPED_OFFSETS = "skipped/ids.i64"  # [skipped + 1] int64

_KEYS = {
    "block_checksums", "built_with", "content_sha256", "counts", "files", "format", "identity",
    "identity_sha256", "pad_token_id", "rows_per_shard", "shards", "token_dtype", "version", "vocab_size",
}  # fmt: skip
_COUNTS = ("rows", "samples", "skipped", "tokens", "supervised_tokens", "shards")


def tokens_name(shard: int) -> str:
    """The token file of shard `shard` (its samples' ids, little-endian ``token_dtype``)."""
    return f"shards/{shard:06d}.tokens"


def mask_name(shard: int) -> str:
    """The mask file of shard `shard` (one bit a token, ``np.packbits(bitorder="little")``)."""
    return f"shards/{shard:06d}.mask"


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype holding ids ``[0, vocab_size)`` (stored little-endian).

    >>> token_dtype(32_000), token_dtype(65_536), token_dtype(151_936)
    ('uint16', 'uint16', 'uint32')
    """
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise SnapshotError(f"a vocabulary of {vocab_size} ids does not fit in uint32")


def memmap_array(path: Path, dtype: str, count: int) -> np.ndarray:
    """A read-only ``[count]`` view of the file (a memmap; numpy cannot map an empty file)."""
    if count == 0:
        empty = np.zeros(0, dtype)
        empty.setflags(write=False)
        return empty
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def _int(value: Any, what: str, where: Path, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:  # not True, 1.0 or "1"
        said = "is missing" if value is None else f"is {value!r}"
        raise SnapshotError(f"{where}: {what} {said}; expected an integer {low}..{high}")
    return value


def _range(shard: Any, key: str, k: int, where: Path) -> tuple[int, int]:
    pair = shard.get(key) if isinstance(shard, Mapping) else None
    if not (
        isinstance(pair, list)
        and len(pair) == 2
        and all(type(x) is int and 0 <= x <= MAX_TOKENS for x in pair)
        and pair[0] <= pair[1]
    ):
        raise SnapshotError(
            f"{where}: shards[{k}].{key} is {pair!r}; expected [start, stop] with start <= stop"
        )
    return pair[0], pair[1]


def _check_shards(manifest: Mapping[str, Any], counts: Mapping[str, int], where: Path) -> None:
    """Shards tile rows, samples and tokens in order, with fixed row ranges of ``rows_per_shard``."""
    shards, per = manifest.get("shards"), manifest["rows_per_shard"]
    if not isinstance(shards, list) or len(shards) != counts["shards"]:
        raise SnapshotError(f"{where}: 'shards' is not a list of counts.shards={counts['shards']} entries")
    if len(shards) != -(-counts["rows"] // per):
        raise SnapshotError(
            f"{where}: {len(shards)} shards for {counts['rows']} rows of {per} rows per shard"
        )
    ends = dict.fromkeys(("rows", "samples", "tokens"), 0)
    for k, shard in enumerate(shards):
        if not isinstance(shard, Mapping) or set(shard) != set(ends):
            raise SnapshotError(f"{where}: shards[{k}] is {shard!r:.80}; expected {{rows, samples, tokens}}")
        spans = {key: _range(shard, key, k, where) for key in ends}
        for key, (a, _) in spans.items():
            if a != ends[key]:
                raise SnapshotError(f"{where}: shards[{k}].{key} starts at {a}, not where shard {k - 1} ends")
            ends[key] = spans[key][1]
        rows = spans["rows"][1] - spans["rows"][0]
        samples = spans["samples"][1] - spans["samples"][0]
        if spans["rows"] != (k * per, min((k + 1) * per, counts["rows"])) or samples > rows:
            raise SnapshotError(f"{where}: shards[{k}] {dict(shard)} is not rows {k * per}.. of {per} rows")
        if spans["tokens"][1] - spans["tokens"][0] < 2 * samples or (samples == 0) != (
            spans["tokens"][0] == spans["tokens"][1]
        ):
            raise SnapshotError(f"{where}: shards[{k}] has {samples} samples in {spans['tokens']} tokens")
    if ends != {"rows": counts["rows"], "samples": counts["samples"], "tokens": counts["tokens"]}:
        raise SnapshotError(f"{where}: the shards cover {ends}; the counts say {dict(counts)}")


def _check_identity(manifest: Mapping[str, Any], counts: Mapping[str, int], where: Path) -> None:
    identity, digest = manifest.get("identity"), manifest.get("identity_sha256")
    if not isinstance(identity, Mapping):
        raise SnapshotError(f"{where}: identity is {identity!r:.80}; expected a mapping")
    if identity.get("format") != TOKEN_STORE_FORMAT or identity.get("version") != manifest["version"]:
        raise SnapshotError(f"{where}: identity names {identity.get('format')!r} version "
                            f"{identity.get('version')!r}, not this store's")  # fmt: skip
    if not isinstance(digest, str) or digest != canonical_sha256(identity):
        raise SnapshotError(f"{where}: identity_sha256 {digest!r:.72} is not the SHA-256 of its identity")
    snapshot, options = identity.get("snapshot"), identity.get("options")
    if not isinstance(snapshot, Mapping) or not isinstance(options, Mapping):
        raise SnapshotError(f"{where}: identity has no snapshot and options mappings")
    if snapshot.get("rows") is not None and snapshot["rows"] != counts["rows"]:
        raise SnapshotError(f"{where}: identity.snapshot.rows is {snapshot['rows']!r}; counts.rows is "
                            f"{counts['rows']} (an identity of other data)")  # fmt: skip
    if options.get("rows_per_shard", manifest["rows_per_shard"]) != manifest["rows_per_shard"]:
        raise SnapshotError(f"{where}: identity.options.rows_per_shard {options.get('rows_per_shard')!r} "
                            f"is not rows_per_shard {manifest['rows_per_shard']}")  # fmt: skip


def check_manifest(manifest: Any, where: Path) -> dict[str, Any]:
    """`manifest` (a parsed ``manifest.json``, named `where` in errors) with every field checked: format and
    version, dtype, vocabulary, pad id, counts, shards, identity and its hash, block checksums, file records.
    `SnapshotError` naming the first field that is wrong. O(shards + files); reads nothing else."""
    check_store_header(
        manifest, where, fmt=TOKEN_STORE_FORMAT, version=TOKEN_STORE_VERSION, what="token store"
    )
    unknown = sorted(set(manifest) - _KEYS, key=str)
    if unknown or set(manifest) != _KEYS:
        missing = sorted(_KEYS - set(manifest))
        raise SnapshotError(f"{where}: keys {missing} are missing and {unknown} unexpected")
    vocab = _int(manifest["vocab_size"], "vocab_size", where, 1, 1 << 32)
    if manifest["token_dtype"] != token_dtype(vocab):
        raise SnapshotError(f"{where}: token_dtype is {manifest['token_dtype']!r}; a vocabulary of {vocab} "
                            f"is stored as {token_dtype(vocab)!r}")  # fmt: skip
    _int(manifest["pad_token_id"], "pad_token_id", where, 0, vocab - 1)
    _int(manifest["rows_per_shard"], "rows_per_shard", where, 1, MAX_TOKENS)
    raw = manifest["counts"]
    if not isinstance(raw, Mapping) or set(raw) != set(_COUNTS):
        raise SnapshotError(f"{where}: counts is {raw!r:.120}; expected the keys {', '.join(_COUNTS)}")
    counts = {key: _int(raw[key], f"counts.{key}", where, 0, MAX_TOKENS) for key in _COUNTS}
    if counts["rows"] != counts["samples"] + counts["skipped"]:
        raise SnapshotError(f"{where}: counts.rows {counts['rows']} is not samples + skipped")
    if counts["supervised_tokens"] > counts["tokens"] or 2 * counts["samples"] > counts["tokens"]:
        raise SnapshotError(f"{where}: counts {counts} do not fit together (samples of >= 2 tokens, "
                            "supervised labels <= tokens)")  # fmt: skip
    _check_shards(manifest, counts, where)
    _check_identity(manifest, counts, where)
    check_store_records(manifest, where)
    if manifest["content_sha256"] != content_sha256(manifest):
        raise SnapshotError(
            f"{where}: content_sha256 does not bind identity_sha256 to the files this manifest records (an "
            "identity pasted from another store?)"
        )
    return manifest


def content_sha256(manifest: Mapping[str, Any]) -> str:
    """The SHA-256 binding a store's identity to its bytes: of ``{identity_sha256, files: {path:
    sha256}}`` (sorted compact JSON). The builder records it; an identity copied from another store (with
    its own hash) no longer matches the files, and `verify` checks the files against their hashes."""
    files = {r["path"]: r["sha256"] for r in manifest["files"]}
    return canonical_sha256({"identity_sha256": manifest["identity_sha256"], "files": files})


def expected_sizes(manifest: Mapping[str, Any]) -> dict[str, int]:
    """Path -> the byte size a checked manifest implies for each file (the two id byte strings: as
    recorded; the block checksums: from every other file's size)."""
    samples, skipped = manifest["counts"]["samples"], manifest["counts"]["skipped"]
    itemsize = np.dtype(manifest["token_dtype"]).itemsize
    sizes = {OFFSETS: 8 * (samples + 1), LENGTHS: 4 * samples, IDS_OFFSETS: 8 * (samples + 1)}
    sizes[SKIPPED_OFFSETS] = 8 * (skipped + 1)
    for k, shard in enumerate(manifest["shards"]):
        count = shard["tokens"][1] - shard["tokens"][0]
        sizes[tokens_name(k)] = count * itemsize
        sizes[mask_name(k)] = (count + 7) // 8
    recorded = {r["path"]: r["bytes"] for r in manifest["files"]}
    for rel in (IDS_BIN, SKIPPED_BIN):
        sizes[rel] = recorded.get(rel, 0)
    sizes[BLOCKS] = 8 * sum(_blocks.block_count(size) for size in sizes.values())
    return sizes


def block_files(manifest: Mapping[str, Any]) -> list[tuple[str, int]]:
    """``(path, bytes)`` of the files the block checksums cover, in their order (the manifest's ``files``
    order, without the checksum file)."""
    return [(r["path"], r["bytes"]) for r in manifest["files"] if r["path"] != BLOCKS]


def load_store_manifest(root: str | Path, source: ByteSource | None = None) -> dict[str, Any]:
    """The token store manifest at `root` (a path or an URL; read through `source` when given), every
    field checked (`check_manifest`), no other file read."""
    if source is None and not is_url(root):
        where = Path(root) / MANIFEST
        return check_manifest(load_json(where, "the manifest", max_bytes=MAX_MANIFEST_BYTES), where)
    source = source if source is not None else open_source(root)
    where: Any = join_url(str(root), MANIFEST) if is_url(root) else Path(root) / MANIFEST
    try:
        source.size(MANIFEST)
    except SnapshotError as exc:
        raise SnapshotError(f"{where}: the manifest is missing ({exc})") from None
    raw = read_bounded(source, MANIFEST, "the manifest", max_bytes=MAX_MANIFEST_BYTES)
    try:
        return check_manifest(parse_json(raw, "the manifest"), where)
    except ValueError as exc:
        if isinstance(exc, SnapshotError):
            raise
        raise SnapshotError(f"{where}: {exc}") from None


def read_complete_manifest(path: str | Path, source: ByteSource | None = None) -> dict[str, Any]:
    """The manifest of the complete token store at `path` (a directory or an URL prefix, read through
    `source` when given); `SnapshotError` saying what is wrong otherwise.

    Checks every manifest field (`check_manifest`), that ``files`` lists exactly this layout's files in
    sorted order, and that each is there with its recorded size, the size the counts imply (a truncated or
    extended shard is refused here). Reads no token. On object storage the sizes come from one listing.
    """
    remote = is_url(path)
    root: Any = str(path).rstrip("/") if remote else Path(path).absolute()
    manifest = load_store_manifest(root, source)
    sizes = expected_sizes(manifest)
    paths = [r["path"] for r in manifest["files"]]
    if paths != sorted(sizes):
        missing, extra = sorted(set(sizes) - set(paths)), sorted(set(paths) - set(sizes))
        raise SnapshotError(
            f"{root}: the manifest's files are not this layout's (missing {missing}, unexpected {extra}, "
            "or out of order)"
        )
    if remote and source is None:
        source = open_source(root)
    problems = []
    for record in manifest["files"]:
        rel = record["path"]
        try:
            if remote:
                found = source.size(rel)  # type: ignore[union-attr]
                if found != record["bytes"]:
                    raise SnapshotError(f"{root}: {rel} has {found} bytes, the manifest records "
                                        f"{record['bytes']} (truncated or replaced)")  # fmt: skip
            else:
                check_file(root, record, within=WITHIN)
        except SnapshotError as exc:
            problems.append(str(exc))
            continue
        if record["bytes"] != sizes[rel]:
            problems.append(f"{root}: {rel} has {record['bytes']} bytes; its counts imply {sizes[rel]}")
    if problems:
        raise SnapshotError(f"{root}: incomplete or damaged token store: {'; '.join(problems[:5])}")
    return manifest

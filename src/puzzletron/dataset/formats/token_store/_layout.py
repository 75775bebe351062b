"""The token store's names, dtypes and manifest checks, shared by its writer, reader and verifier.

The format: ``docs/token-store-format.md``. "Complete" (what the reader and reuse check, cheap): the
manifest parses, names this format and version, lists exactly the files this layout has, and each is there
with its recorded size, which is the size its counts imply. `verify` reads every byte.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.binary import memmap_array
from puzzletron.dataset.formats.manifest import MANIFEST, check_file, load_json
from puzzletron.dataset.formats.shards import mask_name, tokens_name

__all__ = [
    "IDS_BIN",
    "IDS_OFFSETS",
    "LENGTHS",
    "OFFSETS",
    "SKIPPED_BIN",
    "SKIPPED_OFFSETS",
    "TOKEN_STORE_FORMAT",
    "TOKEN_STORE_VERSION",
    "WITHIN",
    "expected_sizes",
    "load_store_manifest",
    "mask_name",
    "memmap_array",
    "read_complete_manifest",
    "token_dtype",
    "tokens_name",
]

TOKEN_STORE_FORMAT = "puzzletron-token-store"
TOKEN_STORE_VERSION = 1
WITHIN = "the token store"

OFFSETS = "index/offsets.i64"  # [n + 1] int64: global token offset of each sample
LENGTHS = "index/lengths.u32"  # [n] uint32: tokens of each sample
IDS_BIN = "index/ids.bin"  # sample ids, UTF-8, concatenated
IDS_OFFSETS = "index/ids.i64"  # [n + 1] int64: byte offset of each id in ids.bin
SKIPPED_BIN = "skipped/ids.bin"  # ids of the rows without a supervised token
SKIPPED_OFFSETS = "skipped/ids.i64"  # [skipped + 1] int64


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


def _count(manifest: Mapping[str, Any], key: str, where: Path) -> int:
    value = manifest.get("counts", {}).get(key) if isinstance(manifest.get("counts"), Mapping) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SnapshotError(f"{where}: counts.{key} is {value!r}; expected an int >= 0")
    return value


def expected_sizes(manifest: Mapping[str, Any], where: Path) -> dict[str, int]:
    """Path -> the byte size the manifest's counts imply, for every file but the two id byte strings
    (whose sizes only their offsets tell); `SnapshotError` for a malformed manifest."""
    samples, skipped = _count(manifest, "samples", where), _count(manifest, "skipped", where)
    if manifest.get("token_dtype") not in ("uint16", "uint32"):
        raise SnapshotError(
            f"{where}: token_dtype is {manifest.get('token_dtype')!r}; expected uint16 or uint32"
        )
    itemsize = np.dtype(manifest["token_dtype"]).itemsize
    sizes = {OFFSETS: 8 * (samples + 1), LENGTHS: 4 * samples, IDS_OFFSETS: 8 * (samples + 1)}
    sizes[SKIPPED_OFFSETS] = 8 * (skipped + 1)
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise SnapshotError(f"{where}: 'shards' is {shards!r}; expected a list")
    for k, shard in enumerate(shards):
        tokens = shard.get("tokens") if isinstance(shard, Mapping) else None
        if not (isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, int) for t in tokens)):
            raise SnapshotError(f"{where}: shards[{k}].tokens is {tokens!r}; expected [start, stop]")
        count = tokens[1] - tokens[0]
        sizes[tokens_name(k)] = count * itemsize
        sizes[mask_name(k)] = (count + 7) // 8
    return sizes


def load_store_manifest(root: Path) -> dict[str, Any]:
    """The token store manifest at `root`, checked for its format and version (not for completeness)."""
    where = root / MANIFEST
    manifest = load_json(where, "the manifest")
    if not isinstance(manifest, dict):
        raise SnapshotError(f"{where}: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != TOKEN_STORE_FORMAT:
        raise SnapshotError(f"{where}: a {manifest.get('format')!r} manifest, not a token store")
    if manifest.get("version") != TOKEN_STORE_VERSION:
        raise SnapshotError(
            f"{where}: token store version {manifest.get('version')!r} is not supported "
            f"(this code reads {TOKEN_STORE_VERSION})"
        )
    return manifest


def read_complete_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the complete token store at `path`; `SnapshotError` saying what is wrong otherwise.

    Checks the format and version, that ``files`` lists exactly this layout's files, and that each is there
    with its recorded size, the size the counts imply (a truncated or extended shard is refused here).
    Reads no token.
    """
    root = Path(path).absolute()
    manifest = load_store_manifest(root)
    sizes = expected_sizes(manifest, root / MANIFEST)
    records = manifest.get("files")
    if not isinstance(records, list):
        raise SnapshotError(f"{root / MANIFEST}: 'files' is {records!r}; expected a list of file records")
    listed = {r.get("path"): r for r in records if isinstance(r, Mapping)}
    expected = set(sizes) | {IDS_BIN, SKIPPED_BIN}
    if set(listed) != expected or len(records) != len(expected):
        missing, extra = sorted(expected - set(listed)), sorted(set(listed) - expected, key=str)
        raise SnapshotError(
            f"{root}: the manifest's files are not this layout's (missing {missing}, unexpected {extra})"
        )
    problems = []
    for rel, record in sorted(listed.items()):
        try:
            check_file(root, record, within=WITHIN)
        except SnapshotError as exc:
            problems.append(str(exc))
            continue
        if rel in sizes and record.get("bytes") != sizes[rel]:
            problems.append(f"{root}: {rel} has {record.get('bytes')} bytes; its counts imply {sizes[rel]}")
    if problems:
        raise SnapshotError(f"{root}: incomplete or damaged token store: {'; '.join(problems[:5])}")
    return manifest

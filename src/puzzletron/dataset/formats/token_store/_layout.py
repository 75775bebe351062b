"""The token store's names, dtypes and manifest checks, shared by its writer, reader and verifier.

The format: ``docs/token-store-format.md``. "Complete" (what the reader and reuse check, cheap): the
manifest parses, names this format and version, lists exactly the files this layout has, and each is there
with its recorded size, which is the size its counts imply. `verify` reads every byte.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.binary import memmap_array
from puzzletron.dataset.formats.manifest import MANIFEST
from puzzletron.dataset.formats.shards import (
    IDS_BIN,
    IDS_OFFSETS,
    LENGTHS,
    OFFSETS,
    SKIPPED_BIN,
    SKIPPED_OFFSETS,
    check_complete,
    count_of,
    load_format_manifest,
    mask_name,
    shard_file_sizes,
    tokens_name,
)

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


def expected_sizes(manifest: Mapping[str, Any], where: Path) -> dict[str, int]:
    """Path -> the byte size the manifest's counts imply, for every file but the two id byte strings
    (whose sizes only their offsets tell); `SnapshotError` for a malformed manifest."""
    samples, skipped = count_of(manifest, "samples", where), count_of(manifest, "skipped", where)
    sizes = {OFFSETS: 8 * (samples + 1), LENGTHS: 4 * samples, IDS_OFFSETS: 8 * (samples + 1)}
    sizes[SKIPPED_OFFSETS] = 8 * (skipped + 1)
    return sizes | shard_file_sizes(manifest, where)


def load_store_manifest(root: Path) -> dict[str, Any]:
    """The token store manifest at `root`, checked for its format and version (not for completeness)."""
    return load_format_manifest(root, TOKEN_STORE_FORMAT, TOKEN_STORE_VERSION, "token store")


def read_complete_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the complete token store at `path`; `SnapshotError` saying what is wrong otherwise.

    Checks the format and version, that ``files`` lists exactly this layout's files, and that each is there
    with its recorded size, the size the counts imply (a truncated or extended shard is refused here).
    Reads no token.
    """
    root = Path(path).absolute()
    manifest = load_store_manifest(root)
    sizes = expected_sizes(manifest, root / MANIFEST)
    check_complete(root, manifest, sizes, {IDS_BIN, SKIPPED_BIN}, within=WITHIN, what="token store")
    return manifest

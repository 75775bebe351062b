"""The token store (``docs/token-store-format.md``): chat-tokenised samples of a text split in sharded
binary files, read by positional reads. `reader` (`TokenStore`), `writer` (shards, index, manifest),
`verify` (every byte); the names, dtypes and manifest checks they share stay private to this package. The
block checksums every reader verifies on first read: `puzzletron.dataset.formats.blocks`."""

from __future__ import annotations

from puzzletron.dataset.formats.token_store._layout import (
    LENGTHS,
    TOKEN_STORE_FORMAT,
    TOKEN_STORE_VERSION,
    content_sha256,
    read_complete_manifest,
    token_dtype,
)
from puzzletron.dataset.formats.token_store.reader import TokenStore, pread_into, read_strings
from puzzletron.dataset.formats.token_store.verify import (
    describe_token_store,
    render_token_store,
    verify_token_store,
)
from puzzletron.dataset.formats.token_store.writer import (
    RECORD,
    ShardWriter,
    assemble_store,
    read_shard_record,
)

__all__ = [
    "LENGTHS",
    "RECORD",
    "TOKEN_STORE_FORMAT",
    "TOKEN_STORE_VERSION",
    "ShardWriter",
    "TokenStore",
    "assemble_store",
    "content_sha256",
    "describe_token_store",
    "pread_into",
    "read_complete_manifest",
    "read_shard_record",
    "read_strings",
    "render_token_store",
    "token_dtype",
    "verify_token_store",
]

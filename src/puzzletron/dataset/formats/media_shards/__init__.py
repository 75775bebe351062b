"""Media shards (``docs/media-shard-format.md``): a subset's images in shard files of 64-256 MiB with an
index of (shard, offset, length, SHA-256) per image and block checksums, instead of one file per image.

Written by `MediaShardWriter` while a subset streams (`formats.subset.writer`, ``media="shards"``), read by
`MediaShards` (one image at a time by its range, SHA-256 checked), verified by `verify_media`.
"""

from __future__ import annotations

from puzzletron.dataset.formats.media_shards._layout import (
    DEFAULT_SHARD_BYTES,
    MAX_SHARD_BYTES,
    MEDIA_FORMAT,
    MEDIA_VERSION,
    MIN_SHARD_BYTES,
    check_record,
)
from puzzletron.dataset.formats.media_shards.reader import MediaShards
from puzzletron.dataset.formats.media_shards.verify import verify_media
from puzzletron.dataset.formats.media_shards.writer import MediaShardWriter

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "MAX_SHARD_BYTES",
    "MEDIA_FORMAT",
    "MEDIA_VERSION",
    "MIN_SHARD_BYTES",
    "MediaShardWriter",
    "MediaShards",
    "check_record",
    "verify_media",
]

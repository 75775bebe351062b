"""The VLM store (``docs/vlm-store-format.md``): a subset's conversations tokenised with a processor's chat
template, image placeholders expanded, in the token store's shards, with per-sample image ranges and per
image its grid and a reference to the subset's file (no pixels). `reader` (`VlmStore`), `writer`, `verify`;
the names and manifest checks they share stay private to this package."""

from __future__ import annotations

from puzzletron.dataset.formats.vlm_store._layout import (
    MEDIA_END,
    SKIP_REASONS,
    VLM_STORE_FORMAT,
    VLM_STORE_VERSION,
    read_complete_manifest,
)
from puzzletron.dataset.formats.vlm_store.reader import VlmStore
from puzzletron.dataset.formats.vlm_store.verify import describe_vlm_store, render_vlm_store, verify_vlm_store
from puzzletron.dataset.formats.vlm_store.writer import (
    VlmShardWriter,
    assemble_vlm_store,
    read_vlm_shard_record,
)

__all__ = [
    "MEDIA_END",
    "SKIP_REASONS",
    "VLM_STORE_FORMAT",
    "VLM_STORE_VERSION",
    "VlmShardWriter",
    "VlmStore",
    "assemble_vlm_store",
    "describe_vlm_store",
    "read_complete_manifest",
    "read_vlm_shard_record",
    "render_vlm_store",
    "verify_vlm_store",
]

"""The VLM store (``docs/vlm-store-format.md``): a subset's conversations tokenised with a processor's chat
template, image placeholders expanded, as a token store in ``tokens/`` (`formats.token_store`) plus an image
table: per sample its image range, image tokens and where its last image ends, per image its grid and a
reference to the subset's file (no pixels). `reader` (`VlmStore`), `writer`, `verify`; the names and
manifest checks they share stay private to this package."""

from __future__ import annotations

from puzzletron.dataset.formats.vlm_store._layout import (
    MEDIA_END,
    SKIP_REASONS,
    SUBSET_PATH,
    TOKENS_MANIFEST,
    VLM_STORE_FORMAT,
    VLM_STORE_VERSION,
    read_complete_manifest,
    token_identity,
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
    "SUBSET_PATH",
    "TOKENS_MANIFEST",
    "VLM_STORE_FORMAT",
    "VLM_STORE_VERSION",
    "VlmShardWriter",
    "VlmStore",
    "assemble_vlm_store",
    "describe_vlm_store",
    "read_complete_manifest",
    "read_vlm_shard_record",
    "render_vlm_store",
    "token_identity",
    "verify_vlm_store",
]

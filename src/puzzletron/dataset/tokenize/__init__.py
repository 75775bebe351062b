"""Tokenisation: chat-template rendering with assistant-only labels, in memory or into a token store.

`conversations` tokenises rows (batched: render once, encode in one backend call; `tokenize_conversation`
is the row-by-row reference); `store` builds (or reuses) a content-addressed token store of a text split,
`vlm_store` the VLM store of a conversation subset under a processor (`processor`: its parts and the image
grid), both with worker processes and across `torch.distributed` ranks (`_builder`, shared); `identity` says
what a store is built from and names it; `cache` finds the store of an identity anywhere under a cache
directory. The on-disk formats are `puzzletron.dataset.formats.token_store` and
`puzzletron.dataset.formats.vlm_store`.
"""

from __future__ import annotations

from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.packing.sources import labels_from_mask, shift_labels
from puzzletron.dataset.tokenize._pixels import normalize_pixels, normalized_pixels, pixel_normalization
from puzzletron.dataset.tokenize._workers import map_tasks
from puzzletron.dataset.tokenize.cache import cache_path, find_store
from puzzletron.dataset.tokenize.conversations import (
    TokenizedRows,
    TokenizedText,
    assistant_token_mask,
    load_tokenizer,
    pad_token_id,
    select_rows,
    tokenize_conversation,
    tokenize_conversations,
    tokenize_rows,
)
from puzzletron.dataset.tokenize.hf_processor import load_hf_processor
from puzzletron.dataset.tokenize.identity import (
    identity_sha256,
    short_hash,
    store_identity,
    vlm_store_identity,
)
from puzzletron.dataset.tokenize.processor import GridConfig, VlmProcessor, vlm_processor
from puzzletron.dataset.tokenize.store import build_token_store
from puzzletron.dataset.tokenize.vlm_store import build_vlm_store

__all__ = [
    "GridConfig",
    "TokenizeOptions",
    "TokenizedRows",
    "TokenizedText",
    "VlmProcessor",
    "assistant_token_mask",
    "build_token_store",
    "build_vlm_store",
    "cache_path",
    "find_store",
    "identity_sha256",
    "labels_from_mask",
    "load_hf_processor",
    "load_tokenizer",
    "map_tasks",
    "normalize_pixels",
    "normalized_pixels",
    "pad_token_id",
    "pixel_normalization",
    "select_rows",
    "shift_labels",
    "short_hash",
    "store_identity",
    "tokenize_conversation",
    "tokenize_conversations",
    "tokenize_rows",
    "vlm_processor",
    "vlm_store_identity",
]

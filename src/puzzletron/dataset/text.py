"""The text path under its original import path: tokenisation (`puzzletron.dataset.tokenize`) and the
snapshot -> batches pipeline (`puzzletron.dataset.pipeline`)."""

from __future__ import annotations

from puzzletron.dataset.pipeline import TextBatches, build_batches, load_text_split
from puzzletron.dataset.tokenize import (
    TokenizedText,
    assistant_token_mask,
    load_tokenizer,
    shift_labels,
    tokenize_conversation,
    tokenize_conversations,
)

__all__ = [
    "TextBatches",
    "TokenizedText",
    "assistant_token_mask",
    "build_batches",
    "load_text_split",
    "load_tokenizer",
    "shift_labels",
    "tokenize_conversation",
    "tokenize_conversations",
]

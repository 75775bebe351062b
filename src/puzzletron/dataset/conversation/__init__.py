"""Conversations in AutoModel's normalised form: the source normalisers (InterSyn, Nemotron-VLM), the
checks every stored conversation passes (`normalize`), and image decoding (`images`, the only Pillow
importer: pixel and frame limits, bytes kept as they came when they decode cleanly)."""

from __future__ import annotations

from puzzletron.dataset.conversation.normalize import (
    INTERSYN_MULTI_DATASET,
    INTERSYN_MULTI_REVISION,
    INTERSYN_SINGLE_DATASET,
    INTERSYN_SINGLE_REVISION,
    NEMOTRON_VLM_DATASET,
    ROLES,
    normalize_intersyn_multi,
    normalize_intersyn_single,
    normalize_nemotron_vlm_sample,
    validate_conversation,
)

__all__ = [
    "INTERSYN_MULTI_DATASET",
    "INTERSYN_MULTI_REVISION",
    "INTERSYN_SINGLE_DATASET",
    "INTERSYN_SINGLE_REVISION",
    "NEMOTRON_VLM_DATASET",
    "ROLES",
    "normalize_intersyn_multi",
    "normalize_intersyn_single",
    "normalize_nemotron_vlm_sample",
    "validate_conversation",
]

"""STUB — replaced by the conversation normalisers (issue 3)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["normalize_intersyn_multi", "normalize_intersyn_single", "normalize_nemotron_vlm_sample"]


def normalize_intersyn_single(row: Mapping[str, Any]) -> dict[str, Any]:
    """Convert one real InterSyn single-turn row to AutoModel conversation form."""
    raise NotImplementedError


def normalize_intersyn_multi(row: Mapping[str, Any]) -> dict[str, Any]:
    """Convert the five-column-group InterSyn multi-turn schema without reordering turns."""
    raise NotImplementedError


def normalize_nemotron_vlm_sample(row: Mapping[str, Any], *, subset: str, revision: str) -> dict[str, Any]:
    """Preserve a complete Nemotron conversation while attaching its matched image."""
    raise NotImplementedError

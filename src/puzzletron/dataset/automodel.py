"""STUB — replaced by the AutoModel adapter (issue 5)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from puzzletron.dataset.batch import DataLayout, PuzzletronBatch

__all__ = ["batch_from_automodel"]


def batch_from_automodel(
    collated: Mapping[str, Any],
    *,
    sample_ids: Sequence[str],
    source_metadata: Mapping[str, Any],
    layout: DataLayout | str,
) -> PuzzletronBatch:
    """Normalize an AutoModel VLM/text collator result into `PuzzletronBatch`."""
    raise NotImplementedError

"""STUB — replaced by the on-disk subset format (issue 3)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "load_materialized_conversation_subset",
    "load_materialized_intersyn_subset",
    "materialize_normalized_conversation_samples",
    "materialize_normalized_intersyn_samples",
]


def materialize_normalized_conversation_samples(
    samples: Iterable[Mapping[str, Any]],
    output_dir: str | Path,
    *,
    acquisition: Mapping[str, Any] | None = None,
    diagnostics: Mapping[str, Any] | None = None,
    expected_count: int | None = None,
) -> dict[str, Any]:
    """Stream normalized conversations into an atomically published offline subset."""
    raise NotImplementedError


def materialize_normalized_intersyn_samples(
    samples: Sequence[Mapping[str, Any]], output_dir: str | Path
) -> dict[str, Any]:
    """Compatibility wrapper for the original InterSyn materializer."""
    return materialize_normalized_conversation_samples(samples, output_dir)


def load_materialized_conversation_subset(output_dir: str | Path) -> list[dict[str, Any]]:
    """Load a materialized conversation subset without contacting Hugging Face."""
    raise NotImplementedError


def load_materialized_intersyn_subset(output_dir: str | Path) -> list[dict[str, Any]]:
    """Compatibility wrapper for the original InterSyn loader."""
    return load_materialized_conversation_subset(output_dir)

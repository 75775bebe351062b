"""STUB — replaced by the Hydra dataset factory (issue 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["load_materialized_conversation_dataset"]


def load_materialized_conversation_dataset(
    path_or_dataset: str | Path,
    *,
    num_samples: int | None = None,
    seq_length: int | None = None,
    pretokenize: bool | None = None,
    truncate: bool | None = None,
    inject_fake_images: bool | None = None,
    max_length: int | None = None,
    **unknown: Any,
):
    """Hydra-friendly AutoModel VLM dataset factory for the offline subset."""
    raise NotImplementedError

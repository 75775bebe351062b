"""Dataset preparation utilities for Puzzletron.

The public API is exactly the seed list of names (pinned by ``tests/golden/seed-api.txt``); every name is
re-exported from the module that owns the concept. Imports are lazy (PEP 562): reading a subset offline
does not pay for torch, `datasets` or `huggingface_hub` until a name that needs them is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from puzzletron.dataset.acquisition import (
        TextAcquisitionSpec,
        VlmAcquisitionSpec,
        materialize_intersyn_subset,
        materialize_nemotron_vlm_dataset,
        materialize_puzzle_kd_dataset,
    )
    from puzzletron.dataset.automodel import batch_from_automodel
    from puzzletron.dataset.batch import DataLayout, Modality, PackedSequenceMetadata, PuzzletronBatch
    from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
    from puzzletron.dataset.conversation import (
        normalize_intersyn_multi,
        normalize_intersyn_single,
        normalize_nemotron_vlm_sample,
    )
    from puzzletron.dataset.factory import load_materialized_conversation_dataset
    from puzzletron.dataset.subset import (
        load_materialized_conversation_subset,
        load_materialized_intersyn_subset,
        materialize_normalized_conversation_samples,
        materialize_normalized_intersyn_samples,
    )

# public name -> owning module
_OWNERS: dict[str, str] = {
    "DataLayout": "batch",
    "Modality": "batch",
    "PackedSequenceMetadata": "batch",
    "PuzzletronBatch": "batch",
    "PackingSpec": "config",
    "PuzzletronDataSpec": "config",
    "TextAcquisitionSpec": "acquisition",
    "VlmAcquisitionSpec": "acquisition",
    "materialize_intersyn_subset": "acquisition",
    "materialize_nemotron_vlm_dataset": "acquisition",
    "materialize_puzzle_kd_dataset": "acquisition",
    "batch_from_automodel": "automodel",
    "normalize_intersyn_multi": "conversation",
    "normalize_intersyn_single": "conversation",
    "normalize_nemotron_vlm_sample": "conversation",
    "load_materialized_conversation_dataset": "factory",
    "load_materialized_conversation_subset": "subset",
    "load_materialized_intersyn_subset": "subset",
    "materialize_normalized_conversation_samples": "subset",
    "materialize_normalized_intersyn_samples": "subset",
}

__all__ = [
    "DataLayout",
    "Modality",
    "PackedSequenceMetadata",
    "PackingSpec",
    "PuzzletronBatch",
    "PuzzletronDataSpec",
    "TextAcquisitionSpec",
    "VlmAcquisitionSpec",
    "batch_from_automodel",
    "load_materialized_conversation_dataset",
    "load_materialized_conversation_subset",
    "load_materialized_intersyn_subset",
    "materialize_intersyn_subset",
    "materialize_nemotron_vlm_dataset",
    "materialize_normalized_conversation_samples",
    "materialize_normalized_intersyn_samples",
    "materialize_puzzle_kd_dataset",
    "normalize_intersyn_multi",
    "normalize_intersyn_single",
    "normalize_nemotron_vlm_sample",
]


def __getattr__(name: str) -> Any:
    owner = _OWNERS.get(name)
    if owner is None or name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{owner}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

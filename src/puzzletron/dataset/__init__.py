"""Dataset preparation utilities for Puzzletron.

The public API is the seed list of names (pinned by ``tests/golden/seed-api.txt``) plus
``build_vlm_batches`` (the native VLM path, `puzzletron.dataset.pipelines.vlm`) and
``build_mixture_batches`` (several stores as one token-weighted stream, `pipelines.mixture`); every name is
re-exported from the module that owns the concept. Imports are lazy (PEP 562): reading a subset offline
does not pay for torch, `datasets` or `huggingface_hub` until a name that needs them is touched.

The packages and which may import which: ``docs/architecture.md``. Import paths of earlier releases
(``puzzletron.dataset.text``, ``.sampler``, ``.acquisition`` ...) still work: `_aliases`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from puzzletron.dataset import _aliases
from puzzletron.dataset._checks import lazy_attribute

if TYPE_CHECKING:
    from puzzletron.dataset.batch import DataLayout, Modality, PackedSequenceMetadata, PuzzletronBatch
    from puzzletron.dataset.clients.automodel.adapter import batch_from_automodel
    from puzzletron.dataset.clients.automodel.vlm_factory import load_materialized_conversation_dataset
    from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
    from puzzletron.dataset.conversation import (
        normalize_intersyn_multi,
        normalize_intersyn_single,
        normalize_nemotron_vlm_sample,
    )
    from puzzletron.dataset.formats.subset import (
        load_materialized_conversation_subset,
        load_materialized_intersyn_subset,
        materialize_normalized_conversation_samples,
        materialize_normalized_intersyn_samples,
    )
    from puzzletron.dataset.pipelines.mixture import build_mixture_batches
    from puzzletron.dataset.pipelines.vlm import build_vlm_batches
    from puzzletron.dataset.sources import (
        TextAcquisitionSpec,
        VlmAcquisitionSpec,
        materialize_intersyn_subset,
        materialize_nemotron_vlm_dataset,
        materialize_puzzle_kd_dataset,
    )

# public name -> owning module
_OWNERS: dict[str, str] = {
    "DataLayout": "batch",
    "Modality": "batch",
    "PackedSequenceMetadata": "batch",
    "PuzzletronBatch": "batch",
    "PackingSpec": "config",
    "PuzzletronDataSpec": "config",
    "TextAcquisitionSpec": "sources",
    "VlmAcquisitionSpec": "sources",
    "materialize_intersyn_subset": "sources",
    "materialize_nemotron_vlm_dataset": "sources",
    "materialize_puzzle_kd_dataset": "sources",
    "batch_from_automodel": "clients.automodel.adapter",
    "build_mixture_batches": "pipelines.mixture",
    "build_vlm_batches": "pipelines.vlm",
    "normalize_intersyn_multi": "conversation",
    "normalize_intersyn_single": "conversation",
    "normalize_nemotron_vlm_sample": "conversation",
    "load_materialized_conversation_dataset": "clients.automodel.vlm_factory",
    "load_materialized_conversation_subset": "formats.subset",
    "load_materialized_intersyn_subset": "formats.subset",
    "materialize_normalized_conversation_samples": "formats.subset",
    "materialize_normalized_intersyn_samples": "formats.subset",
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
    "build_mixture_batches",
    "build_vlm_batches",
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
    return lazy_attribute(__name__, _OWNERS, name, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_aliases.install()

"""Dataset preparation utilities for Puzzletron.

The public API is the seed list (`shared/seed/puzzletron-dataset-api.txt`); everything here is re-exported
from the module that owns the concept.
"""

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

"""STUB — replaced by the batch implementation (issue 2)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

__all__ = ["DataLayout", "Modality", "PackedSequenceMetadata", "PuzzletronBatch"]


class DataLayout(str, Enum):
    FIXED = "fixed"
    PADDED_VARLEN = "padded_varlen"
    PACKED_VARLEN = "packed_varlen"


class Modality(str, Enum):
    TEXT = "text"
    MULTIMODAL = "multimodal"


@dataclass(frozen=True)
class PackedSequenceMetadata:
    """Sequence and media boundaries retained across distributed partitions."""

    global_cu_seqlens: torch.Tensor | None = None
    local_cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    seq_ids: torch.Tensor | None = None
    sample_offsets: tuple[tuple[int, int], ...] = ()
    media_counts: torch.Tensor | None = None
    media_offsets: torch.Tensor | None = None
    cp_rank: int = 0
    cp_size: int = 1


@dataclass(frozen=True)
class PuzzletronBatch:
    """The only model-input contract shared by Puzzletron stages."""

    model_kwargs: Mapping[str, Any]
    labels: torch.Tensor | None = None
    ce_mask: torch.Tensor | None = None
    kd_mask: torch.Tensor | None = None
    hidden_mask: torch.Tensor | None = None
    sequence: PackedSequenceMetadata = field(default_factory=PackedSequenceMetadata)
    sample_ids: tuple[str, ...] = ()
    source_metadata: Mapping[str, Any] = field(default_factory=dict)
    modality: Modality = Modality.TEXT
    layout: DataLayout = DataLayout.FIXED

    def cp_partition(self, token_indices: torch.Tensor, *, cp_rank: int, cp_size: int) -> PuzzletronBatch:
        raise NotImplementedError

    def dp_slice(self, *, dp_rank: int, dp_size: int) -> PuzzletronBatch:
        """Return one disjoint contiguous DP shard without duplicating samples/media."""
        raise NotImplementedError

    def pad_batch_to_multiple(self, multiple: int) -> PuzzletronBatch:
        """Append fully masked rows for a static PP schedule without copying media."""
        raise NotImplementedError

    def pp_microbatches(self, n_microbatches: int) -> tuple[PuzzletronBatch, ...]:
        raise NotImplementedError

    def replace_model_kwargs(self, **updates: Any) -> PuzzletronBatch:
        raise NotImplementedError

    def to(self, *args: Any, **kwargs: Any) -> PuzzletronBatch:
        raise NotImplementedError

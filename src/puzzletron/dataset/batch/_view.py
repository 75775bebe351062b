"""`BatchView`: the fields of a `PuzzletronBatch` that validation and the splits read.

Typing against this protocol lets `_validation`, `_tables` and the split modules work on batches without
importing the class (which imports them): imports inside `puzzletron.dataset.batch` flow one way, from
`_core` down.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

import torch

from puzzletron.dataset._enums import DataLayout, Modality
from puzzletron.dataset.batch._metadata import PackedSequenceMetadata

__all__ = ["B", "BatchView"]


class BatchView(Protocol):
    """Read-only view of a batch; see `PuzzletronBatch` for the meaning of each field."""

    @property
    def model_kwargs(self) -> Mapping[str, Any]: ...
    @property
    def labels(self) -> torch.Tensor | None: ...
    @property
    def ce_mask(self) -> torch.Tensor | None: ...
    @property
    def kd_mask(self) -> torch.Tensor | None: ...
    @property
    def hidden_mask(self) -> torch.Tensor | None: ...
    @property
    def sequence(self) -> PackedSequenceMetadata: ...
    @property
    def sample_ids(self) -> tuple[str, ...]: ...
    @property
    def source_metadata(self) -> Mapping[str, Any]: ...
    @property
    def modality(self) -> Modality: ...
    @property
    def layout(self) -> DataLayout: ...
    @property
    def input_ids(self) -> torch.Tensor: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def sequence_length(self) -> int: ...


# A concrete batch type: derived batches have the type of the batch they were derived from.
B = TypeVar("B", bound=BatchView)

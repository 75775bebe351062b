"""`PackedBatches`: the map-style dataset a DataLoader reads, one `BatchKey` -> one `PuzzletronBatch`.

A key (not a worker, not an iteration order) determines a batch, so any number of DataLoader workers, and a
resume at any step, give the same batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from puzzletron.dataset.batch import PuzzletronBatch
from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.distributed.sampler import BatchKey
from puzzletron.dataset.packing import PackingPlan, SampleSource, build_batch

__all__ = ["PackedBatches"]


@dataclass(frozen=True)
class PackedBatches(torch.utils.data.Dataset):
    """Map-style dataset: `BatchKey` -> `PuzzletronBatch` of that key's items.

    With ``plan`` the items are the plan's rows (packs, ``packed_varlen``); without it they are samples (one
    per row, ``padded_varlen`` or ``fixed``; ``pad_to_multiple_of`` rounds the padded width up, see
    `build_batch`). A padding slot becomes a fully masked row. The batch's
    ``source_metadata`` records ``epoch``, ``step``, ``dp_rank``, ``padding`` and the ``items``.

    Batches pickle exactly, so DataLoader worker processes return them as they are: use
    ``DataLoader(dataset, sampler=sampler, batch_size=None, num_workers=k)`` (the default conversion of
    ``batch_size=None`` passes a `PuzzletronBatch` through unchanged).
    """

    samples: SampleSource
    spec: PuzzletronDataSpec
    plan: PackingPlan | None = None
    pad_token_id: int = 0
    pad_to_multiple_of: int = 1
    source_metadata: Mapping[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.plan.num_rows if self.plan is not None else len(self.samples)

    def rows(self, key: BatchKey) -> list[Sequence[int]]:
        """The sample indices of each row of ``key``'s batch (``()`` for a padding slot)."""
        if self.plan is not None:
            return [self.plan.row(i) if i >= 0 else () for i in key.indices]
        return [(i,) if i >= 0 else () for i in key.indices]

    def __getitem__(self, key: BatchKey) -> PuzzletronBatch:
        if not isinstance(key, BatchKey):
            raise TypeError(f"PackedBatches is indexed by BatchKey, got {type(key).__name__}")
        meta = {
            **self.source_metadata,
            "epoch": key.epoch,
            "step": key.step,
            "dp_rank": key.dp_rank,
            "padding": key.is_padding,
            "items": list(key.indices),
        }
        return build_batch(
            self.samples,
            self.rows(key),
            spec=self.spec,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
            source_metadata=meta,
            units=self.plan.units if self.plan is not None else None,
        )

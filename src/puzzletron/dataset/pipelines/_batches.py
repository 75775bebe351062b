"""What every pipeline returns: a plan, a keyed dataset and this rank's sampler, iterable as batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from puzzletron.dataset.batch import PuzzletronBatch
from puzzletron.dataset.distributed import DistributedPackSampler, PuzzletronDataLoader, batch_loader
from puzzletron.dataset.packing import PackingPlan

__all__ = ["RankBatches"]


@dataclass(frozen=True, eq=False)
class RankBatches:
    """One DP rank's batches: iterating yields the sampler's current epoch, one `PuzzletronBatch` a step.
    Call ``sampler.set_epoch(e)`` before each epoch; ``sampler.state_dict`` / ``load_state_dict`` resume.

    Attributes:
        plan: the packing plan (None: one sample per row, text).
        dataset: `BatchKey` -> `PuzzletronBatch`, the map-style dataset a DataLoader reads.
        sampler: this rank's `DistributedPackSampler` over the plan's rows (or samples).
    """

    plan: PackingPlan | None
    dataset: Any
    sampler: DistributedPackSampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[PuzzletronBatch]:
        return (self.dataset[key] for key in self.sampler)

    def for_rank(self, dp_rank: int) -> RankBatches:
        """The same plan dealt to another DP rank (a fresh sampler at epoch 0, same settings)."""
        return dataclasses.replace(self, sampler=self.sampler.for_rank(dp_rank))

    def loader(self, *, num_workers: int = 0) -> PuzzletronDataLoader:
        """A DataLoader yielding the same batches (`puzzletron.dataset.distributed.batch_loader`)."""
        return batch_loader(self, num_workers=num_workers)

"""The one DataLoader over keyed batches: `batch_loader(batches)` reads ``batches.dataset`` (a map from
`BatchKey` to `PuzzletronBatch`) in ``batches.sampler``'s order, one batch per step.

Its ``batch_sampler`` (`KeyBatchSampler`) yields ``[key]`` per step, so the loader's collate function gets
a list holding one built batch: by default the batch itself comes out (``[B, T]`` already); a client passes
its own ``collate_fn`` (the HF Trainer's turns a batch into a model's kwargs). Being a batch sampler also
lets ``accelerate.skip_first_batches`` (the HF Trainer's resume) skip keys without building their batches,
and `PuzzletronDataLoader.set_epoch` reaches the `DistributedPackSampler`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from puzzletron.dataset.batch import PuzzletronBatch
from puzzletron.dataset.distributed.sampler import BatchKey, DistributedPackSampler
from puzzletron.dataset.errors import ConfigError

__all__ = ["BatchSource", "KeyBatchSampler", "PuzzletronDataLoader", "batch_loader", "only_batch"]


class BatchSource(Protocol):
    """What a pipeline returns (`puzzletron.dataset.pipelines.text.TextBatches`): a map-style dataset
    indexed by `BatchKey` and this rank's `DistributedPackSampler`."""

    dataset: torch.utils.data.Dataset
    sampler: DistributedPackSampler


class KeyBatchSampler(torch.utils.data.Sampler[list[BatchKey]]):
    """A DataLoader ``batch_sampler`` over a `DistributedPackSampler`: ``[key]`` per step, ``len`` = steps;
    `set_epoch` forwards to the sampler."""

    def __init__(self, sampler: DistributedPackSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[BatchKey]]:
        return ([key] for key in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


class PuzzletronDataLoader(torch.utils.data.DataLoader):
    """A DataLoader whose `set_epoch` reaches the `DistributedPackSampler` (the HF Trainer calls it at every
    epoch start)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def only_batch(items: PuzzletronBatch | Sequence[PuzzletronBatch]) -> PuzzletronBatch:
    """The one `PuzzletronBatch` of a step (a DataLoader with a batch sampler passes a list holding it)."""
    if isinstance(items, PuzzletronBatch):
        return items
    if len(items) != 1 or not isinstance(items[0], PuzzletronBatch):
        raise ConfigError(
            f"collate takes one PuzzletronBatch per step, got {len(items)} items; use batch_loader (or a "
            "DataLoader with KeyBatchSampler or batch_size=None): a batch is already [B, T]"
        )
    return items[0]


def batch_loader(
    batches: BatchSource,
    *,
    collate_fn: Callable[[Sequence[PuzzletronBatch]], Any] = only_batch,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> PuzzletronDataLoader:
    """A `PuzzletronDataLoader` over ``batches.dataset`` in ``batches.sampler``'s order; each step yields
    ``collate_fn([batch])`` (default: the `PuzzletronBatch` itself). Batches pickle exactly, so worker
    processes (``num_workers``) return them as they are."""
    return PuzzletronDataLoader(
        batches.dataset,
        batch_sampler=KeyBatchSampler(batches.sampler),
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )

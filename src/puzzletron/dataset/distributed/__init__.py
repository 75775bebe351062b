"""Spreading the work over data-parallel ranks: the deal (`sampler`: packs to ranks per seed and epoch,
exactly once, resumable), the keyed dataset (`batches`), the one loader (`loader`; its workers hand batches
over through `transport` and keep their freed memory: `worker_memory`), the `torch.distributed` collectives
(`collectives`) and the end-to-end split check (`sharding`)."""

from __future__ import annotations

from puzzletron.dataset.distributed.batches import PackedBatches
from puzzletron.dataset.distributed.loader import (
    BatchSource,
    KeyBatchSampler,
    PuzzletronDataLoader,
    batch_loader,
    only_batch,
)
from puzzletron.dataset.distributed.sampler import (
    BatchKey,
    DistributedPackSampler,
    deal_epoch,
    steps_per_epoch,
)
from puzzletron.dataset.distributed.sharding import check_sharding
from puzzletron.dataset.distributed.worker_memory import keep_freed_memory

__all__ = [
    "BatchKey",
    "BatchSource",
    "DistributedPackSampler",
    "KeyBatchSampler",
    "PackedBatches",
    "PuzzletronDataLoader",
    "batch_loader",
    "check_sharding",
    "deal_epoch",
    "keep_freed_memory",
    "only_batch",
    "steps_per_epoch",
]

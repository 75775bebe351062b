"""The one DataLoader over keyed batches: `batch_loader(batches)` reads ``batches.dataset`` (a map from
`BatchKey` to `PuzzletronBatch`) in ``batches.sampler``'s order, one batch per step.

Its ``batch_sampler`` (`KeyBatchSampler`) yields ``[key]`` per step, so the loader's collate function gets
a list holding one built batch: by default the batch itself comes out (``[B, T]`` already); a client passes
its own ``collate_fn`` (the HF Trainer's turns a batch into a model's kwargs). Being a batch sampler also
lets ``accelerate.skip_first_batches`` (the HF Trainer's resume) skip keys without building their batches,
and `PuzzletronDataLoader.set_epoch` reaches the `DistributedPackSampler`.

A batch that fails to build is a `BatchError`, one line naming the batch (epoch, step, data-parallel rank)
and the original error's type and message, in a worker process as in this one. Without this, torch
re-raises a worker's error as its type with the worker's whole traceback in the message (23 lines for one
`SnapshotError`); here the traceback stays available (``worker_traceback``, and the exception's
``__cause__``, which a printed traceback shows) but the message is what a command line prints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from puzzletron.dataset.batch import PuzzletronBatch
from puzzletron.dataset.distributed.sampler import BatchKey, DistributedPackSampler
from puzzletron.dataset.distributed.transport import place_in_segments, shared_collate
from puzzletron.dataset.distributed.worker_memory import keep_freed_memory
from puzzletron.dataset.errors import ConfigError, PuzzletronDataError

__all__ = [
    "BatchError",
    "BatchSource",
    "KeyBatchSampler",
    "PuzzletronDataLoader",
    "WorkerTraceback",
    "batch_loader",
    "init_worker",
    "only_batch",
]

_CAUGHT = "Caught BatchError "  # how torch's ExceptionWrapper starts a worker's error re-raised here


class WorkerTraceback(Exception):
    """The traceback of an error raised in a DataLoader worker process (text: the frames are gone)."""


class BatchError(PuzzletronDataError):
    """A batch could not be built: ``batch (epoch E, step S, dp rank R): SnapshotError: ...``, one line.
    ``worker_traceback`` holds a worker's traceback (None in this process: the cause is the original error).

    torch re-creates a worker's exception in this process as ``type(exc)(text)`` where `text` is its
    whole traceback; this class takes that text apart: the message is its last line, the rest the
    ``worker_traceback`` (also the ``__cause__``)."""

    def __init__(self, message: str, worker_traceback: str | None = None) -> None:
        if message.startswith(_CAUGHT) and worker_traceback is None:
            worker_traceback = message
            where = message[len(_CAUGHT) : message.find(".\n")]
            last = [line for line in message.splitlines() if "BatchError: " in line]
            message = (
                last[-1].split("BatchError: ", 1)[1] if last else message.splitlines()[0]
            ) + f" ({where})"
        super().__init__(message)
        self.worker_traceback = worker_traceback
        if worker_traceback is not None:
            self.__cause__ = WorkerTraceback(worker_traceback)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.worker_traceback))


def _describe(key: Any) -> str:
    if isinstance(key, BatchKey):
        return f"batch (epoch {key.epoch}, step {key.step}, dp rank {key.dp_rank})"
    return f"batch {key!r:.120}"


class _Named(torch.utils.data.Dataset):
    """``dataset[key]``, a failure raised as a `BatchError` naming the key (and chained to the original)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitem__(self, key: Any) -> Any:
        try:
            return self.dataset[key]
        except Exception as exc:
            text = " ".join(str(exc).split()) or "(no message)"
            raise BatchError(f"{_describe(key)}: {type(exc).__name__}: {text}") from exc

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


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
    ``collate_fn([batch])`` (default: the `PuzzletronBatch` itself). Worker processes (``num_workers``)
    hand it over with every tensor in one shared-memory segment (`transport.shared_collate`; its pixels built
    there), and keep the memory they free for the next batch (`init_worker`). A batch that fails is a
    `BatchError` (module docstring); the loader's ``dataset`` is ``batches.dataset`` behind the wrapper that
    names it."""
    return PuzzletronDataLoader(
        _Named(batches.dataset),
        batch_sampler=KeyBatchSampler(batches.sampler),
        collate_fn=shared_collate(collate_fn) if num_workers > 0 else collate_fn,
        num_workers=num_workers,
        pin_memory=pin_memory,
        worker_init_fn=init_worker if num_workers > 0 else None,
    )


def init_worker(worker_id: int | None = None) -> None:
    """What each `batch_loader` worker runs first: it keeps the memory it frees
    (`worker_memory.keep_freed_memory`) and builds a batch's large tensors where they cross to the trainer
    (`transport.place_in_segments`)."""
    keep_freed_memory(worker_id)
    place_in_segments(worker_id)

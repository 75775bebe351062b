"""`batch_loader`: a batch that fails to build reaches the caller as one line naming the batch and the
original error's type and message, from a worker process as from this one; the worker's traceback stays
available (``worker_traceback``, the ``__cause__``) and a batch that does build is served as it is."""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from puzzletron.dataset.distributed import DistributedPackSampler, batch_loader
from puzzletron.dataset.distributed.loader import BatchError, WorkerTraceback
from puzzletron.dataset.errors import SnapshotError


class _Steps(torch.utils.data.Dataset):
    """A batch per key: its step, and a damaged store at step 2."""

    def __getitem__(self, key: Any) -> dict[str, int]:
        if key.step == 2:
            raise SnapshotError("s3://bkt/pk: shards/000001.tokens: bytes 0..65536 (block 0) do not match")
        return {"step": key.step}


@dataclass
class _Source:
    dataset: torch.utils.data.Dataset
    sampler: DistributedPackSampler


def _loader(num_workers: int) -> torch.utils.data.DataLoader:
    sampler = DistributedPackSampler(8, batch_size=2, dp_rank=0, dp_size=1, seed=0)
    source = _Source(_Steps(), sampler)
    return batch_loader(source, collate_fn=lambda items: items[0], num_workers=num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_that_fails_is_one_line_naming_it_and_the_original_error(num_workers: int) -> None:
    served = []
    with pytest.raises(BatchError) as caught:
        for batch in _loader(num_workers):
            served.append(batch["step"])
    said = str(caught.value)
    assert "\n" not in said and "Traceback" not in said, said
    assert said.startswith("batch (epoch 0, step 2, dp rank 0): SnapshotError: s3://bkt/pk: shards/000001")
    assert served == [0, 1]  # the batches before it came through
    if num_workers:
        assert said.endswith("(in DataLoader worker process 0)")
        assert isinstance(caught.value.__cause__, WorkerTraceback)
        assert 'raise SnapshotError("s3://bkt/pk' in caught.value.worker_traceback  # the frames, as text
    else:
        assert isinstance(caught.value.__cause__, SnapshotError) and caught.value.worker_traceback is None
    printed = "".join(traceback.format_exception(caught.value))  # what an uncaught error prints: both
    assert "raise SnapshotError" in printed and printed.rstrip().endswith(said)
    again = pickle.loads(pickle.dumps(caught.value))
    assert str(again) == said and again.worker_traceback == caught.value.worker_traceback

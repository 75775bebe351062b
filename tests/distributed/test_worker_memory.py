"""`keep_freed_memory`: a process that frees and allocates the same large buffers again (a worker's batch
after batch) reuses their pages instead of faulting fresh ones in, and every `batch_loader` worker runs it
while the main process's allocator is left as it was."""

from __future__ import annotations

import resource
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from puzzletron.dataset.distributed import DistributedPackSampler, batch_loader

# Two 24 MiB buffers a round, allocated, written whole (ctypes zeroes them) and freed; the minor page
# faults of rounds 1..5. glibc maps blocks this large and unmaps them on free, so by default every round
# faults its 2 * 6,144 pages in again.
_ROUNDS = """
import ctypes, resource, sys
from puzzletron.dataset.distributed.worker_memory import keep_freed_memory

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

if sys.argv[1] == "keep":
    assert keep_freed_memory()
for i in range(6):
    if i == 1:
        start = faults()
    a, b = ctypes.create_string_buffer(24 << 20), ctypes.create_string_buffer(24 << 20)
    del a, b
print(faults() - start)
"""
_PAGES = 5 * 2 * (24 << 20) // resource.getpagesize()


def _faults_of_rounds(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_process_that_keeps_freed_memory_reuses_the_pages_of_the_buffers_it_freed() -> None:
    assert _faults_of_rounds("plain") >= _PAGES // 2  # the default: fresh pages every round
    assert _faults_of_rounds("keep") <= _PAGES // 100


class _Faults(torch.utils.data.Dataset):
    """Per key: the minor faults of two rounds of the buffers above, in the process that builds it."""

    def __getitem__(self, key: Any) -> int:
        import ctypes

        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(2):
            a, b = ctypes.create_string_buffer(24 << 20), ctypes.create_string_buffer(24 << 20)
            del a, b
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start


@dataclass
class _Source:
    dataset: torch.utils.data.Dataset
    sampler: DistributedPackSampler


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_every_batch_loader_worker_keeps_its_freed_memory() -> None:
    sampler = DistributedPackSampler(6, batch_size=1, dp_rank=0, dp_size=1, seed=0)
    loader = batch_loader(_Source(_Faults(), sampler), collate_fn=lambda items: items[0], num_workers=2)
    faults = list(loader)
    assert len(faults) == 6
    # each worker's first key faults its buffers in once; every later key reuses them
    assert sum(f <= _PAGES // 100 for f in faults) >= 4
    assert batch_loader(_Source(_Faults(), sampler), num_workers=0).worker_init_fn is None

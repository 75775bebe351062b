"""A DataLoader worker keeps the memory it frees, so each batch reuses the pages the one before faulted in.

A worker builds batches of the same shape again and again: decoded images, resized images, a pack's
``pixel_values`` (tens of MB), all freed once the batch is handed over. glibc's malloc returns such memory
to the kernel (large blocks are ``mmap``-ed and unmapped on free; the top of the heap is trimmed past
``M_TRIM_THRESHOLD``), so the next batch takes a page fault and a zeroed page for every 4 KiB it touches.
Measured on the VLM benchmark subset at pack 8192 (``benchmarks/bench_vlm_cpu.py``): 96-150 minor faults
per 1,000 tokens in a bfloat16 worker, 310-520 in a decoded-image one, and about a tenth of their CPU; with
freed memory kept, 72-85 and 7 (a block over 32 MiB, a pack's whole ``pixel_values``, is still mapped
afresh).

`keep_freed_memory()` sets, for the calling process only, ``M_MMAP_THRESHOLD`` to 32 MiB (glibc's largest:
blocks up to it come from the heap, and so are reused) and ``M_TRIM_THRESHOLD`` to 1 GiB (the heap is not
trimmed). A worker's memory then stays at its peak, which it reaches every batch anyway. `batch_loader`
runs it in every worker it starts; a DataLoader of one's own can pass it as ``worker_init_fn``. The main
process is left alone: its allocator is the caller's. Where the C library has no ``mallopt`` (not glibc)
it does nothing.
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

MMAP_THRESHOLD = 32 << 20  # bytes; glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30  # bytes of free heap top kept (mallopt takes an int)
_M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(worker_id: int | None = None) -> bool:
    """Keep this process's freed memory for reuse (module docstring); whether the allocator took both
    settings (False without glibc's ``mallopt``). `worker_id` is ignored: a DataLoader's
    ``worker_init_fn`` passes it."""
    del worker_id
    try:
        mallopt: Any = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    trim_ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return mmap_ok and trim_ok

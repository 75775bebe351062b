"""Run tasks in worker processes, results in task order (tokenising row ranges, building store shards).

Workers die with their parent: on Linux each asks the kernel for SIGKILL when the process that started it
exits (``PR_SET_PDEATHSIG``), and one whose parent is already gone exits at once; so a parent killed by
``kill`` or the OOM killer leaves no worker behind. Workers never hold the parent's destination locks
(`puzzletron.dataset.storage.atomic` closes them in every forked child).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any

__all__ = ["map_tasks"]

_WORKER: dict[str, Any] = {}  # a pool worker's task function and context (set by its initializer)


@contextmanager
def _serial_tokenizers() -> Iterator[None]:
    """``TOKENIZERS_PARALLELISM=false`` while worker processes start: one core each, and no warning from
    tokenizers about forking after its thread pool ran (what `datasets.map` does too)."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Ask for SIGKILL when the parent exits (Linux); exit now if it is gone already."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no prctl in this libc: the check below runs
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(1)


def _pool_init(fn: Callable[[Any, Any], Any], context: Any, parent: int) -> None:
    _die_with_parent(parent)
    _WORKER["fn"], _WORKER["context"] = fn, context


def _pool_call(task: Any) -> Any:
    return _WORKER["fn"](_WORKER["context"], task)


def map_tasks(
    fn: Callable[[Any, Any], Any], context: Any, tasks: Sequence[Any], *, num_proc: int
) -> Iterator[Any]:
    """``fn(context, task)`` for every task, results in task order: in this process when ``num_proc`` is 1,
    else in ``num_proc`` worker processes (forked where the platform can, so `context` -- a dataset, a
    tokenizer -- is inherited, not pickled; each worker gets it once). A worker's error is re-raised here
    and the tasks not started are cancelled."""
    if num_proc <= 1 or len(tasks) <= 1:
        yield from (fn(context, task) for task in tasks)
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with _serial_tokenizers():
        pool = ProcessPoolExecutor(
            min(num_proc, len(tasks)),
            mp_context=ctx,
            initializer=_pool_init,
            initargs=(fn, context, os.getpid()),
        )
        try:
            yield from pool.map(_pool_call, tasks)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)

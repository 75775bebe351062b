"""Run tasks in worker processes, results in task order (tokenising row ranges, building store shards).

Workers die with their parent: on Linux each asks the kernel for SIGKILL when the process that started it
exits (``PR_SET_PDEATHSIG``), and one whose parent is already gone exits at once; so a parent killed by
``kill`` or the OOM killer leaves no worker behind. Workers never hold the parent's destination locks
(`puzzletron.dataset.storage.atomic` closes them in every forked child).

A task reports its progress as it goes with `advance(n)` (rows, say): in this process it reaches
`map_tasks`' ``progress`` at once; in a worker it adds to a shared counter that the parent reads while it
waits for results (a few times a second), so progress moves within a long task, not only when one ends.
"""

from __future__ import annotations

import concurrent.futures
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

__all__ = ["advance", "map_tasks"]

_WORKER: dict[str, Any] = {}  # a pool worker's task function, context and progress counter (initializer)
_LOCAL: dict[str, Any] = {}  # this process's progress callback while `map_tasks` runs tasks here
_POLL_S = 0.25  # how often the parent reads the workers' progress counter while it waits


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


def advance(n: int) -> None:
    """Report ``n`` more units of work done by the running task to `map_tasks`' ``progress`` (a no-op
    outside `map_tasks` or without ``progress``)."""
    counter = _WORKER.get("counter")
    if counter is not None:
        with counter.get_lock():
            counter.value += n
    elif _LOCAL.get("progress") is not None:
        _LOCAL["progress"](n)


def _pool_init(fn: Callable[[Any, Any], Any], context: Any, counter: Any, parent: int) -> None:
    _die_with_parent(parent)
    _WORKER.update(fn=fn, context=context, counter=counter)


def _pool_call(task: Any) -> Any:
    return _WORKER["fn"](_WORKER["context"], task)


@contextmanager
def _local_progress(progress: Callable[[int], None] | None) -> Iterator[None]:
    previous = _LOCAL.get("progress")
    _LOCAL["progress"] = progress
    try:
        yield
    finally:
        _LOCAL["progress"] = previous


def _in_order(futures: list[Any], counter: Any, progress: Callable[[int], None] | None) -> Iterator[Any]:
    """The futures' results in order; while waiting, the counter's growth goes to ``progress``."""
    seen = 0
    for future in futures:
        while True:
            try:
                result = future.result(timeout=_POLL_S if progress is not None else None)
            except concurrent.futures.TimeoutError:
                result, waiting = None, True
            else:
                waiting = False
            if progress is not None:
                now = counter.value
                if now > seen:
                    progress(now - seen)
                    seen = now
            if not waiting:
                break
        yield result


def map_tasks(
    fn: Callable[[Any, Any], Any],
    context: Any,
    tasks: Sequence[Any],
    *,
    num_proc: int,
    progress: Callable[[int], None] | None = None,
) -> Iterator[Any]:
    """``fn(context, task)`` for every task, results in task order: in this process when ``num_proc`` is 1,
    else in ``num_proc`` worker processes (forked where the platform can, so `context` -- a dataset, a
    tokenizer -- is inherited, not pickled; each worker gets it once). A worker's error is re-raised here
    and the tasks not started are cancelled. ``progress(n)`` receives what the tasks report with `advance`,
    in this process (at most every 0.25 s from workers)."""
    if num_proc <= 1 or len(tasks) <= 1:
        with _local_progress(progress):
            for task in tasks:
                yield fn(context, task)
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    counter = ctx.Value("q", 0)
    with _serial_tokenizers():
        pool = ProcessPoolExecutor(
            min(num_proc, len(tasks)),
            mp_context=ctx,
            initializer=_pool_init,
            initargs=(fn, context, counter, os.getpid()),
        )
        try:
            yield from _in_order([pool.submit(_pool_call, task) for task in tasks], counter, progress)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)

"""Run tasks in worker processes, results in task order (tokenising row ranges, building store shards)."""

from __future__ import annotations

import multiprocessing
import os
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


def _pool_init(fn: Callable[[Any, Any], Any], context: Any) -> None:
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
            min(num_proc, len(tasks)), mp_context=ctx, initializer=_pool_init, initargs=(fn, context)
        )
        try:
            yield from pool.map(_pool_call, tasks)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)

"""The few `torch.distributed` collectives the library uses, with errors that name the failing rank.

`process_group` finds the group the caller's code created (nothing here imports torch for that); a command
line started by a launcher (``torchrun``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in its
environment) creates one with `launched_group`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

__all__ = [
    "LAUNCHER_VARIABLES",
    "all_gather",
    "broadcast",
    "describe",
    "launched_group",
    "process_group",
    "raise_first",
]


def process_group() -> Any:
    """`torch.distributed` when a process group is initialised (torch already imported), else None."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def launched_group(*, backend: str = "gloo", timeout_s: float = 24 * 3600) -> Iterator[Any]:
    """A process group from a launcher's environment for the duration of the block: `torch.distributed`
    (initialised here, destroyed on exit) when ``WORLD_SIZE`` > 1, else None (one process). An already
    initialised group is used as it is. ``timeout_s`` bounds every collective: a rank may wait for the
    others' shards that long (a store build of many hours, hence the generous default)."""
    dist = process_group()
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if dist is not None or world <= 1:
        yield dist
        return
    missing = [name for name in LAUNCHER_VARIABLES if not os.environ.get(name)]
    if missing:
        from puzzletron.dataset.errors import ConfigError

        raise ConfigError(
            f"WORLD_SIZE={world} but the launcher did not set {', '.join(missing)} (use torchrun)"
        )
    import torch.distributed

    torch.distributed.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        yield torch.distributed
    finally:
        torch.distributed.destroy_process_group()


def all_gather(dist: Any, value: Any) -> list[Any]:
    """Every rank's `value` (picklable), in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def broadcast(dist: Any, value: Any, *, src: int = 0) -> Any:
    """Rank `src`'s `value` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def describe(error: BaseException | None) -> str | None:
    """What a rank sends the others about its failure (None: it did not fail)."""
    return None if error is None else f"{type(error).__name__}: {error}"


def raise_first(
    errors: list[str | None], own: BaseException | None, what: str, *, error: type[Exception]
) -> None:
    """Raise on every rank when any rank failed: its own error where it failed, else `error` naming the
    first rank that did (``errors``: every rank's `describe`)."""
    if own is not None:
        raise own
    for rank, message in enumerate(errors):
        if message is not None:
            raise error(f"rank {rank} failed {what}: {message}")

"""The few `torch.distributed` collectives the library uses, with errors that name the failing rank.

Nothing here imports torch: a process group exists only where the caller's code (or a launcher) created
one, so `process_group` looks for an initialised one in the already-imported ``torch.distributed``.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["all_gather", "broadcast", "describe", "process_group", "raise_first"]


def process_group() -> Any:
    """`torch.distributed` when a process group is initialised (torch already imported), else None."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


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

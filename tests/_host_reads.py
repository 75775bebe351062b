"""Counting the torch calls that read tensor values into Python (on an accelerator, a device-to-host sync),
on the CPU: `HostReads` records them as they run, `host_reads(fn)` lists those of one call."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostReads", "host_reads"]


class HostReads(TorchFunctionMode):
    """Records every torch call that reads tensor values into Python, which on an accelerator is a
    device-to-host sync: ``bool``/``int``/``item``/``tolist``/``cpu``/..., and ops whose output size depends
    on the data (``nonzero``, boolean-mask indexing, ...). A measurement, not a mock: every call runs."""

    READS = frozenset(
        {
            "__bool__", "__int__", "__float__", "__index__", "__complex__", "__array__", "__repr__",
            "__format__", "__contains__", "item", "tolist", "numpy", "cpu", "equal", "allclose",
            "is_nonzero", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
        }
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        data_sized = (name in ("__getitem__", "__setitem__") and _has_bool_index(args[1])) or (
            name == "repeat_interleave" and "output_size" not in kwargs
        )
        if name in self.READS or data_sized:
            self.reads.append(name)
        return func(*args, **kwargs)


def _has_bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def host_reads(fn: Any) -> list[str]:
    with HostReads() as mode:
        fn()
    return mode.reads

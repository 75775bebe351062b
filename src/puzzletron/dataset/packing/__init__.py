"""Packing samples into rows: the planner (`plan_packing`, pure, over lengths), the sample sources
(`puzzletron.dataset.packing.sources`: in memory or read from a token store) and the builder
(`build_batch`, rows of samples -> a `PuzzletronBatch` in the spec's layout).

The sources and the builder are imported on first use (PEP 562), so planning alone never loads torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from puzzletron.dataset.errors import PackingError
from puzzletron.dataset.packing._plan import IndexSequence, PackingPlan, plan_packing
from puzzletron.dataset.packing._units import Units

if TYPE_CHECKING:
    from puzzletron.dataset.packing._build import build_batch
    from puzzletron.dataset.packing.sources import (
        SampleSource,
        StoreNames,
        StoreSamples,
        TokenizedSamples,
        labels_from_mask,
        shift_labels,
    )

__all__ = [
    "IndexSequence",
    "PackingError",
    "PackingPlan",
    "SampleSource",
    "StoreNames",
    "StoreSamples",
    "TokenizedSamples",
    "Units",
    "build_batch",
    "labels_from_mask",
    "plan_packing",
    "shift_labels",
]

# name -> the module that defines it (imported on first use: both import torch)
_LAZY = {
    "build_batch": "_build",
    **dict.fromkeys(("SampleSource", "StoreNames", "StoreSamples", "TokenizedSamples"), "sources"),
    **dict.fromkeys(("labels_from_mask", "shift_labels"), "sources"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value

"""Packing text samples into rows: the planner (`plan_packing`, pure, over lengths) and the builder
(`build_batch`, rows of tokenised samples -> a `PuzzletronBatch` in the spec's layout).

The builder is imported on first use (PEP 562), so planning alone never loads torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from puzzletron.dataset.errors import PackingError
from puzzletron.dataset.packing._plan import PackingPlan, plan_packing
from puzzletron.dataset.packing._units import Units

if TYPE_CHECKING:
    from puzzletron.dataset.packing._build import SampleSource, TokenizedSamples, build_batch

__all__ = [
    "PackingError",
    "PackingPlan",
    "SampleSource",
    "TokenizedSamples",
    "Units",
    "build_batch",
    "plan_packing",
]

_LAZY = {"SampleSource", "TokenizedSamples", "build_batch"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}._build"), name)
    globals()[name] = value
    return value

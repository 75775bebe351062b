"""Packing samples into rows: the planner (`plan_packing`, pure, over lengths; `media.plan_vlm` for
multimodal samples, never cutting an image), the media-balanced deal of packs to steps and ranks
(`balance.balanced_deal`), the multimodal position ids (`mrope.mrope_ids`), the sample
sources (`puzzletron.dataset.packing.sources`: in memory or read from a token store) and the builder
(`build_batch`, rows of samples -> a `PuzzletronBatch` in the spec's layout).

The sources and the builder are imported on first use (PEP 562), so planning alone never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from puzzletron.dataset._checks import lazy_attribute
from puzzletron.dataset.errors import PackingError
from puzzletron.dataset.packing._plan import IndexSequence, PackingPlan, plan_packing
from puzzletron.dataset.packing._units import Units
from puzzletron.dataset.packing.balance import balance_report, balanced_deal
from puzzletron.dataset.packing.media import plan_vlm, row_sums
from puzzletron.dataset.packing.mrope import mrope_ids

if TYPE_CHECKING:
    from puzzletron.dataset.packing._build import Spans, build_batch, build_spans
    from puzzletron.dataset.packing.sources import (
        ConcatSamples,
        SampleSource,
        StoreNames,
        StoreSamples,
        TokenizedSamples,
        labels_from_mask,
        shift_labels,
    )

__all__ = [
    "ConcatSamples",
    "IndexSequence",
    "PackingError",
    "PackingPlan",
    "SampleSource",
    "Spans",
    "StoreNames",
    "StoreSamples",
    "TokenizedSamples",
    "Units",
    "balance_report",
    "balanced_deal",
    "build_batch",
    "build_spans",
    "labels_from_mask",
    "mrope_ids",
    "plan_packing",
    "plan_vlm",
    "row_sums",
    "shift_labels",
]

# name -> the module that defines it (imported on first use: both import torch)
_LAZY = {
    **dict.fromkeys(("Spans", "build_batch", "build_spans"), "_build"),
    **dict.fromkeys(
        ("ConcatSamples", "SampleSource", "StoreNames", "StoreSamples", "TokenizedSamples"), "sources"
    ),
    **dict.fromkeys(("labels_from_mask", "shift_labels"), "sources"),
}


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name, globals())

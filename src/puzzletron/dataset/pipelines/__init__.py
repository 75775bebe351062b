"""Pipelines: a source (snapshot, subset or store) and a `PuzzletronDataSpec` -> one DP rank's batches.

`text` (`build_batches`): a text snapshot or token store -> packed / padded / fixed text batches;
`vlm` (`build_vlm_batches`): a conversation subset or VLM store -> multimodal batches with pixels, grids and
multi-axis position ids; `mixture` (`build_mixture_batches`): several of those as one token-weighted
stream. All return a `RankBatches` (plan, keyed dataset, this rank's sampler).
"""

from __future__ import annotations

from puzzletron.dataset.pipelines._batches import RankBatches
from puzzletron.dataset.pipelines.mixture import MixtureRankBatches, build_mixture_batches
from puzzletron.dataset.pipelines.text import TextBatches, build_batches
from puzzletron.dataset.pipelines.vlm import VlmBatches, build_vlm_batches

__all__ = [
    "MixtureRankBatches",
    "RankBatches",
    "TextBatches",
    "VlmBatches",
    "build_batches",
    "build_mixture_batches",
    "build_vlm_batches",
]

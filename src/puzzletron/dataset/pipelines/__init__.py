"""Pipelines: a source (snapshot, subset or store) and a `PuzzletronDataSpec` -> one DP rank's batches.

`text` (`build_batches`): a text snapshot or token store -> packed / padded / fixed text batches.
"""

from __future__ import annotations

from puzzletron.dataset.pipelines.text import TextBatches, build_batches

__all__ = ["TextBatches", "build_batches"]

"""A token store read as a `SampleSource`: what `build_batch` needs, read from disk one batch at a time.

Planning reads only ``lengths`` (a memory map of ``[n]`` uint32); a batch reads the token ranges of its
samples (positional reads) and derives their labels from the stored assistant mask as tokenisation does
(`puzzletron.dataset.tokenize.labels_from_mask`). A span that stops inside its sample reads one token more,
so its last label is the true next-token label, exactly like the in-memory `TokenizedSamples`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from puzzletron.dataset.formats.token_store import TokenStore
from puzzletron.dataset.packing._build import ragged
from puzzletron.dataset.tokenize import labels_from_mask

__all__ = ["StoreNames", "StoreSamples"]


@dataclass(frozen=True, eq=False)
class StoreSamples:
    """The samples of a `TokenStore` as a `puzzletron.dataset.packing.SampleSource`."""

    store: TokenStore

    @property
    def lengths(self) -> np.ndarray:
        return self.store.lengths

    def __len__(self) -> int:
        return len(self.store)

    def names(self, indices: np.ndarray) -> list[str]:
        return self.store.sample_ids(indices)

    def gather(
        self, indices: np.ndarray, starts: np.ndarray, takes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        first = self.store.offsets[indices] + starts
        stop = np.minimum(first + takes + 1, self.store.offsets[indices + 1])  # one past, inside the sample
        ids, mask = self.store.read(first, stop)
        read = stop - first  # [k] takes[k], or takes[k] + 1 where the sample goes on
        offsets = np.zeros(read.shape[0] + 1, dtype=np.int64)
        np.cumsum(read, out=offsets[1:])
        labels = labels_from_mask(ids, mask, offsets)
        span, position = ragged(read)
        keep = position < takes[span]
        return ids[keep], labels[keep]


@dataclass(frozen=True, eq=False)
class StoreNames(Sequence[str]):
    """The sample ids of a store as a lazy sequence (the planner names a sample only in an error)."""

    store: TokenStore

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        return self.store.sample_ids(np.array([index]))[0]

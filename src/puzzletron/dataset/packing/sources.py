"""The samples `build_batch` packs, behind one protocol: in memory, or read from a token store.

`SampleSource` is what the builder reads: per-sample ``lengths`` (what the planner sees), names, and a
`gather` of token spans with their shifted labels. Two sources, side by side:

- `TokenizedSamples`: every sample flat in memory (ids, shifted labels, offsets), from in-memory
  tokenisation;
- `StoreSamples`: a token store (`puzzletron.dataset.formats.token_store`) read one batch at a time: planning
  reads only ``lengths`` (a memory map of ``[n]`` uint32); a batch reads the token ranges of its samples
  (positional reads) and derives their labels from the stored assistant mask with `labels_from_mask`, as
  tokenisation does. A span that stops inside its sample reads one token more, so its last label is the
  true next-token label, exactly like `TokenizedSamples`.

Labels are shifted (AutoModel's convention): ``labels[t]`` is the target of ``input_ids[t]``, i.e. the next
token where it is supervised, ``-100`` elsewhere and at every sample's last token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from puzzletron.dataset.batch import IGNORE_INDEX
from puzzletron.dataset.errors import PackingError
from puzzletron.dataset.formats.token_store import TokenStore

__all__ = [
    "ConcatSamples",
    "SampleSource",
    "StoreNames",
    "StoreSamples",
    "TokenizedSamples",
    "labels_from_mask",
    "ragged",
    "shift_labels",
]


def shift_labels(input_ids: np.ndarray, supervised: np.ndarray) -> np.ndarray:
    """``[T]`` labels: ``input_ids[t + 1]`` where ``supervised[t + 1]``, else -100 (always at the end)."""
    labels = np.full(input_ids.shape, IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = np.where(supervised[1:], input_ids[1:], IGNORE_INDEX)
    return labels


def labels_from_mask(input_ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """`shift_labels` of many samples at once: flat int64 ``[N]`` labels of flat ``input_ids`` / ``mask``
    ``[N]`` cut by ``offsets`` ``[n + 1]`` (no target crosses from one sample into the next)."""
    labels = shift_labels(np.asarray(input_ids, dtype=np.int64), np.asarray(mask, dtype=bool))
    ends = np.asarray(offsets[1:])[np.diff(offsets) > 0] - 1
    labels[ends] = IGNORE_INDEX
    return labels


class SampleSource(Protocol):
    """Tokenised samples as `build_batch` reads them."""

    @property
    def lengths(self) -> np.ndarray:
        """``[n]`` tokens per sample."""
        ...

    def __len__(self) -> int: ...

    def names(self, indices: np.ndarray) -> list[str]:
        """The sample ids of ``indices``."""
        ...

    def gather(
        self, indices: np.ndarray, starts: np.ndarray, takes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, labels)`` int64 of tokens ``[starts[k], starts[k] + takes[k])`` of sample
        ``indices[k]``, concatenated. Labels are shifted and true: a span that stops inside its sample keeps
        the label of its last token (the next token's id where supervised)."""
        ...


@dataclass(frozen=True, eq=False)
class TokenizedSamples:
    """Tokenised samples, flat: sample ``i`` is ``input_ids[offsets[i]:offsets[i + 1]]``.

    ``labels`` are already shifted (``labels[t]`` is the target of ``input_ids[t]``, i.e. the next token
    where supervised) and ``-100`` elsewhere; the last token of every sample is ``-100`` (no target crosses
    a document boundary). Arrays are read-only ``int64``: ``input_ids``/``labels`` ``[total_tokens]``,
    ``offsets`` ``[n + 1]``.
    """

    input_ids: np.ndarray = field(repr=False)
    labels: np.ndarray = field(repr=False)
    offsets: np.ndarray = field(repr=False)
    sample_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        ids, labels, offsets = (
            np.asarray(a, dtype=np.int64) for a in (self.input_ids, self.labels, self.offsets)
        )
        n = offsets.shape[0] - 1
        if ids.ndim != 1 or labels.shape != ids.shape:
            raise PackingError(
                f"input_ids and labels must be 1-D and equal, got {ids.shape} and {labels.shape}"
            )
        if n < 0 or offsets[0] != 0 or offsets[-1] != ids.shape[0] or np.any(np.diff(offsets) <= 0):
            raise PackingError("offsets must start at 0, increase strictly and end at the token count")
        if len(self.sample_ids) != n:
            raise PackingError(f"sample_ids has {len(self.sample_ids)} entries for {n} samples")
        open_ends = np.flatnonzero(labels[offsets[1:] - 1] != IGNORE_INDEX)
        if open_ends.size:
            i = int(open_ends[0])
            raise PackingError(
                f"labels of sample {i} ({self.sample_ids[i]!r}) end with a target; the last token of a "
                "sample must be -100 (labels are shifted: nothing follows it)"
            )
        for name, arr in (("input_ids", ids), ("labels", labels), ("offsets", offsets)):
            arr = arr.copy() if arr is getattr(self, name) else arr
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "sample_ids", tuple(str(s) for s in self.sample_ids))

    @classmethod
    def from_lists(
        cls,
        input_ids: Sequence[Sequence[int]],
        labels: Sequence[Sequence[int]],
        *,
        sample_ids: Sequence[str] | None = None,
    ) -> TokenizedSamples:
        """Build from per-sample token lists (``labels`` already shifted, same lengths)."""
        if len(labels) != len(input_ids):
            raise PackingError(f"{len(labels)} label lists for {len(input_ids)} samples")
        lengths = np.fromiter((len(x) for x in input_ids), dtype=np.int64, count=len(input_ids))
        bad = np.flatnonzero(
            lengths != np.fromiter((len(x) for x in labels), dtype=np.int64, count=len(labels))
        )
        if bad.size:
            raise PackingError(f"sample {int(bad[0])}: labels and input_ids differ in length")
        flat = np.fromiter((t for x in input_ids for t in x), dtype=np.int64, count=int(lengths.sum()))
        flat_labels = np.fromiter((t for x in labels for t in x), dtype=np.int64, count=int(lengths.sum()))
        ids = tuple(sample_ids) if sample_ids is not None else tuple(str(i) for i in range(len(input_ids)))
        return cls(flat, flat_labels, np.concatenate([[0], np.cumsum(lengths)]), ids)

    def __len__(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def lengths(self) -> np.ndarray:
        """``[n]`` tokens per sample."""
        return np.diff(self.offsets)

    def names(self, indices: np.ndarray) -> list[str]:
        return [self.sample_ids[i] for i in indices.tolist()]

    def gather(
        self, indices: np.ndarray, starts: np.ndarray, takes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        slot, position = ragged(takes)
        src = (self.offsets[indices] + starts)[slot] + position
        return self.input_ids[src], self.labels[src]


def ragged(takes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For spans of ``takes`` ``[k]`` tokens laid end to end: each token's span and its position in it.

    >>> [a.tolist() for a in ragged(np.array([2, 3]))]
    [[0, 0, 1, 1, 1], [0, 1, 0, 1, 2]]
    """
    slot = np.repeat(np.arange(takes.shape[0], dtype=np.int64), takes)
    before = np.cumsum(takes) - takes  # [k] first output token of each span
    return slot, np.arange(slot.shape[0], dtype=np.int64) - before[slot]


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


@dataclass(frozen=True, eq=False)
class ConcatSamples:
    """Several `SampleSource` s as one: sample ``i`` of source ``c`` is sample ``offsets[c] + i`` (a mixture's
    batch reads the rows of all its components through one gather)."""

    sources: tuple[SampleSource, ...]
    offsets: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        sizes = [len(s) for s in self.sources]
        object.__setattr__(self, "offsets", np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def lengths(self) -> np.ndarray:
        """``[n]`` tokens per sample, every source's (a copy: for small inputs and tests)."""
        return np.concatenate([np.asarray(s.lengths, dtype=np.int64) for s in self.sources])

    def split(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The source of each global sample index and its index there."""
        source = np.searchsorted(self.offsets, indices, side="right") - 1
        return source, indices - self.offsets[source]

    def names(self, indices: np.ndarray) -> list[str]:
        source, local = self.split(np.asarray(indices, dtype=np.int64))
        out: list[str] = [""] * source.shape[0]
        for c in np.unique(source).tolist():
            at = np.flatnonzero(source == c)
            for k, name in zip(at.tolist(), self.sources[c].names(local[at]), strict=True):
                out[k] = name
        return out

    def gather(
        self, indices: np.ndarray, starts: np.ndarray, takes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        source, local = self.split(np.asarray(indices, dtype=np.int64))
        total = int(takes.sum())
        ids = np.empty(total, dtype=np.int64)
        labels = np.empty(total, dtype=np.int64)
        first = np.cumsum(takes) - takes  # [k] where each span's tokens go
        for c in np.unique(source).tolist():
            at = np.flatnonzero(source == c)
            got_ids, got_labels = self.sources[c].gather(local[at], starts[at], takes[at])
            span, position = ragged(takes[at])
            dest = first[at][span] + position
            ids[dest], labels[dest] = got_ids, got_labels
        return ids, labels

"""Long-sample policies: the token spans ("units") of the samples the planner packs.

``drop`` (default) and ``raise`` pack whole samples: a sample longer than ``pack_size`` is dropped and
counted, or is an error naming it. The other two keep long samples, as units that fit a row::

    sample of 10 tokens, pack_size 4
    truncate   [0, 4)                    the first pack_size tokens; the rest (and its supervision) is lost
    split      [0, 4) [4, 8) [8, 10)     pieces packed as separate documents, named "<id>#<k>"

A unit is a document of its own in a packed row: its position ids restart and no label crosses its end, so
the last token of a truncated sample or of a piece gets label -100 (in unshifted terms: the first token of
every later piece is never a target, it starts a new document). Units of whole samples are identical to the
samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from puzzletron.dataset.packing._sort import index_dtype

__all__ = ["Units", "cut_long_samples"]


@dataclass(frozen=True, eq=False)
class Units:
    """Token spans of samples, ``[m]`` each: unit ``u`` is tokens ``[start[u], start[u] + length[u])`` of
    sample ``sample[u]``. ``piece[u]`` numbers the pieces of a split sample (0 for a whole or truncated one);
    ``split`` marks samples cut into more than one piece (their units are named ``<id>#<piece>``)."""

    sample: np.ndarray = field(repr=False)
    start: np.ndarray = field(repr=False)
    length: np.ndarray = field(repr=False)
    piece: np.ndarray = field(repr=False)
    split: np.ndarray = field(repr=False)

    def __len__(self) -> int:
        return int(self.sample.shape[0])

    def names(self, units: np.ndarray, sample_names: Sequence[str]) -> list[str]:
        """Names of ``units`` given the names of their samples (in the same order)."""
        split = self.split[self.sample[units]]
        return [
            f"{name}#{piece}" if cut else name
            for name, cut, piece in zip(sample_names, split.tolist(), self.piece[units].tolist(), strict=True)
        ]


def cut_long_samples(
    lengths: np.ndarray, pack_size: int, policy: str, *, keep_at_least: np.ndarray | None = None
) -> Units | None:
    """The units of ``policy`` (``"truncate"`` or ``"split"``) for samples of ``lengths`` ``[N]``, or ``None``
    when no sample is longer than ``pack_size`` (the units would be the samples themselves).

    ``keep_at_least`` ``[N]`` (truncate only): the shortest prefix a sample may be cut to (a VLM sample's
    tokens through its last image); a long sample whose ``keep_at_least`` exceeds ``pack_size`` keeps its
    whole length, so the planner drops it and counts it.

    >>> u = cut_long_samples(np.array([3, 10]), 4, "split")
    >>> u.sample.tolist(), u.start.tolist(), u.length.tolist()
    ([0, 1, 1, 1], [0, 0, 4, 8], [3, 4, 4, 2])
    >>> cut_long_samples(np.array([3, 10]), 4, "truncate").length.tolist()
    [3, 4]
    >>> keep = np.array([0, 4, 5])  # the third sample may not be cut before its 5th token
    >>> cut_long_samples(np.array([3, 10, 10]), 4, "truncate", keep_at_least=keep).length.tolist()
    [3, 4, 10]
    """
    n = lengths.shape[0]
    long = lengths > pack_size
    if not long.any():
        return None
    idx = index_dtype(max(n, 1))
    if policy == "truncate":
        length = np.minimum(lengths, pack_size).astype(np.int64)
        if keep_at_least is not None:
            length = np.where(np.asarray(keep_at_least) > pack_size, lengths, length).astype(np.int64)
        return Units(
            sample=np.arange(n, dtype=idx),
            start=np.zeros(n, dtype=np.int64),
            length=length,
            piece=np.zeros(n, dtype=np.int64),
            split=np.zeros(n, dtype=bool),
        )
    # pieces: [N] -> ceil(L / pack_size); unit u is piece k of its sample
    pieces = -(-lengths.astype(np.int64) // pack_size)
    sample = np.repeat(np.arange(n, dtype=idx), pieces)
    first = np.cumsum(pieces) - pieces
    piece = np.arange(sample.shape[0], dtype=np.int64) - first[sample]
    start = piece * pack_size
    length = np.minimum(lengths[sample].astype(np.int64) - start, pack_size)
    return Units(sample=sample, start=start, length=length, piece=piece, split=long)

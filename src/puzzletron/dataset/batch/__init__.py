"""The batch contract in one folder: `PuzzletronBatch`, its metadata, vocabulary and exact splits.

::

    _keys         known kwargs and their axes, IGNORE_INDEX, THD_SENTINEL (enums: `puzzletron.dataset._enums`)
    _metadata     PackedSequenceMetadata (packing and media boundaries)
    _core         PuzzletronBatch: fields, validation at construction, the split methods as thin shells
    _validation   the construction rules (one host sync)
    _segments     pure tensor math: canonical ids, cu, run starts, media offsets
    _fingerprint  canonical encoding, SHA-256 and equality by content
    _tables       which tensors carry a batch or token axis; derived batches put back together
    _rebuild      kwargs and metadata rebuilt for a new layout (cu, THD, seq_idx)
    _media        images and videos owned by a group of rows
    _splits       the operations: to, cp_partition, row slices (DP, PP), packed-row DP split, padding
    _cp           load-balanced CP indices and the inverse of cp_partition

The rules are in ``docs/batch-contract.md``. Imports inside this folder flow one way (from `_core` down);
`BatchView` (in `_view`) lets the lower modules type their arguments without importing the class.
"""

from __future__ import annotations

from puzzletron.dataset._enums import DataLayout, Modality
from puzzletron.dataset.batch._core import PuzzletronBatch, token_targets
from puzzletron.dataset.batch._keys import (
    FLAT_BACKEND_KWARGS,
    IGNORE_INDEX,
    PER_IMAGE_KWARGS,
    PER_ROW_KWARGS,
    PER_VIDEO_KWARGS,
    ROW_KWARGS,
    SEQUENCE_KWARGS,
    THD_SENTINEL,
    TOKEN_INDEX_KWARGS,
    TOKEN_KWARGS,
    VIDEO_COUNT_KWARGS,
    VIDEO_KWARGS,
)
from puzzletron.dataset.batch._metadata import PackedSequenceMetadata

__all__ = [
    "FLAT_BACKEND_KWARGS",
    "IGNORE_INDEX",
    "PER_IMAGE_KWARGS",
    "PER_ROW_KWARGS",
    "PER_VIDEO_KWARGS",
    "ROW_KWARGS",
    "SEQUENCE_KWARGS",
    "THD_SENTINEL",
    "TOKEN_INDEX_KWARGS",
    "TOKEN_KWARGS",
    "VIDEO_COUNT_KWARGS",
    "VIDEO_KWARGS",
    "DataLayout",
    "Modality",
    "PackedSequenceMetadata",
    "PuzzletronBatch",
    "token_targets",
]

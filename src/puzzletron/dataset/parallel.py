"""Context-parallel helpers for `PuzzletronBatch`: load-balanced (zigzag) token indices per CP rank and the
exact inverse of ``cp_partition``. They live in `puzzletron.dataset.batch._cp`; this is their public path.

>>> import torch
>>> load_balanced_cp_indices(torch.tensor([0, 8, 16]), cp_rank=0, cp_size=2).tolist()
[0, 1, 6, 7, 8, 9, 14, 15]
"""

from __future__ import annotations

from puzzletron.dataset.batch._cp import (
    batch_cp_indices,
    gather_cp_partitions,
    inverse_cp_permutation,
    load_balanced_cp_indices,
)

__all__ = [
    "batch_cp_indices",
    "gather_cp_partitions",
    "inverse_cp_permutation",
    "load_balanced_cp_indices",
]

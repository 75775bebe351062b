"""Pure, vectorised tensor math over packed sequences: canonical ids, cumulative lengths, media ranges.

Vocabulary (shapes in brackets, lengths in tokens):

- *ids* ``[B, T]``: a sample id per token, ``-1`` on padding. A *sample* is a maximal run of equal
  non-negative values inside one row; raw ids may restart in every row (``[[0,0,1,-1],[0,0,0,-1]]``).
- *canonical ids*: the same samples numbered ``0..n-1`` in row-major run order, unique across the batch::

      raw        [[ 5  5  5  7  7 -1]      canonical  [[ 0  0  0  1  1 -1]
                  [ 5  5  5  5 -1 -1]]                 [ 2  2  2  2 -1 -1]]
      cu_seqlens [0, 3, 5, 9]   (over valid tokens, rows concatenated after removing padding)
      max_seqlen 4

- *cu* ``[n + 1]`` int32: ``0, cumsum(lengths)`` (the flash-attention ``cu_seqlens`` convention).

Every function here is loop-free over tokens and samples (``diff``/``cumsum``/``scatter_add``); the only host
syncs are the ones a result that lives on the host needs (``max_seqlen`` as an ``int``, offsets as tuples).
These helpers are private to the package but their names and signatures are stable: the batch operations,
``automodel.py``, ``attention.py`` and the packing builder import them.
"""

from __future__ import annotations

from itertools import pairwise
from typing import NamedTuple

import torch

from puzzletron.dataset.errors import BatchValidationError

__all__ = [
    "CanonicalIds",
    "canonical_packed_ids",
    "counts_per_sample",
    "cu_from_counts",
    "is_integer_dtype",
    "max_segment_length",
    "media_offsets_from_counts",
    "patch_offsets_from_grid",
    "row_cu_from_seq_ids",
    "row_document_lengths",
    "run_starts",
    "sample_offsets_from_cu",
    "seq_ids_from_cu",
]


class CanonicalIds(NamedTuple):
    """Result of :func:`canonical_packed_ids` (unpacks as ``seq_ids, cu_seqlens, max_seqlen``).

    - ``seq_ids`` ``[B, T]`` int64: global sample id per token (``0..n-1``, row-major), ``-1`` on padding.
    - ``cu_seqlens`` ``[n + 1]`` int32: cumulative valid-token lengths, on the device of the input.
    - ``max_seqlen``: length of the longest sample in tokens (0 when there is no sample).
    """

    seq_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @property
    def sample_offsets(self) -> tuple[tuple[int, int], ...]:
        """``((cu[0], cu[1]), (cu[1], cu[2]), ...)`` as host ints (one host sync)."""
        return sample_offsets_from_cu(self.cu_seqlens)

    @property
    def num_samples(self) -> int:
        return int(self.cu_seqlens.numel()) - 1


def _check_ids(ids: torch.Tensor, name: str) -> None:
    if not isinstance(ids, torch.Tensor):
        raise BatchValidationError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dim() != 2:
        raise BatchValidationError(f"{name} must be 2-D [B, T], got shape {tuple(ids.shape)}")
    if not is_integer_dtype(ids):
        raise BatchValidationError(f"{name} must be an integer tensor, got {ids.dtype}")


def is_integer_dtype(t: torch.Tensor) -> bool:
    """Integer (not bool, floating or complex) dtype."""
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def run_starts(ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., T]`` bool: where a maximal run of equal values starts, row by row (never across rows).

    With ``valid`` (bool, same shape) only valid tokens start runs and an invalid token ends one: the
    *documents*. Without it every run starts one, padding runs included (the *segments* attention kernels
    see over a flattened batch).

    >>> ids = torch.tensor([[0, 0, -1, 1, 1], [2, 2, 2, -1, -1]])
    >>> run_starts(ids, ids >= 0).int().tolist()
    [[1, 0, 0, 1, 0], [1, 0, 0, 0, 0]]
    >>> run_starts(ids).int().tolist()
    [[1, 0, 1, 1, 0], [1, 0, 0, 1, 0]]
    """
    starts = torch.ones_like(ids, dtype=torch.bool) if valid is None else valid.clone()
    if ids.shape[-1] > 1:
        change = ids[..., 1:] != ids[..., :-1]
        starts[..., 1:] &= change if valid is None else change | ~valid[..., :-1]
    return starts


def canonical_packed_ids(ids: torch.Tensor) -> CanonicalIds:
    """Renumber per-row sample ids ``[B, T]`` into global canonical ids, cu over valid tokens and max length.

    Every maximal run of equal non-negative values in a row is one sample; negative values are padding (a
    padding token also ends a run, so ``[1, 1, -1, 1]`` holds two samples). Cost: O(B*T) tensor ops and two
    host syncs (the number of samples, ``max_seqlen``), whatever the number of samples.

    >>> r = canonical_packed_ids(torch.tensor([[1, 1, 1, 2, 2, 2, 0, 0]]) - 1)
    >>> r.seq_ids.tolist(), r.cu_seqlens.tolist(), r.max_seqlen
    ([[0, 0, 0, 1, 1, 1, -1, -1]], [0, 3, 6], 3)
    """
    _check_ids(ids, "ids")
    ids = ids.long()
    valid = ids >= 0
    # Runs never cross a row end: ids restarting per row must not merge with the previous row's last sample.
    starts = run_starts(ids, valid)
    # starts: [B, T] -> row-major running count of runs seen so far.
    flat_starts = starts.reshape(-1)
    run_index = flat_starts.cumsum(0).reshape(ids.shape) - 1
    seq_ids = torch.where(valid, run_index, torch.full_like(run_index, -1))
    # Samples are contiguous in valid-token order, so cu[k] is the valid-token rank of run k's first token:
    # no per-sample counting pass. rank[t] = valid tokens up to and including t.
    rank = valid.reshape(-1).cumsum(0)
    start_positions = flat_starts.nonzero().squeeze(1)  # host sync: the size of cu is data dependent
    cu = torch.empty(start_positions.numel() + 1, dtype=torch.int32, device=ids.device)
    cu[:-1] = rank[start_positions] - 1
    cu[-1:] = rank[-1:] if rank.numel() else 0
    max_seqlen = int((cu[1:] - cu[:-1]).max()) if start_positions.numel() else 0  # host sync
    return CanonicalIds(seq_ids, cu, max_seqlen)


def counts_per_sample(seq_ids: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Tokens per sample ``[num_samples]`` int64 for ids in ``0..num_samples-1`` (negatives ignored).

    Uses ``scatter_add`` into a fixed-size buffer (not ``bincount``) so it never syncs on an accelerator; ids
    ``>= num_samples`` are counted into a discarded overflow bucket.
    """
    flat = seq_ids.reshape(-1).long()
    bucket = torch.where((flat >= 0) & (flat < num_samples), flat, torch.full_like(flat, num_samples))
    counts = torch.zeros(num_samples + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    return counts[:num_samples]


def cu_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """``[n]`` lengths -> ``[n + 1]`` int32 cumulative lengths starting at 0 (same device)."""
    cu = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    cu[1:] = counts.reshape(-1).cumsum(0)
    return cu


def seq_ids_from_cu(
    cu_seqlens: torch.Tensor, length: int, *, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Ids ``[length]`` int64 of one packed row whose samples are ``cu`` (tokens past ``cu[-1]`` get ``-1``).

    cu counts *valid* tokens: with ``valid`` ``[length]`` (bool, e.g. the row's ``hidden_mask``) the k-th
    valid token is the k-th token of the concatenated samples and every other token is padding, wherever it
    sits; without it the first ``cu[-1]`` tokens are the valid ones.

    >>> seq_ids_from_cu(torch.tensor([0, 3, 7]), 8).tolist()
    [0, 0, 0, 1, 1, 1, 1, -1]
    >>> seq_ids_from_cu(torch.tensor([0, 2, 5]), 6, valid=torch.tensor([1, 1, 0, 1, 1, 1]).bool()).tolist()
    [0, 0, -1, 1, 1, 1]
    """
    cu = cu_seqlens.reshape(-1).to(torch.long)
    if valid is None:
        rank = torch.arange(length, device=cu.device)
        keep = rank < cu[-1]
    else:
        keep = valid.reshape(-1).to(device=cu.device, dtype=torch.bool)
        rank = keep.long().cumsum(0) - 1  # index of each valid token among the valid ones
    # searchsorted over the right edges: valid token k belongs to the first sample whose end is > k.
    ids = torch.searchsorted(cu[1:].contiguous(), rank, right=True)
    return torch.where(keep & (rank < cu[-1]), ids, torch.full_like(ids, -1))


def row_document_lengths(seq_ids: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row document lengths and physical spans, both ``[B, width]`` int64 (``-1`` = no document).

    A document is a maximal run of equal non-negative ids in a row (in row order); its span runs from its
    first token to the next document's first token or the row end, so it counts the padding that follows it
    (the THD ``seq_lens_padded`` convention). Tokens before a row's first document belong to no span, and
    documents past ``width`` are not counted (callers size ``width`` from a form that already held them).
    Loop-free and sync-free.

    >>> lengths, spans = row_document_lengths(torch.tensor([[0, 0, -1, 1, 1, 1], [2, -1, -1, -1, -1, -1]]), 3)
    >>> lengths.tolist(), spans.tolist()
    ([[2, 3, -1], [1, -1, -1]], [[3, 3, -1], [6, -1, -1]])
    """
    _check_ids(seq_ids, "seq_ids")
    valid = seq_ids >= 0
    starts = run_starts(seq_ids, valid)
    # doc: [B, T] index of the last document started at or before each token (-1 before the first one).
    doc = starts.long().cumsum(dim=1) - 1
    column = torch.where((doc >= 0) & (doc < width), doc, torch.full_like(doc, width))  # width = discard
    ones = torch.ones_like(column)
    spans = torch.zeros(seq_ids.shape[0], width + 1, dtype=torch.long, device=seq_ids.device)
    spans.scatter_add_(1, column, ones)
    lengths = torch.zeros_like(spans)
    lengths.scatter_add_(1, torch.where(valid, column, torch.full_like(column, width)), ones)
    used = torch.arange(width, device=seq_ids.device) < starts.sum(dim=1, keepdim=True)
    unused = torch.full_like(spans[:, :width], -1)
    return torch.where(used, lengths[:, :width], unused), torch.where(used, spans[:, :width], unused)


def row_cu_from_seq_ids(seq_ids: torch.Tensor, width: int) -> torch.Tensor:
    """Row-local cu ``[B, width]`` over each row's valid tokens, ``-1`` after the row's last boundary.

    AutoModel's per-row ``cu_seqlens`` convention (neat packing metadata); a row without documents is
    ``[0, -1, ...]``. ``width`` is ``max documents per row + 1``.

    >>> row_cu_from_seq_ids(torch.tensor([[0, 0, -1, 1], [-1, -1, -1, -1]]), 3).tolist()
    [[0, 2, 3], [0, -1, -1]]
    """
    lengths, _ = row_document_lengths(seq_ids, width - 1)
    cu = torch.zeros(seq_ids.shape[0], width, dtype=torch.long, device=seq_ids.device)
    cu[:, 1:] = lengths.clamp(min=0).cumsum(dim=1)
    cu[:, 1:] = torch.where(lengths >= 0, cu[:, 1:], torch.full_like(lengths, -1))
    return cu


def max_segment_length(cu_seqlens: torch.Tensor) -> int:
    """Largest ``cu[i+1] - cu[i]`` as an int (0 for a cu with fewer than two entries)."""
    if cu_seqlens.numel() < 2:
        return 0
    return int(cu_seqlens.reshape(-1).diff().max())


def sample_offsets_from_cu(cu_seqlens: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """``((cu[0], cu[1]), (cu[1], cu[2]), ...)`` as host ints (one host sync)."""
    values = cu_seqlens.reshape(-1).tolist()
    return tuple(pairwise(values))


def media_offsets_from_counts(media_counts: torch.Tensor) -> torch.Tensor:
    """``[B]`` images per row -> ``[B + 1]`` = ``0, cumsum(counts)`` (int64, same device)."""
    counts = media_counts.reshape(-1).long()
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.long, device=counts.device)
    offsets[1:] = counts.cumsum(0)
    return offsets


def patch_offsets_from_grid(grid_thw: torch.Tensor) -> torch.Tensor:
    """``[M, 3]`` (t, h, w) per image -> ``[M + 1]`` first flat-patch row of each image, ``0, cumsum(t*h*w)``.

    Flat ``pixel_values`` of Qwen2-VL-style processors hold ``t*h*w`` rows per image, images concatenated.
    """
    if grid_thw.dim() != 2:
        raise BatchValidationError(
            f"image_grid_thw must be 2-D [num_images, 3], got shape {tuple(grid_thw.shape)}"
        )
    return media_offsets_from_counts(grid_thw.long().prod(dim=1))

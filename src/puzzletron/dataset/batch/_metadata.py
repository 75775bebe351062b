"""`PackedSequenceMetadata`: the packing and media boundaries a batch keeps across distributed splits."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from puzzletron.dataset._checks import require_int, require_rank
from puzzletron.dataset.batch._fingerprint import content_equal, content_hash, fingerprint_of
from puzzletron.dataset.errors import BatchValidationError

__all__ = ["MAX_TOKENS", "TENSOR_FIELDS", "PackedSequenceMetadata"]

# The largest token count or offset a batch may record: far beyond any real batch, small enough that every
# int64 comparison and torch.tensor() of it is exact (2**70 would raise inside torch, naming no field).
MAX_TOKENS = 2**62

# The tensor-valued fields, in declaration order (moved by `PuzzletronBatch.to`).
TENSOR_FIELDS = ("global_cu_seqlens", "local_cu_seqlens", "seq_ids", "media_counts", "media_offsets")


@dataclass(frozen=True, eq=False)
class PackedSequenceMetadata:
    """Sequence and media boundaries retained across distributed partitions.

    - ``global_cu_seqlens`` ``[n + 1]``: cumulative valid-token lengths of every packed sample of the batch
      (``[0]`` for a packed batch of padding rows only).
    - ``local_cu_seqlens``: the same over the tokens this CP rank holds (set by ``cp_partition``).
    - ``max_seqlen``: longest segment in tokens (the local one when ``cp_size > 1``).
    - ``seq_ids`` ``[B, T]``: global sample id per token (``0..n-1``, row-major), ``-1`` on padding.
    - ``sample_offsets``: ``((cu[0], cu[1]), (cu[1], cu[2]), ...)``.
    - ``media_counts`` ``[B]`` images per row; ``media_offsets`` ``[B + 1]`` = ``0, cumsum(media_counts)``.

    Only host-side facts are checked here; tensor rules are checked by ``PuzzletronBatch``. Equality and
    hashing are by content fingerprint (tensors make field-wise ``==`` ambiguous).
    """

    global_cu_seqlens: torch.Tensor | None = None
    local_cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    seq_ids: torch.Tensor | None = None
    sample_offsets: tuple[tuple[int, int], ...] = ()
    media_counts: torch.Tensor | None = None
    media_offsets: torch.Tensor | None = None
    cp_rank: int = 0
    cp_size: int = 1

    def __post_init__(self) -> None:
        for name in TENSOR_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.Tensor):
                raise BatchValidationError(
                    f"sequence.{name} must be a torch.Tensor; got {type(value).__name__}"
                )
        if self.max_seqlen is not None:
            require_int(
                self.max_seqlen,
                "sequence.max_seqlen",
                minimum=0,
                maximum=MAX_TOKENS,
                error=BatchValidationError,
            )
        require_rank(
            self.cp_rank,
            self.cp_size,
            rank_name="sequence.cp_rank",
            size_name="sequence.cp_size",
            error=BatchValidationError,
        )
        raw = self.sample_offsets
        if isinstance(raw, torch.Tensor):  # [n, 2]: one host read, not one per entry
            raw = raw.tolist()
        try:
            offsets = tuple((operator.index(a), operator.index(b)) for a, b in raw)
        except (TypeError, ValueError):
            raise BatchValidationError(
                f"sequence.sample_offsets must be pairs of ints (start, stop); got {raw!r:.120}"
            ) from None
        if any(not 0 <= x <= MAX_TOKENS for pair in offsets for x in pair):
            raise BatchValidationError(f"sequence.sample_offsets must be token offsets in 0..{MAX_TOKENS}")
        object.__setattr__(self, "sample_offsets", offsets)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedSequenceMetadata):
            return NotImplemented
        return content_equal(self, other, fingerprint_of)

    def __hash__(self) -> int:
        return content_hash(self, fingerprint_of)

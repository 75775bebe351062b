"""Load-balanced context-parallel (CP) token indices and the exact inverse of ``cp_partition``.

Causal attention makes late tokens of a document cost more than early ones, so giving CP rank ``r`` the
``r``-th contiguous slice would overload the last rank. The head-tail ("zigzag") split used by Megatron,
Transformer Engine and PyTorch context parallel cuts every document into ``2 * cp_size`` equal chunks and
gives rank ``r`` chunks ``r`` and ``2 * cp_size - 1 - r``::

    document of 8 tokens, cp_size 2 -> 4 chunks of 2
    tokens   0 1 | 2 3 | 4 5 | 6 7
    owner     r0 |  r1 |  r1 |  r0        rank 0: [0, 1, 6, 7]   rank 1: [2, 3, 4, 5]

Documents whose length is not a multiple of ``2 * cp_size``: each is *virtually* padded up to the next
multiple, cut into chunks of ``ceil(L / (2 * cp_size))`` tokens, and the indices of the virtual padding are
not returned (they do not exist). The ranks' indices therefore always partition the real tokens exactly (so
:func:`gather_cp_partitions` can rebuild the batch), but ranks may then hold slightly different token counts.
Collective-based CP (ring attention) needs equal counts: pad documents to multiples of ``2 * cp_size`` in the
packer, or pass ``require_divisible=True`` to get an error instead of uneven ranks.

These helpers are not part of the seed API, so ``puzzletron.dataset`` does not re-export them; import them
from ``puzzletron.dataset.batch.cp``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from puzzletron.dataset._checks import require_rank
from puzzletron.dataset._enums import DataLayout
from puzzletron.dataset.batch import segments as _segments
from puzzletron.dataset.batch._keys import TensorPath
from puzzletron.dataset.batch._rebuild import cu_kwarg_updates, token_layout_updates
from puzzletron.dataset.batch._tables import assemble, seq_ids_or_derived, sequence_axis_tensors
from puzzletron.dataset.batch._view import B, BatchView
from puzzletron.dataset.errors import BatchValidationError

__all__ = [
    "batch_cp_indices",
    "gather_cp_partitions",
    "inverse_cp_permutation",
    "load_balanced_cp_indices",
]


def load_balanced_cp_indices(
    cu_seqlens: torch.Tensor | None,
    *,
    cp_rank: int,
    cp_size: int,
    sequence_length: int | None = None,
    require_divisible: bool = False,
) -> torch.Tensor:
    """Token positions ``[L]`` (int64, ascending) that CP rank ``cp_rank`` of ``cp_size`` owns.

    ``cu_seqlens`` ``[D + 1]`` are the document boundaries as token positions of one row (``None``: the whole
    row of ``sequence_length`` tokens is one document). Tokens past ``cu[-1]`` up to ``sequence_length``
    (trailing pack padding) form one more segment, split like a document. Cost: O(T) tensor ops.

    >>> load_balanced_cp_indices(torch.tensor([0, 8, 16]), cp_rank=0, cp_size=2).tolist()
    [0, 1, 6, 7, 8, 9, 14, 15]
    """
    require_rank(cp_rank, cp_size, rank_name="cp_rank", size_name="cp_size", error=BatchValidationError)
    if cu_seqlens is None:
        if sequence_length is None:
            raise BatchValidationError("sequence_length is required when cu_seqlens is None")
        cu = torch.tensor([0, sequence_length], dtype=torch.long)
    else:
        cu = cu_seqlens.reshape(-1).to(torch.long)
        if cu.numel() < 1 or int(cu[0]) != 0 or (cu.numel() > 1 and not bool((cu.diff() > 0).all())):
            raise BatchValidationError("cu_seqlens must start at 0 and be strictly increasing")
        end = int(cu[-1])
        if sequence_length is not None:
            if sequence_length < end:
                raise BatchValidationError(
                    f"sequence_length {sequence_length} is shorter than cu_seqlens[-1] = {end}"
                )
            if sequence_length > end:
                cu = torch.cat([cu, cu.new_tensor([sequence_length])])
    lengths = cu.diff()
    n_chunks = 2 * cp_size
    if require_divisible and bool((lengths % n_chunks).any()):
        bad = lengths[lengths % n_chunks != 0][:4].tolist()
        raise BatchValidationError(
            f"cu_seqlens: every segment must be a multiple of 2*cp_size={n_chunks} tokens; got lengths {bad}"
        )
    total = int(cu[-1])
    positions = torch.arange(total, device=cu.device)
    # doc: [T] segment of every token; offset: position inside it; chunk: [T] in 0..2cp-1.
    doc = torch.searchsorted(cu[1:].contiguous(), positions, right=True)
    offset = positions - cu[doc]
    chunk_len = (lengths + n_chunks - 1) // n_chunks
    chunk = offset // chunk_len[doc]
    owner = torch.where(chunk < cp_size, chunk, n_chunks - 1 - chunk)
    return positions[owner == cp_rank]


def batch_cp_indices(
    batch: BatchView, *, cp_rank: int, cp_size: int, require_divisible: bool = False
) -> torch.Tensor:
    """Balanced indices for ``batch.cp_partition``: per document for one packed row, else per whole row.

    One packed row (``B == 1`` with ``seq_ids`` or cu): every maximal run of equal ``seq_ids`` (a sample, or
    a run of padding) is one segment. Otherwise the index vector is shared by all rows, so each row is
    treated as a single document of ``T`` tokens.
    """
    T = batch.sequence_length
    ids = seq_ids_or_derived(batch)
    if batch.layout is not DataLayout.PACKED_VARLEN or batch.batch_size != 1 or ids is None:
        return load_balanced_cp_indices(
            None, cp_rank=cp_rank, cp_size=cp_size, sequence_length=T, require_divisible=require_divisible
        )
    # Segment starts: position 0 and every change of id (padding runs become segments of their own).
    starts = torch.nonzero(_segments.run_starts(ids[0].to("cpu"))).reshape(-1)
    cu = torch.cat([starts, torch.tensor([T])])
    indices = load_balanced_cp_indices(
        cu, cp_rank=cp_rank, cp_size=cp_size, require_divisible=require_divisible
    )
    return indices.to(batch.input_ids.device)


def inverse_cp_permutation(token_indices: Sequence[torch.Tensor]) -> torch.Tensor:
    """``inv`` ``[T]`` such that ``cat(local_tensors, dim)[..., inv]`` restores the original token order.

    ``token_indices`` are the index vectors of ranks ``0..cp-1``; together they must be a permutation of
    ``0..T-1`` (``T`` = their total length), else ``BatchValidationError``.
    """
    if not token_indices:
        raise BatchValidationError("token_indices must hold one index vector per CP rank; got none")
    order = torch.cat([idx.reshape(-1).to(torch.long).cpu() for idx in token_indices])
    total = order.numel()
    if total and (int(order.min()) < 0 or int(order.max()) >= total):
        raise BatchValidationError(f"token_indices of all ranks must cover exactly 0..{total - 1}")
    inv = torch.full((total,), -1, dtype=torch.long)
    inv[order] = torch.arange(total)
    if bool((inv < 0).any()):
        raise BatchValidationError("token_indices of all ranks must be disjoint and cover every token once")
    return inv


def gather_cp_partitions(partitions: Sequence[B], token_indices: Sequence[torch.Tensor]) -> B:
    """Inverse of ``cp_partition``: rebuild the full batch from every rank's partition and indices.

    ``partitions[r]`` must be rank ``r`` of the same ``cp_size``, built with ``token_indices[r]``. Every
    sequence-shaped tensor, label, mask and ``seq_ids`` is concatenated along its token axis and put back in
    the original order. The result has ``cp_rank=0, cp_size=1``, no ``local_cu_seqlens``, ``max_seqlen`` =
    the largest global segment (``None`` without global cu), and a ``cu_seqlens`` / int ``max_seqlen`` kwarg
    rebuilt from the global cu. It is validated like a freshly constructed batch.

    Tokens, labels, masks and kwargs come back exactly. Metadata the original left out comes back derived:
    a packed row given by cu alone gets the ``seq_ids`` that ``cp_partition`` derived for every rank, and
    ``max_seqlen`` is as above whatever the original held (the partitions cannot tell what it had).
    """
    if len(partitions) != len(token_indices) or not partitions:
        raise BatchValidationError(
            f"need one partition per index vector; got {len(partitions)} partitions and "
            f"{len(token_indices)} index vectors"
        )
    cp_size = len(partitions)
    for rank, part in enumerate(partitions):
        if part.sequence.cp_size != cp_size or part.sequence.cp_rank != rank:
            raise BatchValidationError(
                f"partitions[{rank}] is CP rank {part.sequence.cp_rank} of {part.sequence.cp_size}; expected "
                f"rank {rank} of {cp_size}"
            )
    inv = inverse_cp_permutation(token_indices)
    first = partitions[0]
    tables = [sequence_axis_tensors(part) for part in partitions]
    tensors: dict[TensorPath, torch.Tensor] = {}
    for path, (t0, dim) in tables[0].items():
        if any(path not in table for table in tables):
            raise BatchValidationError(f"partitions disagree on which tensors they hold ({path[1]!r})")
        joined = torch.cat([table[path][0] for table in tables], dim=dim)
        tensors[path] = joined.index_select(dim, inv.to(t0.device))
    if first.sequence.seq_ids is not None:
        joined = torch.cat([part.sequence.seq_ids for part in partitions], dim=1)
        tensors[("seq", "seq_ids")] = joined.index_select(1, inv.to(joined.device))
    cu = first.sequence.global_cu_seqlens
    global_max = _segments.max_segment_length(cu) if cu is not None else None
    kwargs_updates = cu_kwarg_updates(first, cu, global_max, "gather_cp_partitions")
    restored_ids = tensors.get(("seq", "seq_ids"))
    kwargs_updates.update(token_layout_updates(first, restored_ids, "gather_cp_partitions"))
    restored = assemble(
        first,
        tensors,
        kwargs_updates=kwargs_updates,
        sequence_updates={"local_cu_seqlens": None, "max_seqlen": global_max, "cp_rank": 0, "cp_size": 1},
    )
    # Re-run the public constructor: the rebuilt batch is checked against every rule of the contract.
    return dataclasses.replace(restored)

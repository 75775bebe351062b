"""Split a batch over data, context and pipeline parallelism (DP x CP x PP) and prove it reassembles exactly.

`check_sharding` is the end-to-end check of the batch contract's splits (`docs/batch-contract.md`): it
splits a `PuzzletronBatch` the way a training step does (rows over DP first, then each DP shard's tokens
over CP and its rows over PP) and checks that every split puts back exactly what it took, no token, label
or row lost, moved or duplicated. The demo runs it on a synthetic and on a real packed batch; a test or a
new parallel layout can run it on any batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from puzzletron.dataset._checks import require_positive
from puzzletron.dataset.batch.cp import batch_cp_indices, gather_cp_partitions
from puzzletron.dataset.errors import BatchValidationError

if TYPE_CHECKING:
    from puzzletron.dataset.batch import PuzzletronBatch

__all__ = ["check_sharding"]

_UNSET = -7  # what a position holds until a CP partition writes it back (never a token id or a label)


def check_sharding(batch: PuzzletronBatch, *, dp: int, cp: int, pp: int) -> list[str]:
    """Split ``batch`` over ``dp`` DP ranks, then each DP shard over ``cp`` CP ranks and ``pp`` PP
    microbatches; check that each split reassembles exactly.

    - DP: the shards (`dp_slice`) concatenate back to the batch's ``input_ids`` and ``labels``: along the
      rows, or, for a batch of one packed row, along its tokens (the row is split by whole samples and its
      trailing pack padding dropped).
    - CP: the load-balanced token indices (`batch_cp_indices`) of the ``cp`` ranks cover every position of
      the shard once, and the partitions (`cp_partition`) scattered back to those positions rebuild its
      ``input_ids`` and ``labels``; `gather_cp_partitions` rebuilds its ``input_ids``, ``labels`` and
      ``hidden_mask``.
    - PP: the microbatches (`pp_microbatches`, or the shard itself when it has fewer than ``pp`` rows)
      concatenate back to its ``input_ids``.

    Returns report lines: ``dp=<dp>: <shard fingerprints>``, then one line per DP shard with the
    fingerprints of its CP partitions and its number of PP microbatches (fingerprints shortened to 12 hex
    digits). Raises `BatchValidationError` when ``dp``, ``cp`` or ``pp`` is not a positive int or a split
    refuses the batch, and ``AssertionError`` naming the split, DP shard and tensor that did not reassemble
    (a broken split, never bad input).
    """
    for value, name in ((dp, "dp"), (cp, "cp"), (pp, "pp")):
        require_positive(value, name, error=BatchValidationError)
    shards = _check_dp(batch, dp)
    lines = [f"dp={dp}: " + " ".join(_short_fingerprint(s) for s in shards)]
    for rank, shard in enumerate(shards):
        prints = _check_cp(shard, rank, cp)
        micro = _check_pp(shard, rank, pp)
        lines.append(f"  dp{rank}: cp={cp} " + " ".join(prints) + f" | pp={micro} microbatches ok")
    return lines


def _short_fingerprint(batch: PuzzletronBatch) -> str:
    return str(batch.fingerprint)[:12]


def _check_dp(batch: PuzzletronBatch, dp: int) -> list[PuzzletronBatch]:
    """The DP shards, after checking they concatenate back to the batch."""
    shards = [batch.dp_slice(dp_rank=r, dp_size=dp) for r in range(dp)]
    # One packed row is split by whole samples along the tokens (trailing pack padding dropped); several
    # rows are split into contiguous row blocks.
    axis = 1 if batch.batch_size == 1 and dp > 1 else 0
    width = int(batch.sequence.global_cu_seqlens[-1]) if axis == 1 else batch.sequence_length
    for name in ("input_ids", "labels"):
        joined = torch.cat([getattr(s, name) for s in shards], dim=axis)
        if not torch.equal(joined, getattr(batch, name)[:, :width]):
            raise AssertionError(f"DP shards do not concatenate back to the batch's {name}")
    return shards


def _check_cp(shard: PuzzletronBatch, rank: int, cp: int) -> list[str]:
    """The fingerprints of the CP partitions of DP shard ``rank``, after checking they rebuild it."""
    # Every rank's gathered tokens, scattered back to their positions, rebuild the shard.
    rebuilt_ids = torch.full_like(shard.input_ids, _UNSET)
    rebuilt_labels = torch.full_like(shard.labels, _UNSET)
    seen = torch.zeros(shard.sequence_length, dtype=torch.long)
    indices, parts = [], []
    for c in range(cp):
        index = batch_cp_indices(shard, cp_rank=c, cp_size=cp)
        part = shard.cp_partition(index, cp_rank=c, cp_size=cp)
        rebuilt_ids[:, index] = part.input_ids
        rebuilt_labels[:, index] = part.labels
        seen[index] += 1
        indices.append(index)
        parts.append(part)
    if not (torch.all(seen == 1) and torch.equal(rebuilt_ids, shard.input_ids)):
        raise AssertionError(f"CP partitions of DP shard {rank} do not reassemble its input_ids")
    if not torch.equal(rebuilt_labels, shard.labels):
        raise AssertionError(f"CP partitions of DP shard {rank} do not reassemble its labels")
    gathered = gather_cp_partitions(parts, indices)
    for name in ("input_ids", "labels", "hidden_mask"):
        if not torch.equal(getattr(gathered, name), getattr(shard, name)):
            raise AssertionError(f"gather_cp_partitions of DP shard {rank} does not rebuild its {name}")
    return [_short_fingerprint(p) for p in parts]


def _check_pp(shard: PuzzletronBatch, rank: int, pp: int) -> int:
    """The number of PP microbatches of DP shard ``rank``, after checking they concatenate back to it."""
    micro = shard.pp_microbatches(pp) if shard.batch_size >= pp else (shard,)
    if not torch.equal(torch.cat([m.input_ids for m in micro]), shard.input_ids):
        raise AssertionError(f"PP microbatches of DP shard {rank} do not reassemble its input_ids")
    return len(micro)

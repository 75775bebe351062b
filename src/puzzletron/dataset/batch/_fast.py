"""The token-sized value rules of `PuzzletronBatch` in as few passes over the tokens as possible.

`_validation` states every rule one by one (to name a broken field); the rules over ``[B, T]`` tensors cost
a pass each there, and a packed 8 x 16k batch has a dozen. Here the same rules, or stronger ones that imply
them, are computed with reductions and 1-byte masks (``torch.bool`` viewed as ``uint8``: a bitwise op or a
``max`` over them costs a tenth of a comparison), answering one question: does every rule hold? The
canonical-ids rules of a packed batch become one comparison: mark where a run of equal ids starts (a row
start, a new id, the end of padding), count the runs with a cumulative sum, and require every valid token's
id to be its run's number and every padding token's id -1; with one ``scatter_add`` of the per-id counts
against ``cu`` this is exactly "canonical, one contiguous run per sample inside a row, counts = cu lengths,
cu ends at the valid-token count" (``docs/batch-contract.md``, "Canonical packed ids").

No host sync here: the caller stacks these scalars with the other rules and reads them once.
"""

from __future__ import annotations

import torch

from puzzletron.dataset.batch._keys import IGNORE_INDEX
from puzzletron.dataset.batch._view import BatchView

__all__ = ["token_rules"]

_U8 = torch.uint8


def _bits(mask: torch.Tensor) -> torch.Tensor:
    """A 0/1 ``uint8`` view (bool) or image (other dtypes) of a mask."""
    return mask.view(_U8) if mask.dtype == torch.bool else (mask != 0).view(_U8)


def _labels_ok(labels: torch.Tensor, h8: torch.Tensor | None) -> torch.Tensor:
    """Every label is a token id >= 0 or -100, and -100 off the hidden tokens: clamped to [-101, 0] (so
    int32 holds it exactly), plus 100 off the hidden tokens, each must be 0 or -100: d * (d + 100) == 0."""
    d = labels.clamp(IGNORE_INDEX - 1, 0).to(torch.int32)
    if h8 is not None:
        d.add_((h8 ^ 1).mul_(-IGNORE_INDEX))  # uint8 100 where not hidden
    product = d.mul(d.add(-IGNORE_INDEX))
    low, high = torch.aminmax(product)
    return low.eq(0) & high.eq(0)


def _canonical(ids: torch.Tensor, valid8: torch.Tensor, cu: torch.Tensor) -> list[torch.Tensor]:
    """``ids`` ``[B, T]`` are the canonical packed ids of ``cu`` over the valid tokens ``valid8``: every
    valid token's id is the number of its run (runs of equal ids, never across a row or padding) and every
    other token's -1; there are ``n`` runs, and id ``s`` has ``cu[s + 1] - cu[s]`` tokens."""
    T = ids.shape[1]
    n = cu.numel() - 1
    starts = valid8.clone()
    if T > 1:
        starts[:, 1:] &= (ids[:, 1:] != ids[:, :-1]).view(_U8) | ~valid8[
            :, :-1
        ]  # low bit: ~0 = 255, ~1 = 254
    # int32 throughout (a cumulative sum into int64 costs six times more); the 1-based run of each token
    run = starts.reshape(-1).cumsum(0, dtype=torch.int32)
    runs_ok = run[-1].eq(n) if run.numel() else torch.tensor(n == 0, device=ids.device)
    # the run on valid tokens, 0 elsewhere: what id + 1 must be, and the bin each token counts in (more runs
    # than n fail `runs_ok`; the clamp only keeps the counting inside its n + 1 bins)
    bucket = run.mul_(valid8.reshape(-1)).clamp_(max=n).long()
    counts = torch.zeros(n + 1, dtype=torch.long, device=ids.device)  # fixed size: bincount would sync
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))  # contiguous ones: twice as fast as an expand
    ids_ok = ids.reshape(-1).eq(bucket.sub_(1)).view(_U8).min().eq(1) if ids.numel() else runs_ok
    return [ids_ok, runs_ok, counts[1:].eq(cu.diff()).all()]


def token_rules(b: BatchView, *, packed: bool) -> list[torch.Tensor]:
    """0-d bool tensors, all True iff every token-sized rule of `_validation` holds for ``b`` (whose
    shapes and dtypes are already checked)."""
    ids, labels, hidden = b.input_ids, b.labels, b.hidden_mask
    out = [ids.min().ge(0)] if ids.numel() else []
    h8 = _bits(hidden) if hidden is not None and hidden.numel() else None
    if labels is not None and labels.numel():
        out.append(_labels_ok(labels, h8))
    if h8 is not None:
        outside = ~h8  # low bit 1 off the hidden tokens (~0 = 255, ~1 = 254)
        for name in ("ce_mask", "kd_mask"):
            mask = getattr(b, name)
            if mask is not None:
                out.append((_bits(mask) & outside).max().eq(0))
    seq = b.sequence
    ids_, cu = seq.seq_ids, seq.global_cu_seqlens
    canonical = packed and cu is not None and seq.cp_size == 1
    if ids_ is not None and ids_.numel() and canonical:
        ids_ = ids_.to(cu.device)
        valid8 = h8.to(cu.device) if h8 is not None else ids_.ge(0).view(_U8)
        return out + _canonical(ids_, valid8, cu)
    if ids_ is not None and ids_.numel():
        out.append(ids_.min().ge(-1))
        if h8 is not None:
            out.append((ids_.ge(0).view(_U8) ^ h8).max().eq(0))
    elif canonical:  # no token carries an id: cu must end at the valid-token count
        if ids_ is not None:
            valid = torch.zeros((), dtype=torch.long)
        else:
            valid = h8.sum() if h8 is not None else torch.tensor(ids.numel())
        out.append(cu[-1].eq(valid.to(cu.device)))
    return out

"""The checks `batch_from_automodel` makes of the document forms it reads before trusting them: every
document of a ``_packed_seq_ids`` row one contiguous run, attention-mask values of their kind (0/1 or
document ids, an additive mask's 0 and large negatives), and a 4-D mask exactly block-causal over the
documents it implies. A collator output that breaks one would otherwise be read as other documents than it
means (a split document renumbered as two, a half-open mask, tokens attending across documents)."""

from __future__ import annotations

import torch

from puzzletron.dataset.batch.segments import run_starts
from puzzletron.dataset.errors import BatchValidationError

__all__ = ["MASKED_BELOW", "check_block_causal", "check_mask_values", "check_packed_ids"]

MASKED_BELOW = -1e4  # an additive mask's "may not attend" values are at or below this (-inf, finfo.min, -1e9)


def _error(message: str) -> BatchValidationError:
    return BatchValidationError(f"batch_from_automodel: {message}")


def check_packed_ids(packed: torch.Tensor) -> None:
    """Each 1-based document id of a ``_packed_seq_ids`` row ``[B, T]`` is one run (0 = padding)."""
    valid = packed > 0
    runs = run_starts(packed, valid).sum(dim=1)
    ordered = packed.sort(dim=1).values
    distinct = (ordered[:, :1] > 0).sum(dim=1) + (
        (ordered[:, 1:] != ordered[:, :-1]) & (ordered[:, 1:] > 0)
    ).sum(dim=1)
    bad = torch.nonzero(runs != distinct)
    if bad.numel():
        row = int(bad[0, 0])
        raise _error(
            f"'_packed_seq_ids' row {row} holds a document in more than one run ({int(runs[row])} runs of "
            f"{int(distinct[row])} documents); a document's tokens must be contiguous"
        )


def check_mask_values(mask: torch.Tensor) -> None:
    """A 2-D ``attention_mask`` holds 0/1 or document ids (integral, >= 0); a 4-D one 0/1 (bool or
    integer) or, additive (floating), 0 and values <= `MASKED_BELOW`."""
    if mask.dtype == torch.bool:
        return
    if mask.dim() == 4:
        if mask.dtype.is_floating_point:
            bad = ~((mask == 0) | (mask <= MASKED_BELOW))
            what = f"an additive mask holds 0 (may attend) or <= {MASKED_BELOW:g} (may not)"
        else:
            bad = ~((mask == 0) | (mask == 1))
            what = "an integer mask holds 0 and 1"
    else:
        bad = (mask < 0) | (
            mask != mask.round() if mask.dtype.is_floating_point else torch.zeros_like(mask, dtype=torch.bool)
        )
        what = "a 2-D mask holds 0/1 or document ids (integers >= 0)"
    found = torch.nonzero(bad)
    if found.numel():
        where = tuple(int(x) for x in found[0])
        raise _error(f"'attention_mask' holds {mask[where].item()!r} at {list(where)}; {what}")


def check_block_causal(allowed: torch.Tensor, ids: torch.Tensor) -> None:
    """``allowed`` ``[B, T, T]`` (query, key) is exactly the block-causal mask of the documents ``ids``
    ``[B, T]`` it implies (-1: a token that may attend nowhere): each valid token sees its document's
    tokens up to itself and nothing else."""
    T = ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril_()
    expected = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0) & causal
    wrong = torch.nonzero(allowed != expected)
    if wrong.numel():
        b, i, j = (int(x) for x in wrong[0])
        raise _error(
            f"the 4-D 'attention_mask' is not block-causal over its documents: row {b}, token {i} "
            f"{'may' if bool(allowed[b, i, j]) else 'may not'} attend to token {j}"
        )

"""NeMo AutoModel collator output <-> `PuzzletronBatch`.

`batch_from_automodel` reads every form in which AutoModel 0.7 collators describe documents and padding
(shapes ``[B, T]`` unless noted)::

    neat packing   _packed_seq_ids [[1 1 1 2 2 2 0 0]]     1-based document per row, 0 = padding
    THD packing    seq_lens [[3 2 -1000]], seq_lens_padded [[4 4 -1000]]   per-row lengths, -1000 unused
    neat metadata  cu_seqlens [B, D+1] (-1 after the row's last boundary) over valid tokens
    legacy         cu_seqlens [0 3 7 12] or [[0 3 7 12]]  one row spanning [0, T]
    flash varlen   cu_seq_lens_q [segments+1] over the flattened B*T tokens, padding runs are segments
    block causal   attention_mask [B, 1, T, T] bool (a token starts a document when it may not see its
                   left neighbour; the diagonal is False on padding)
    plain          attention_mask [B, T] (0/1 or document ids), padding_mask [B, T] (True = padding)

The other direction, from a batch to a model's attention kwargs, is `puzzletron.dataset.clients.attention`
(``forward_kwargs`` is re-exported here under its original path). Row-local forms survive splits: a per-row
``cu_seqlens`` ``[B, D+1]``, ``packed_token_indices`` and THD ``seq_lens*`` are sliced with rows and rebuilt
for new token layouts; a collator's flash ``cu_seq_lens_q/k`` are dropped by every split.

The conversion is meant for collator output on the CPU: it needs host values (``max_seqlen``, offsets).
It never mutates the input and copies no tensor it passes through (1-D inputs become ``[1, T]`` views).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from puzzletron.dataset._checks import coerce_enum
from puzzletron.dataset.batch import (
    IGNORE_INDEX,
    TOKEN_KWARGS,
    DataLayout,
    Modality,
    PackedSequenceMetadata,
    PuzzletronBatch,
    token_targets,
)
from puzzletron.dataset.batch.segments import (
    canonical_packed_ids,
    is_integer_dtype,
    media_offsets_from_counts,
    run_starts,
    sample_offsets_from_cu,
)
from puzzletron.dataset.clients.attention import forward_kwargs
from puzzletron.dataset.clients.automodel import _masks
from puzzletron.dataset.errors import BatchValidationError

__all__ = ["DocumentMap", "batch_from_automodel", "document_map", "forward_kwargs"]

# Removed from model_kwargs: they become labels / masks / metadata of the batch.
_CONSUMED_KEYS = (
    "labels",
    "targets",
    "loss_mask",
    "n_images_per_sample",
    "num_images_per_sample",
    "media_counts",
    "_packed_seq_ids",
)
_MEDIA_COUNT_KEYS = ("n_images_per_sample", "num_images_per_sample", "media_counts")
_MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
# Token-aligned keys: a 1-D value of length T is one row and is viewed as [1, T].
_SEQUENCE_KEYS = (*TOKEN_KWARGS, "labels", "targets", "loss_mask", "_packed_seq_ids")


@dataclass(frozen=True)
class DocumentMap:
    """Per-row document ids ``[B, T]`` (``-1`` = padding; may restart per row) and their source key."""

    ids: torch.Tensor
    source: str


def _error(message: str) -> BatchValidationError:
    return BatchValidationError(f"batch_from_automodel: {message}")


def _as_rows(value: Any, length: int) -> Any:
    """View a 1-D tensor of ``length`` tokens as one row ``[1, T]`` (no copy); anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == length:
        return value.unsqueeze(0)
    return value


def _require_bt(collated: Mapping[str, Any], key: str, shape: tuple[int, int]) -> torch.Tensor:
    value = collated[key]
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise _error(f"{key!r} must be a tensor of shape [B, T] = {list(shape)}, got {got}")
    return value


def _integer_tensor(value: Any, key: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        tensor = value
    elif isinstance(value, Sequence) and not isinstance(value, str):
        tensor = torch.as_tensor(value)
    else:
        raise _error(f"{key!r} must be a tensor or a sequence of ints, got {type(value).__name__}")
    if not is_integer_dtype(tensor):
        raise _error(f"{key!r} must hold integers, got {tensor.dtype}")
    return tensor


def _number_runs(starts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-row document ids ``[B, T]``: the number of run starts up to each valid token, minus 1; ``-1`` off
    the valid tokens (``starts`` and ``valid`` are bool ``[B, T]``)."""
    runs = starts.long().cumsum(dim=1).sub_(1)
    return runs.masked_fill_(~valid, -1)


def _run_ids(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-row run index ``[B, T]`` of maximal runs of equal values among valid tokens; ``-1`` elsewhere."""
    return _number_runs(run_starts(values, valid), valid)


def _ids_from_row_cu(cu: torch.Tensor, valid: torch.Tensor, key: str) -> torch.Tensor:
    """Document ids ``[B, T]`` from per-row cu ``[B, D+1]`` over each row's valid tokens (-1 = unused)."""
    batch, _ = valid.shape
    if cu.dim() != 2 or cu.shape[0] != batch or cu.shape[1] < 2:
        raise _error(f"{key!r} must be [B, D+1] with B = {batch}, got shape {tuple(cu.shape)}")
    cu = cu.long()
    used = cu >= 0
    if bool((cu[:, 0] != 0).any()):
        raise _error(f"every row of {key!r} must start at 0, got {cu[:, 0].tolist()}")
    # Unused (-1) entries must only trail, and boundaries must increase strictly.
    if bool((used[:, 1:] & ~used[:, :-1]).any()):
        raise _error(f"{key!r} has a -1 entry before a boundary; -1 may only pad the end of a row")
    if bool(((cu[:, 1:] <= cu[:, :-1]) & used[:, 1:]).any()):
        raise _error(f"{key!r} must be strictly increasing in every row, got {cu.tolist()}")
    last = torch.where(used, cu, 0).amax(dim=1)
    valid_counts = valid.sum(dim=1)
    if not torch.equal(last, valid_counts):
        raise _error(
            f"{key!r} rows end at {last.tolist()} but the rows hold {valid_counts.tolist()} valid tokens"
        )
    # rank: [B, T] index of each valid token among its row's valid tokens.
    rank = valid.long().cumsum(dim=1) - 1
    ends = torch.where(used[:, 1:], cu[:, 1:], torch.iinfo(torch.long).max)
    ids = torch.searchsorted(ends.contiguous(), rank.contiguous(), right=True)
    return torch.where(valid, ids, -1)


def _ids_from_thd(collated: Mapping[str, Any], shape: tuple[int, int]) -> torch.Tensor:
    """Document ids from THD ``seq_lens`` / ``seq_lens_padded`` ``[B, D]`` (negative = unused slot)."""
    batch, length = shape
    seq_lens = _integer_tensor(collated["seq_lens"], "seq_lens").long()
    if seq_lens.dim() == 1:
        seq_lens = seq_lens.unsqueeze(0)
    padded = seq_lens
    if collated.get("seq_lens_padded") is not None:
        padded = _integer_tensor(collated["seq_lens_padded"], "seq_lens_padded").long()
        if padded.dim() == 1:
            padded = padded.unsqueeze(0)
    if seq_lens.dim() != 2 or seq_lens.shape[0] != batch or padded.shape != seq_lens.shape:
        raise _error(
            f"'seq_lens' and 'seq_lens_padded' must both be [B, D] with B = {batch}, got "
            f"{tuple(seq_lens.shape)} and {tuple(padded.shape)}"
        )
    used = seq_lens >= 0
    if not torch.equal(used, padded >= 0):
        raise _error("'seq_lens' and 'seq_lens_padded' must mark the same unused (-1000) slots")
    seq_lens = seq_lens.clamp(min=0)
    padded = padded.clamp(min=0)
    if bool((padded < seq_lens).any()):
        raise _error("'seq_lens_padded' must be >= 'seq_lens' for every document")
    ends = padded.cumsum(dim=1)  # [B, D] physical end of each document's span
    if bool((ends[:, -1] > length).any()):
        raise _error(f"'seq_lens_padded' rows sum to {ends[:, -1].tolist()}, more than T = {length} tokens")
    positions = torch.arange(length, device=seq_lens.device).expand(batch, length).contiguous()
    doc = torch.searchsorted(ends.contiguous(), positions, right=True)  # [B, T], D past the last span
    inside = doc < seq_lens.shape[1]
    doc_c = doc.clamp(max=seq_lens.shape[1] - 1)
    start = ends.gather(1, doc_c) - padded.gather(1, doc_c)
    valid = inside & (positions - start < seq_lens.gather(1, doc_c))
    return torch.where(valid, doc, -1)


def _ids_from_flash_cu(collated: Mapping[str, Any], shape: tuple[int, int]) -> torch.Tensor:
    """Document ids from HF flash-varlen ``cu_seq_lens_q`` over the flattened B*T tokens.

    Padding runs are segments too, so validity needs another source: a 2-D ``attention_mask`` or
    ``padding_mask`` when present; otherwise AutoModel's rule applies (it omits ``_packed_seq_ids`` only when
    no row holds two documents): the first segment of a row is its document, later segments are padding and
    must have all-zero ``position_ids``.
    """
    batch, length = shape
    cu = _integer_tensor(collated["cu_seq_lens_q"], "cu_seq_lens_q").reshape(-1).long()
    total = batch * length
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu.diff() <= 0).any()):
        raise _error(f"'cu_seq_lens_q' must increase strictly from 0 to B*T = {total}, got {cu.tolist()}")
    row_starts = torch.arange(0, total, length, device=cu.device)
    if not bool(torch.isin(row_starts, cu).all()):
        raise _error("'cu_seq_lens_q' has a segment that crosses a row boundary")
    flat = torch.arange(total, device=cu.device)
    segments = torch.searchsorted(cu[1:].contiguous(), flat, right=True).reshape(batch, length)
    valid = _plain_valid(collated, shape)
    if valid is None:
        valid = segments == segments[:, :1]
        position_ids = collated.get("position_ids")
        if isinstance(position_ids, torch.Tensor) and position_ids.shape[-2:] == shape:
            rows = position_ids if position_ids.dim() == 2 else position_ids[0]
            if bool((rows.masked_select(~valid) != 0).any()):
                raise _error(
                    "'cu_seq_lens_q' has a second document in a row but no '_packed_seq_ids' or "
                    "2-D 'attention_mask' tells documents from padding runs; pass '_packed_seq_ids'"
                )
    return _run_ids(segments, valid)


def _ids_from_block_mask(mask: torch.Tensor) -> torch.Tensor:
    """Document ids from a block-causal mask ``[B, 1, T, T]`` (bool/int: nonzero = may attend; float: 0)."""
    _masks.check_mask_values(mask)
    allowed = mask[:, 0] == 0 if mask.dtype.is_floating_point else mask[:, 0] != 0
    valid = allowed.diagonal(dim1=-2, dim2=-1)  # [B, T]
    continues = torch.zeros_like(valid)
    continues[:, 1:] = allowed.diagonal(offset=-1, dim1=-2, dim2=-1)  # token i may see token i-1
    ids = _number_runs(valid & ~continues, valid)
    _masks.check_block_causal(allowed, ids)
    return ids


def _plain_valid(collated: Mapping[str, Any], shape: tuple[int, int]) -> torch.Tensor | None:
    """Valid tokens ``[B, T]`` from a 2-D ``attention_mask`` (nonzero), else ``~padding_mask``, else None."""
    mask = collated.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        _masks.check_mask_values(mask)
        return _require_bt(collated, "attention_mask", shape) != 0
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        return _ids_from_block_mask(mask) >= 0
    padding = collated.get("padding_mask")
    if isinstance(padding, torch.Tensor):
        return ~_require_bt(collated, "padding_mask", shape).bool()
    return None


def document_map(collated: Mapping[str, Any]) -> DocumentMap:
    """Per-row document ids ``[B, T]`` of a collated batch, from the most explicit form present.

    Order: ``_packed_seq_ids``; THD ``seq_lens``; ``cu_seqlens`` (per-row ``[B, D+1]``, or one row; with
    ``seq_idx`` for B > 1); flash ``cu_seq_lens_q``; a 4-D block-causal or 2-D ``attention_mask``;
    ``padding_mask``; else every row is one document.
    """
    input_ids = collated["input_ids"]
    shape = (int(input_ids.shape[0]), int(input_ids.shape[1]))
    if collated.get("_packed_seq_ids") is not None:
        packed = _integer_tensor(collated["_packed_seq_ids"], "_packed_seq_ids")
        packed = _require_bt({"_packed_seq_ids": packed}, "_packed_seq_ids", shape)
        if bool((packed < 0).any()):
            raise _error("'_packed_seq_ids' must be 1-based document ids with 0 for padding, got negatives")
        _masks.check_packed_ids(packed)
        return DocumentMap(packed.long() - 1, "_packed_seq_ids")
    if collated.get("seq_lens") is not None:
        return DocumentMap(_ids_from_thd(collated, shape), "seq_lens")
    if collated.get("cu_seqlens") is not None:
        cu = _integer_tensor(collated["cu_seqlens"], "cu_seqlens")
        valid = _plain_valid(collated, shape)
        indices = collated.get("packed_token_indices")
        if isinstance(indices, torch.Tensor):
            valid = _require_bt(collated, "packed_token_indices", shape) >= 0
        if valid is None:
            valid = torch.ones(shape, dtype=torch.bool, device=input_ids.device)
        if collated.get("seq_idx") is not None:
            seq_idx = _require_bt(collated, "seq_idx", shape).long()
            ids = torch.where(valid & (seq_idx >= 0), seq_idx, -1)
            expected = canonical_packed_ids(ids).cu_seqlens
            if not torch.equal(cu.reshape(-1).to(expected), expected):
                raise _error(
                    f"'cu_seqlens' {cu.reshape(-1).tolist()} disagrees with 'seq_idx' ({expected.tolist()})"
                )
            return DocumentMap(ids, "cu_seqlens+seq_idx")
        if cu.dim() == 1 or (cu.dim() == 2 and cu.shape[0] == 1):
            if shape[0] != 1:
                raise _error(
                    f"a flat 'cu_seqlens' cannot be split into B = {shape[0]} rows without 'seq_idx' "
                    "(or a per-row [B, D+1] 'cu_seqlens', or '_packed_seq_ids')"
                )
            cu = cu.reshape(1, -1)
        return DocumentMap(_ids_from_row_cu(cu, valid, "cu_seqlens"), "cu_seqlens")
    if collated.get("cu_seq_lens_q") is not None:
        return DocumentMap(_ids_from_flash_cu(collated, shape), "cu_seq_lens_q")
    mask = collated.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        if tuple(mask.shape) != (shape[0], 1, shape[1], shape[1]):
            raise _error(f"a 4-D 'attention_mask' must be [B, 1, T, T], got {tuple(mask.shape)}")
        return DocumentMap(_ids_from_block_mask(mask), "attention_mask[B,1,T,T]")
    if isinstance(mask, torch.Tensor):
        mask = _require_bt(collated, "attention_mask", shape)
        _masks.check_mask_values(mask)
        return DocumentMap(_run_ids(mask, mask != 0), "attention_mask")
    valid = _plain_valid(collated, shape)
    if valid is not None:
        return DocumentMap(_run_ids(valid, valid), "padding_mask")
    return DocumentMap(torch.zeros(shape, dtype=torch.long, device=input_ids.device), "all tokens")


def _media_counts(collated: Mapping[str, Any], batch: int) -> torch.Tensor | None:
    """Images per row ``[B]`` from explicit counts, else from ``image_grid_thw`` where unambiguous."""
    counts = None
    for key in _MEDIA_COUNT_KEYS:
        if collated.get(key) is not None:
            counts = _integer_tensor(collated[key], key).reshape(-1).long()
            if counts.numel() != batch:
                raise _error(f"{key!r} must have one entry per row (B = {batch}), got {counts.numel()}")
            if bool((counts < 0).any()):
                raise _error(f"{key!r} must be non-negative, got {counts.tolist()}")
            break
    grid = collated.get("image_grid_thw")
    if grid is not None and (not isinstance(grid, torch.Tensor) or grid.dim() != 2 or grid.shape[-1] != 3):
        raise _error(f"'image_grid_thw' must be a [num_images, 3] tensor, got {getattr(grid, 'shape', grid)}")
    if counts is None:
        if grid is None:
            pixels = collated.get("pixel_values")
            if pixels is None:
                return None
            if batch == 1 and isinstance(pixels, torch.Tensor) and pixels.dim() >= 4:
                return torch.tensor([pixels.shape[0]], dtype=torch.long)
            raise _error(
                "'pixel_values' without 'image_grid_thw' or 'n_images_per_sample' cannot be assigned to rows"
            )
        if grid.shape[0] == 0:
            return torch.zeros(batch, dtype=torch.long)
        if batch != 1:
            # The original guessed one image per row when the grid had B rows: wrong for counts [2, 0].
            raise _error(
                f"{grid.shape[0]} images for {batch} rows and no per-row counts; pass 'n_images_per_sample' "
                "(AutoModel's VLM collators emit it)"
            )
        return torch.tensor([grid.shape[0]], dtype=torch.long)
    if grid is not None and int(counts.sum()) != grid.shape[0]:
        raise _error(
            f"media counts {counts.tolist()} sum to {int(counts.sum())} but 'image_grid_thw' has "
            f"{grid.shape[0]} rows"
        )
    pixels = collated.get("pixel_values")
    if grid is not None and isinstance(pixels, torch.Tensor) and pixels.dim() == 2:
        patches = int(grid.long().prod(dim=1).sum())
        if pixels.shape[0] != patches:
            raise _error(
                f"'pixel_values' has {pixels.shape[0]} patch rows but 'image_grid_thw' describes {patches}"
            )
    return counts


def _holds_media(collated: Mapping[str, Any], counts: torch.Tensor | None) -> bool:
    for key in _MEDIA_KEYS:
        value = collated.get(key)
        if isinstance(value, torch.Tensor) and value.numel() > 0:
            return True
        if isinstance(value, list | tuple) and len(value) > 0:
            return True
    return counts is not None and bool(counts.sum() > 0)


def batch_from_automodel(
    collated: Mapping[str, Any],
    *,
    sample_ids: Sequence[str],
    source_metadata: Mapping[str, Any],
    layout: DataLayout | str,
) -> PuzzletronBatch:
    """Normalize an AutoModel VLM/text collator result into `PuzzletronBatch`.

    Labels (``labels``, else ``targets``) arrive shifted and are never shifted again; they are set to -100
    only on padding. ``ce_mask = (loss_mask or labels != -100) & valid``, ``kd_mask`` a copy of it,
    ``hidden_mask = valid``. A packed layout always gets canonical ``seq_ids`` ``[B, T]`` and global cu,
    also when every pack holds one document.

    >>> import torch
    >>> b = batch_from_automodel(
    ...     {"input_ids": torch.arange(8)[None], "_packed_seq_ids": torch.tensor([[1, 1, 1, 2, 2, 2, 0, 0]])},
    ...     sample_ids=["pack-0"], source_metadata={}, layout="packed_varlen")
    >>> b.sequence.global_cu_seqlens.tolist(), b.sequence.seq_ids.tolist()
    ([0, 3, 6], [[0, 0, 0, 1, 1, 1, -1, -1]])
    """
    if not isinstance(collated, Mapping):
        raise _error(f"collated must be a mapping, got {type(collated).__name__}")
    layout = coerce_enum(DataLayout, layout, "batch_from_automodel: layout", error=BatchValidationError)
    input_ids = collated.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() not in (1, 2):
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise _error(f"'input_ids' must be a 1-D or 2-D tensor, got {got}")
    length = int(input_ids.shape[-1])
    rows = {
        key: _as_rows(value, length) if key in _SEQUENCE_KEYS else value for key, value in collated.items()
    }
    positions = rows.get("position_ids")
    if input_ids.dim() == 1 and isinstance(positions, torch.Tensor) and positions.dim() == 2:
        rows["position_ids"] = positions.unsqueeze(1)  # one row of mRoPE positions: [R, T] -> [R, 1, T]
    input_ids = rows["input_ids"]
    shape = (int(input_ids.shape[0]), length)

    doc_map = document_map(rows)
    valid = doc_map.ids >= 0
    if layout is not DataLayout.PACKED_VARLEN:
        # One sample per row: a row holding several documents would lose their boundaries (the consumed
        # '_packed_seq_ids' vanish; cu kwargs would go stale under splits) and attend across documents.
        per_row = run_starts(doc_map.ids, valid).sum(dim=1)
        if bool((per_row > 1).any()):
            row = int(torch.nonzero(per_row > 1)[0])
            raise _error(
                f"row {row} holds {int(per_row[row])} documents (from {doc_map.source!r}) but layout is "
                f"{layout.value!r}; use layout 'packed_varlen' to keep their boundaries"
            )

    labels = rows.get("labels")
    if labels is None:
        labels = rows.get("targets")
    if labels is not None:
        key = "labels" if rows.get("labels") is not None else "targets"
        labels = _require_bt(rows, key, shape)
        labelled = labels != IGNORE_INDEX
        ce_mask = labelled & valid
        if not torch.equal(ce_mask, labelled):  # padding carries a label: copy only then
            labels = labels.masked_fill(~valid, IGNORE_INDEX)
    if rows.get("loss_mask") is not None:
        ce_mask = _require_bt(rows, "loss_mask", shape).bool() & valid
    elif labels is None:
        ce_mask = valid.clone()

    counts = _media_counts(rows, shape[0])
    media_offsets = media_offsets_from_counts(counts) if counts is not None else None
    if layout is DataLayout.PACKED_VARLEN:
        canonical = canonical_packed_ids(doc_map.ids)
        sequence = PackedSequenceMetadata(
            global_cu_seqlens=canonical.cu_seqlens,
            max_seqlen=canonical.max_seqlen,
            seq_ids=canonical.seq_ids,
            sample_offsets=sample_offsets_from_cu(canonical.cu_seqlens),
            media_counts=counts,
            media_offsets=media_offsets,
        )
    else:
        sequence = PackedSequenceMetadata(media_counts=counts, media_offsets=media_offsets)

    model_kwargs = {key: value for key, value in rows.items() if key not in _CONSUMED_KEYS}
    return PuzzletronBatch(
        model_kwargs=model_kwargs,
        **token_targets(labels, ce_mask, valid),
        sequence=sequence,
        sample_ids=sample_ids,
        source_metadata=dict(source_metadata),
        modality=Modality.MULTIMODAL if _holds_media(rows, counts) else Modality.TEXT,
        layout=layout,
    )

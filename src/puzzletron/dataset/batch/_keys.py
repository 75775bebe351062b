"""The vocabulary of a `PuzzletronBatch`: layouts, modalities, the known ``model_kwargs`` keys and the axes
they carry, and the constants every consumer shares.

Row and token operations decide which tensors to slice from these tables, never from a shape coincidence:

==========================  ==============================  ========================================
key                         batch axis (row ops)            sequence axis (``cp_partition``)
==========================  ==============================  ========================================
input_ids, attention_mask,  dim 0 (when 2-D or more)         last dim (a 4-D ``attention_mask`` is
cache_position, seq_idx,                                     refused: it cannot be split exactly)
mm_token_type_ids,
padding_mask, token_type_ids
position_ids                dim 0 of ``[B, T]``, dim 1 of    last dim
                            mRoPE ``[R, B, T]``
inputs_embeds               dim 0 of ``[B, T, H]``          dim 1
packed_token_indices        dim 0 (pad rows: -1)            last dim, then renumbered to the new
                                                            positions (``arange`` where valid)
seq_lens, seq_lens_padded   dim 0 (THD ``[B, max_docs]``,   rebuilt per row from the new ``seq_ids``
                            pad rows: -1000)
cu_seqlens                  per-row ``[B, D+1]`` (-1 after   per-row: rebuilt per row from the new
                            the last boundary): dim 0 (pad   ``seq_ids``; flat: the local cu
                            rows ``[0, -1, ...]``); flat
                            ``[n+1]``: rebuilt per group
n_videos_per_sample,        dim 0 when it has B entries      --
num_patches (+ image
counts)
labels, masks, seq_ids      dim 0                           dim 1
==========================  ==============================  ========================================

A 2-D ``cu_seqlens`` with B rows is AutoModel's per-row form (row-local offsets over each row's valid
tokens); a 1-D one (or ``[1, n+1]`` when B > 1) is flat over the whole batch. For one row both coincide.
Media are per image (``PER_IMAGE_KWARGS``, ``pixel_values`` one entry per image or the flat patches of
every image) and per video (``VIDEO_KWARGS``); media stay whole under ``cp_partition``. Any other tensor
kwarg is passed through unchanged by every row or token operation. The full rules are in
``docs/batch-contract.md``.
"""

from __future__ import annotations

# The label of a token that is not supervised (PyTorch's cross-entropy ``ignore_index``).
IGNORE_INDEX = -100
# AutoModel's THD padding of unused ``seq_lens`` / ``seq_lens_padded`` slots.
THD_SENTINEL = -1000

# Tensors whose last dim is the token axis T (plus HF's token_type_ids).
SEQUENCE_KWARGS = (
    "input_ids",
    "attention_mask",
    "cache_position",
    "seq_idx",
    "mm_token_type_ids",
    "padding_mask",
    "token_type_ids",
)
# AutoModel neat-packing metadata: row-local token positions [B, T], -1 on padding. Gathered like a sequence
# tensor, then renumbered to the positions of the new layout (so it stays arange(T) where valid).
TOKEN_INDEX_KWARGS = ("packed_token_indices",)
# Every token-aligned kwarg ([B, T], mRoPE [R, B, T] for position_ids).
TOKEN_KWARGS = (*SEQUENCE_KWARGS, "position_ids", *TOKEN_INDEX_KWARGS)
# THD per-row document lengths [B, max_docs], padded with THD_SENTINEL.
ROW_KWARGS = ("seq_lens", "seq_lens_padded")
# One entry per row ([B] tensor, list or tuple): sliced with the rows when they have B entries, else passed
# through (batch_from_automodel consumes the image counts; a batch built by hand may still carry them).
PER_ROW_KWARGS = (
    "n_images_per_sample",
    "num_images_per_sample",
    "n_videos_per_sample",
    "num_videos_per_sample",
    "num_patches",
)
# HF flash-varlen kwargs over the flattened B*T tokens: dropped by every split (their offsets cover the whole
# batch); rebuild them with `puzzletron.dataset.clients.attention.forward_kwargs(batch, backend="flash")`.
FLAT_BACKEND_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
PER_IMAGE_KWARGS = ("image_grid_thw", "image_position_ids", "image_sizes")
# Video media: `pixel_values_videos` holds one entry per video or the flat patches of every video (aligned
# through `video_grid_thw`); per-video rows; rows own videos through the first count kwarg present.
VIDEO_KWARGS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
PER_VIDEO_KWARGS = ("video_grid_thw", "second_per_grid_ts")
VIDEO_COUNT_KWARGS = ("n_videos_per_sample", "num_videos_per_sample")

# Padding rows (pad_batch_to_multiple): kwargs not listed here are padded with 0.
ROW_FILL = {
    "seq_idx": -1,
    "padding_mask": True,
    "seq_lens": THD_SENTINEL,
    "seq_lens_padded": THD_SENTINEL,
    "packed_token_indices": -1,
}
FIELD_FILL = {"labels": IGNORE_INDEX, "ce_mask": False, "kd_mask": False, "hidden_mask": False, "seq_ids": -1}
MASK_FIELDS = ("ce_mask", "kd_mask", "hidden_mask")

# A tensor location inside a batch: ("kw", key) for model_kwargs, ("field", name) for labels/masks,
# ("seq", "seq_ids") for the metadata.
TensorPath = tuple[str, str]

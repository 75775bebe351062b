"""The known ``model_kwargs`` keys of a `PuzzletronBatch` and the axes they carry.

Row and token operations decide which tensors to slice from these tables, never from a shape coincidence
(the table with the axes is in the `puzzletron.dataset.batch` docstring). The public names are re-exported
from `puzzletron.dataset.batch`; this module exists so that `_validation` and `_batch_ops` can read them
without importing the batch type (imports flow one way: batch -> _batch_ops/_validation -> _batch_keys).
"""

from __future__ import annotations

__all__ = [
    "FIELD_FILL",
    "FLAT_BACKEND_KWARGS",
    "MASK_FIELDS",
    "PER_IMAGE_KWARGS",
    "PER_ROW_KWARGS",
    "PER_VIDEO_KWARGS",
    "ROW_FILL",
    "ROW_KWARGS",
    "SEQUENCE_KWARGS",
    "THD_SENTINEL",
    "TOKEN_INDEX_KWARGS",
    "VIDEO_COUNT_KWARGS",
    "VIDEO_KWARGS",
    "TensorPath",
]

# Tensors whose last dim is the token axis T (contract 3.1 rule 4, plus HF's token_type_ids).
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
# THD per-row document lengths [B, max_docs], padded with AutoModel's sentinel.
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
# batch); rebuild them with `puzzletron.dataset.automodel.forward_kwargs(batch, backend="flash")`.
FLAT_BACKEND_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
PER_IMAGE_KWARGS = ("image_grid_thw", "image_position_ids", "image_sizes")
# Video media: `pixel_values_videos` holds one entry per video or the flat patches of every video (aligned
# through `video_grid_thw`); per-video rows; rows own videos through the first count kwarg present.
VIDEO_KWARGS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
PER_VIDEO_KWARGS = ("video_grid_thw", "second_per_grid_ts")
VIDEO_COUNT_KWARGS = ("n_videos_per_sample", "num_videos_per_sample")
THD_SENTINEL = -1000

# Padding rows (pad_batch_to_multiple): kwargs not listed here are padded with 0.
ROW_FILL = {
    "seq_idx": -1,
    "padding_mask": True,
    "seq_lens": THD_SENTINEL,
    "seq_lens_padded": THD_SENTINEL,
    "packed_token_indices": -1,
}
FIELD_FILL = {"labels": -100, "ce_mask": False, "kd_mask": False, "hidden_mask": False, "seq_ids": -1}
MASK_FIELDS = ("ce_mask", "kd_mask", "hidden_mask")

# A tensor location inside a batch: ("kw", key) for model_kwargs, ("field", name) for labels/masks,
# ("seq", "seq_ids") for the metadata.
TensorPath = tuple[str, str]

"""Media follow their rows through every split: images (one row each, or flat patches aligned through
``image_grid_thw``) and videos are sliced by row, per-row counts (videos per sample, patches) with B entries
are sliced and others passed through, padding and CP keep media whole and shared. Goldens written by hand;
derived batches are re-validated through the public constructor."""

from __future__ import annotations

import pytest
import torch

from _batch_builders import media_batch, video_batch
from _batch_strategies import revalidated
from puzzletron.dataset import PuzzletronBatch
from puzzletron.dataset.errors import BatchValidationError

# -- images ------------------------------------------------------------------------------------------


def test_dp_slice_media_rows_golden() -> None:
    b = media_batch()
    shards = [b.dp_slice(dp_rank=r, dp_size=3) for r in range(3)]
    assert [s.sample_ids for s in shards] == [("a",), ("b",), ("c",)]
    assert [s.sequence.media_counts.tolist() for s in shards] == [[2], [1], [2]]
    assert [s.model_kwargs["image_grid_thw"].shape[0] for s in shards] == [2, 1, 2]
    assert [s.model_kwargs["pixel_values"][:, 0].tolist() for s in shards] == [[0.0, 1.0], [2.0], [3.0, 4.0]]
    assert [s.sequence.media_offsets.tolist() for s in shards] == [[0, 2], [0, 1], [0, 2]]
    for s in shards:
        revalidated(s)


def test_pp_microbatches_media_golden() -> None:
    groups = media_batch().pp_microbatches(2)
    assert [g.sample_ids for g in groups] == [("a", "b"), ("c",)]
    assert [g.model_kwargs["pixel_values"].shape[0] for g in groups] == [3, 2]
    assert [g.sequence.media_counts.tolist() for g in groups] == [[2, 1], [2]]
    assert [g.sequence.media_offsets.tolist() for g in groups] == [[0, 2, 3], [0, 2]]
    assert [g.model_kwargs["image_grid_thw"].shape[0] for g in groups] == [3, 2]
    assert groups[1].input_ids.tolist() == [[8, 9, 10, 11]]
    for g in groups:
        revalidated(g)


def test_pp_microbatches_align_flat_patches_through_the_grid() -> None:
    groups = media_batch(flat_patches=True).pp_microbatches(2)
    # 4 patch rows per image; images 0,1,2 in group 0 and 3,4 in group 1.
    assert groups[0].model_kwargs["pixel_values"][:, 0].tolist() == [0.0] * 4 + [1.0] * 4 + [2.0] * 4
    assert groups[1].model_kwargs["pixel_values"][:, 0].tolist() == [3.0] * 4 + [4.0] * 4


def test_pp_microbatches_refuse_flat_pixels_without_grid() -> None:
    b = media_batch(flat_patches=True, with_grid=False)
    with pytest.raises(BatchValidationError, match="cannot align flat pixel_values without image_grid_thw"):
        b.pp_microbatches(2)


def test_pad_batch_to_multiple_golden_shares_media() -> None:
    b = media_batch()
    out = b.pad_batch_to_multiple(2)
    assert out.batch_size == 4
    assert out.model_kwargs["pixel_values"].data_ptr() == b.model_kwargs["pixel_values"].data_ptr()
    assert out.model_kwargs["pixel_values"].shape[0] == 5
    assert out.model_kwargs["image_grid_thw"] is b.model_kwargs["image_grid_thw"]
    assert out.sequence.media_counts.tolist() == [2, 1, 2, 0]
    assert out.sequence.media_offsets.tolist() == [0, 2, 3, 5, 5]
    assert out.model_kwargs["attention_mask"][3].tolist() == [0, 0, 0, 0]
    assert out.labels[3].tolist() == [-100] * 4
    assert out.hidden_mask[3].tolist() == [False] * 4
    assert out.ce_mask[3].tolist() == [False] * 4
    assert out.sample_ids == ("a", "b", "c", "__pp_padding_0")
    revalidated(out)


# -- per-row counts (videos per sample, patches) ---------------------------------------------------


def test_row_splits_slice_per_row_counts_with_b_entries_and_pass_others_through() -> None:
    b = media_batch().replace_model_kwargs(
        n_videos_per_sample=torch.tensor([0, 0, 0]),
        num_patches=torch.tensor([2, 1, 2]),
        num_videos_per_sample=[0, 0, 0],
        n_images_per_sample=(2, 1, 2),
        unrelated_counts=torch.tensor([7, 8, 9]),  # not a known key: passed through
    )
    first, second = b.pp_microbatches(2)
    assert first.model_kwargs["num_patches"].tolist() == [2, 1]
    assert second.model_kwargs["num_patches"].tolist() == [2]
    assert second.model_kwargs["n_videos_per_sample"].tolist() == [0]
    assert second.model_kwargs["num_videos_per_sample"] == [0]
    assert first.model_kwargs["n_images_per_sample"] == (2, 1)
    assert second.model_kwargs["unrelated_counts"] is b.model_kwargs["unrelated_counts"]
    rank2 = b.dp_slice(dp_rank=2, dp_size=3)
    assert rank2.model_kwargs["num_patches"].tolist() == [2]
    padded = b.pad_batch_to_multiple(2)
    assert padded.model_kwargs["num_patches"].tolist() == [2, 1, 2, 0]
    assert padded.model_kwargs["n_images_per_sample"] == (2, 1, 2, 0)
    assert padded.model_kwargs["num_videos_per_sample"] == [0, 0, 0, 0]
    # A value without B entries (e.g. one total) is passed through unchanged.
    total = b.replace_model_kwargs(num_patches=torch.tensor([5]))
    assert total.pp_microbatches(3)[1].model_kwargs["num_patches"] is total.model_kwargs["num_patches"]


# -- videos ------------------------------------------------------------------------------------------


def test_row_splits_give_each_row_its_videos_golden() -> None:
    first, second = video_batch().pp_microbatches(2)
    assert first.sample_ids == ("a", "b")
    assert first.model_kwargs["pixel_values_videos"].reshape(-1).tolist() == [0.0] * 8
    assert first.model_kwargs["video_grid_thw"].tolist() == [[2, 2, 2]]
    assert first.model_kwargs["second_per_grid_ts"] == [0.5]
    assert first.model_kwargs["n_videos_per_sample"].tolist() == [1, 0]
    assert second.model_kwargs["pixel_values_videos"].reshape(-1).tolist() == [1.0] * 4 + [2.0] * 2
    assert second.model_kwargs["video_grid_thw"].tolist() == [[1, 2, 2], [2, 1, 1]]
    assert second.model_kwargs["second_per_grid_ts"] == [1.0, 2.0]
    rank1 = video_batch(n_videos_per_sample=[1, 0, 2]).dp_slice(dp_rank=1, dp_size=3)
    assert rank1.model_kwargs["pixel_values_videos"].numel() == 0
    assert rank1.model_kwargs["n_videos_per_sample"] == [0]
    for part in (first, second, rank1):
        revalidated(part)


def test_one_entry_per_video_is_sliced_by_video_range() -> None:
    b = video_batch(pixel_values_videos=torch.tensor([[0.0], [1.0], [2.0]]))
    assert b.dp_slice(dp_rank=2, dp_size=3).model_kwargs["pixel_values_videos"].tolist() == [[1.0], [2.0]]


def test_video_row_splits_need_per_row_counts_and_consistent_ones() -> None:
    no_counts = video_batch()
    no_counts = PuzzletronBatch(
        {k: v for k, v in no_counts.model_kwargs.items() if k != "n_videos_per_sample"}, modality="multimodal"
    )
    with pytest.raises(BatchValidationError, match="n_videos_per_sample"):
        no_counts.pp_microbatches(3)
    assert no_counts.pp_microbatches(1) == (no_counts,)  # a whole batch needs no counts
    with pytest.raises(BatchValidationError, match="must sum to the 3 rows of video_grid_thw"):
        video_batch(n_videos_per_sample=torch.tensor([1, 1, 2]))
    with pytest.raises(BatchValidationError, match=r"'num_videos_per_sample'.*must sum to the 3 rows"):
        video_batch(n_videos_per_sample=None, num_videos_per_sample=[0, 0, 2])


def test_padding_and_cp_keep_videos_whole() -> None:
    b = video_batch()
    padded = b.pad_batch_to_multiple(2)
    assert padded.model_kwargs["pixel_values_videos"] is b.model_kwargs["pixel_values_videos"]
    assert padded.model_kwargs["n_videos_per_sample"].tolist() == [1, 0, 2, 0]
    part = b.cp_partition(torch.tensor([0, 3]), cp_rank=0, cp_size=2)
    assert part.model_kwargs["video_grid_thw"] is b.model_kwargs["video_grid_thw"]
    revalidated(padded)
    revalidated(part)

"""`_segments`: canonical packed ids and the cu / count / offset helpers, against hand-written goldens and a
slow per-token reference."""

from __future__ import annotations

import doctest
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzletron.dataset.batch import cp as parallel
from puzzletron.dataset.batch import segments as _segments
from puzzletron.dataset.batch.segments import (
    canonical_packed_ids,
    counts_per_sample,
    cu_from_counts,
    max_segment_length,
    media_offsets_from_counts,
    patch_offsets_from_grid,
    sample_offsets_from_cu,
    seq_ids_from_cu,
)
from puzzletron.dataset.errors import BatchValidationError


def test_one_row_of_two_samples_and_padding_golden() -> None:
    # AutoModel neat packing: 1-based per row, 0 = padding -> subtract 1 to get our -1 padding.
    r = canonical_packed_ids(torch.tensor([[1, 1, 1, 2, 2, 2, 0, 0]]) - 1)
    assert r.seq_ids.tolist() == [[0, 0, 0, 1, 1, 1, -1, -1]]
    assert r.cu_seqlens.tolist() == [0, 3, 6]
    assert r.cu_seqlens.dtype == torch.int32
    assert r.max_seqlen == 3
    assert r.sample_offsets == ((0, 3), (3, 6))


def test_ids_restarting_per_row_become_globally_unique() -> None:
    r = canonical_packed_ids(torch.tensor([[1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]]) - 1)
    assert r.seq_ids.tolist() == [[0, 0, 0, 1, 1, 1, -1, -1], [2, 2, 2, 2, -1, -1, -1, -1]]
    assert r.cu_seqlens.tolist() == [0, 3, 6, 10]
    assert r.max_seqlen == 4


def test_same_id_at_row_end_and_next_row_start_is_two_samples() -> None:
    r = canonical_packed_ids(torch.tensor([[7, 7, 9, 9], [9, 9, 9, -1]]))
    assert r.seq_ids.tolist() == [[0, 0, 1, 1], [2, 2, 2, -1]]
    assert r.cu_seqlens.tolist() == [0, 2, 4, 7]


def test_padding_inside_a_run_splits_it() -> None:
    r = canonical_packed_ids(torch.tensor([[4, 4, -1, 4, 5]]))
    assert r.seq_ids.tolist() == [[0, 0, -1, 1, 2]]
    assert r.cu_seqlens.tolist() == [0, 2, 3, 4]
    assert r.max_seqlen == 2


def test_all_padding_has_no_sample() -> None:
    r = canonical_packed_ids(torch.full((2, 3), -1))
    assert r.seq_ids.tolist() == [[-1, -1, -1], [-1, -1, -1]]
    assert r.cu_seqlens.tolist() == [0]
    assert r.max_seqlen == 0
    assert r.num_samples == 0


def test_result_unpacks_as_three_values() -> None:
    seq_ids, cu, max_seqlen = canonical_packed_ids(torch.tensor([[0, 0, 1]]))
    assert seq_ids.tolist() == [[0, 0, 1]]
    assert cu.tolist() == [0, 2, 3]
    assert max_seqlen == 2


@pytest.mark.parametrize(
    ("ids", "problem"),
    [
        (torch.tensor([0, 0, 1]), "must be 2-D"),
        (torch.tensor([[0.0, 1.0]]), "must be an integer tensor"),
        ([[0, 1]], "must be a torch.Tensor"),
    ],
)
def test_canonical_ids_reject_non_2d_integer_tensors(ids: object, problem: str) -> None:
    with pytest.raises(BatchValidationError, match=f"ids {problem}"):
        canonical_packed_ids(ids)  # type: ignore[arg-type]


def test_seq_ids_from_cu_marks_tokens_past_the_end_as_padding() -> None:
    assert seq_ids_from_cu(torch.tensor([0, 3, 7, 12]), 12).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2]
    assert seq_ids_from_cu(torch.tensor([0, 2, 3], dtype=torch.int32), 5).tolist() == [0, 0, 1, -1, -1]


def test_seq_ids_from_cu_with_valid_tokens_puts_padding_where_they_say() -> None:
    valid = torch.tensor([False, True, True, False, True, True, True, False])
    assert seq_ids_from_cu(torch.tensor([0, 2, 5]), 8, valid=valid).tolist() == [-1, 0, 0, -1, 1, 1, 1, -1]


def test_counts_ignore_padding_and_out_of_range_ids() -> None:
    ids = torch.tensor([[0, 0, 2, -1], [2, 5, 1, -1]])
    assert counts_per_sample(ids, 3).tolist() == [2, 1, 2]


def test_cu_helpers() -> None:
    assert cu_from_counts(torch.tensor([3, 1, 4])).tolist() == [0, 3, 4, 8]
    assert max_segment_length(torch.tensor([0, 3, 4, 8])) == 4
    assert max_segment_length(torch.tensor([0])) == 0
    assert sample_offsets_from_cu(torch.tensor([0, 3, 4])) == ((0, 3), (3, 4))


def test_media_and_patch_offsets() -> None:
    assert media_offsets_from_counts(torch.tensor([2, 0, 1])).tolist() == [0, 2, 2, 3]
    grid = torch.tensor([[1, 2, 2], [1, 1, 1], [2, 2, 3]])
    assert patch_offsets_from_grid(grid).tolist() == [0, 4, 5, 17]
    with pytest.raises(ValueError, match="image_grid_thw"):
        patch_offsets_from_grid(torch.tensor([1, 2, 2]))


def _reference_canonical(rows: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Slow per-token oracle: walk every row, open a new sample at every change of non-negative id."""
    next_id, out, lengths = 0, [], []
    for row in rows:
        current, prev = [], None
        for value in row:
            if value < 0:
                current.append(-1)
                prev = None
                continue
            if value != prev:
                lengths.append(0)
                next_id += 1
            lengths[-1] += 1
            current.append(next_id - 1)
            prev = value
        out.append(current)
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return out, cu


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda b: st.integers(1, 12).flatmap(
            lambda t: st.lists(st.lists(st.integers(-1, 3), min_size=t, max_size=t), min_size=b, max_size=b)
        )
    )
)
def test_canonical_ids_match_a_per_token_reference(rows: list[list[int]]) -> None:
    want_ids, want_cu = _reference_canonical(rows)
    r = canonical_packed_ids(torch.tensor(rows))
    assert r.seq_ids.tolist() == want_ids
    assert r.cu_seqlens.tolist() == want_cu
    assert r.max_seqlen == max((b - a for a, b in itertools.pairwise(want_cu)), default=0)


@pytest.mark.parametrize("module", [_segments, parallel], ids=lambda m: m.__name__)
def test_docstring_examples_run(module: object) -> None:
    result = doctest.testmod(module)  # type: ignore[arg-type]
    assert result.attempted > 0
    assert result.failed == 0


def test_row_document_lengths_count_following_padding_in_spans_and_skip_leading_padding() -> None:
    from puzzletron.dataset.batch.segments import row_cu_from_seq_ids, row_document_lengths

    ids = torch.tensor([[-1, 4, 4, -1, 5, -1], [-1] * 6, [7, 7, 7, 7, 7, 7]])
    lengths, spans = row_document_lengths(ids, 2)
    assert lengths.tolist() == [[2, 1], [-1, -1], [6, -1]]
    assert spans.tolist() == [[3, 2], [-1, -1], [6, -1]]  # the leading padding token is in no span
    assert row_cu_from_seq_ids(ids, 3).tolist() == [[0, 2, 3], [0, -1, -1], [0, 6, -1]]

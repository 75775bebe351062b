"""Rows -> `PuzzletronBatch` in the three layouts: hand-written goldens of packed rows (samples numbered
globally, empty rows padded, cu of zero samples), padded and fixed rows (pad, truncate), errors naming the
samples, the planner and the builder together placing every token of every sample once, and split or
truncated pieces as documents of their own with no target across the cut."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzletron.dataset.batch import DataLayout
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
from puzzletron.dataset.packing import PackingError, TokenizedSamples, build_batch, plan_packing


def _abc() -> TokenizedSamples:
    ids = [[1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13, 14, 15]]
    labels = [[2, 3, 4, 5, -100], [-100, 8, 9, -100], [11, -100, 13, 14, 15, -100]]
    return TokenizedSamples.from_lists(ids, labels, sample_ids=["a", "b", "c"])


def _packed_spec(pack_size: int) -> PuzzletronDataSpec:
    return PuzzletronDataSpec("text", "packed_varlen", pack_size, PackingSpec(pack_size=pack_size))


def test_packed_row_golden():
    batch = build_batch(_abc(), [[0, 1, 2]], spec=_packed_spec(16), pad_token_id=99)
    assert batch.layout is DataLayout.PACKED_VARLEN
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 99]]
    assert batch.sequence.seq_ids.tolist() == [[0] * 5 + [1] * 4 + [2] * 6 + [-1]]
    assert batch.model_kwargs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0]]
    assert batch.sequence.global_cu_seqlens.tolist() == [0, 5, 9, 15]
    assert batch.sequence.max_seqlen == 6
    assert batch.sequence.sample_offsets == ((0, 5), (5, 9), (9, 15))
    assert batch.labels.tolist() == [[2, 3, 4, 5, -100, -100, 8, 9, -100, 11, -100, 13, 14, 15, -100, -100]]
    assert batch.ce_mask.tolist() == (batch.labels != -100).tolist() == batch.kd_mask.tolist()
    assert batch.hidden_mask.tolist() == [[True] * 15 + [False]]
    assert "attention_mask" not in batch.model_kwargs
    assert batch.sample_ids == ("a|b|c",)
    assert batch.source_metadata["document_ids"] == ["a", "b", "c"]


def test_packed_rows_renumber_samples_globally_and_pad_empty_rows():
    batch = build_batch(_abc(), [[2], [0, 1], []], spec=_packed_spec(12))
    assert batch.sequence.seq_ids.tolist() == [
        [0] * 6 + [-1] * 6,
        [1] * 5 + [2] * 4 + [-1] * 3,
        [-1] * 12,
    ]
    assert batch.sequence.global_cu_seqlens.tolist() == [0, 6, 11, 15]
    assert batch.sample_ids == ("c", "a|b", "__padding_2")
    assert not batch.hidden_mask[2].any() and (batch.labels[2] == -100).all()


def test_a_packed_batch_of_padding_rows_only_carries_cu_of_zero_samples_and_seq_ids():
    batch = build_batch(_abc(), [[], []], spec=_packed_spec(4))
    assert batch.layout is DataLayout.PACKED_VARLEN
    assert batch.sequence.global_cu_seqlens.tolist() == [0]
    assert batch.sequence.seq_ids.tolist() == [[-1] * 4, [-1] * 4]
    assert batch.sequence.max_seqlen == 0
    assert batch.sequence.sample_offsets == ()
    assert not batch.hidden_mask.any() and (batch.labels == -100).all()
    assert batch.sample_ids == ("__padding_0", "__padding_1")


def test_a_row_over_pack_size_is_an_error_naming_its_samples():
    with pytest.raises(
        PackingError, match=r"row 0 holds 15 tokens > pack_size 12: samples \['a', 'b', 'c'\]"
    ):
        build_batch(_abc(), [[0, 1, 2]], spec=_packed_spec(12))


def test_padded_layout_pads_right_to_a_multiple_and_truncates_to_max_sample_length():
    spec = PuzzletronDataSpec("text", "padded_varlen", 5)
    batch = build_batch(_abc(), [[2], [1], []], spec=spec, pad_to_multiple_of=4)
    assert batch.layout is DataLayout.PADDED_VARLEN
    assert batch.input_ids.tolist() == [[10, 11, 12, 13, 14, 0, 0, 0], [6, 7, 8, 9, 0, 0, 0, 0], [0] * 8]
    assert batch.model_kwargs["attention_mask"].tolist() == [[1] * 5 + [0] * 3, [1] * 4 + [0] * 4, [0] * 8]
    assert batch.labels.tolist()[1] == [-100, 8, 9, -100, -100, -100, -100, -100]
    assert batch.hidden_mask.tolist() == batch.model_kwargs["attention_mask"].bool().tolist()
    assert batch.sequence.seq_ids is None and batch.sequence.global_cu_seqlens is None


def test_fixed_layout_pads_or_truncates_to_max_sample_length():
    spec = PuzzletronDataSpec("text", "fixed", 5)
    batch = build_batch(_abc(), [[2], [1]], spec=spec)
    assert batch.layout is DataLayout.FIXED
    assert batch.input_ids.tolist() == [[10, 11, 12, 13, 14], [6, 7, 8, 9, 0]]
    # Truncation keeps the first 5 tokens and their targets (still the true next tokens).
    assert batch.labels.tolist() == [[11, -100, 13, 14, 15], [-100, 8, 9, -100, -100]]


def test_unpacked_layouts_take_one_sample_per_row():
    with pytest.raises(ValueError, match="row 0 holds 2 samples; layout fixed takes one per row"):
        build_batch(_abc(), [[0, 1]], spec=PuzzletronDataSpec("text", "fixed", 8))


def test_labels_that_cross_a_document_boundary_are_rejected():
    with pytest.raises(ValueError, match=r"labels of sample 1 \('y'\) end with a target"):
        TokenizedSamples.from_lists([[1, 2], [3, 4]], [[2, -100], [4, 9]], sample_ids=["x", "y"])


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=40), seed=st.integers(0, 1000))
def test_plan_then_build_puts_every_token_of_every_sample_in_its_place_once(lengths, seed):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, 1000, size=n).tolist() for n in lengths]
    labels = [[*x[1:], -100] for x in ids]
    samples = TokenizedSamples.from_lists(ids, labels)
    spec = _packed_spec(32)
    plan = plan_packing(samples.lengths, spec.packing, seed=seed)
    batch = build_batch(samples, plan.rows, spec=spec)
    seq_ids, tokens = batch.sequence.seq_ids, batch.input_ids
    names = batch.source_metadata["document_ids"]
    assert sorted(int(n) for n in names) == list(range(len(lengths)))
    for k, name in enumerate(names):
        assert tokens[seq_ids == k].tolist() == ids[int(name)]
        assert batch.labels[seq_ids == k].tolist() == labels[int(name)]
    cu = batch.sequence.global_cu_seqlens
    valid_labels = batch.labels[batch.hidden_mask]
    assert (valid_labels[cu[1:].long() - 1] == -100).all()  # no target crosses a document boundary
    assert torch.equal(batch.sequence.seq_ids >= 0, batch.hidden_mask)


# -- long-sample policies ---------------------------------------------------------------------------


def _policy_samples() -> TokenizedSamples:
    """Samples of 3, 10 and 6 tokens; ids 100*s + position, labels the next id (last -100)."""
    ids = [[100 * s + t for t in range(n)] for s, n in enumerate((3, 10, 6))]
    labels = [[*x[1:], -100] for x in ids]
    return TokenizedSamples.from_lists(ids, labels, sample_ids=["a", "b", "c"])


def test_a_split_piece_is_its_own_document_with_its_last_label_ignored() -> None:
    samples = _policy_samples()
    spec = PuzzletronDataSpec("text", "packed_varlen", 4, PackingSpec(4, long_samples="split"))
    plan = plan_packing(samples.lengths, spec.packing, seed=0)
    piece = next(u for u in range(len(plan.units)) if plan.units.sample[u] == 1 and plan.units.start[u] == 4)
    batch = build_batch(samples, [(piece,)], spec=spec, units=plan.units)
    assert batch.input_ids[0].tolist() == [104, 105, 106, 107]
    assert batch.labels[0].tolist() == [105, 106, 107, -100]  # 108 starts the next piece: not a target here
    assert batch.model_kwargs["position_ids"][0].tolist() == [0, 1, 2, 3]
    assert batch.sample_ids == ("b#1",) and batch.source_metadata["document_ids"] == ["b#1"]


def test_truncate_packs_the_prefix_and_ends_its_supervision_at_the_cut() -> None:
    samples = _policy_samples()
    spec = PuzzletronDataSpec("text", "packed_varlen", 8, PackingSpec(8, long_samples="truncate"))
    plan = plan_packing(samples.lengths, spec.packing, seed=0)
    batch = build_batch(samples, [(1,)], spec=spec, units=plan.units)
    assert batch.input_ids[0].tolist() == list(range(100, 108))
    assert batch.labels[0].tolist() == [*range(101, 108), -100]
    assert batch.sample_ids == ("b",)  # a truncated sample keeps its name: it is one document


def test_build_batch_takes_a_data_mapping_as_its_spec() -> None:
    from puzzletron.dataset.errors import ConfigError
    from puzzletron.dataset.packing import TokenizedSamples, build_batch

    samples = TokenizedSamples.from_lists([[1, 2, 3], [4, 5]], [[2, 3, -100], [5, -100]])
    raw = {"modality": "text", "layout": "packed_varlen", "max_sample_length": 8, "packing": {"pack_size": 8}}
    batch = build_batch(samples, [[0, 1]], spec=raw)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    with pytest.raises(ConfigError, match="build_batch: spec must be a PuzzletronDataSpec"):
        build_batch(samples, [[0, 1]], spec=["packed_varlen"])

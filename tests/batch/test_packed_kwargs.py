"""AutoModel's per-row packing kwargs (``cu_seqlens`` ``[B, D+1]``, ``packed_token_indices``), THD
``seq_lens``/``seq_lens_padded`` and flash ``cu_seq_lens_q/k`` across the splits: row splits slice the
per-row ones, `cp_partition` and `dp_slice` of a packed row rebuild them for the local layout, flat flash
kwargs are dropped and `forward_kwargs` rebuilds them; with the regressions the property tests found."""

from __future__ import annotations

import dataclasses

import torch

from _batch_builders import packed_row
from _batch_strategies import revalidated
from puzzletron.dataset import PackedSequenceMetadata, PuzzletronBatch

# -- AutoModel per-row packing metadata, THD and flash kwargs across splits ------------------------


def neat_rows() -> PuzzletronBatch:
    """AutoModel neat-packing output of 3 rows of 6 tokens (per-row cu, token indices) as a batch."""
    from puzzletron.dataset.clients.automodel.adapter import batch_from_automodel

    doc = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0], [1, 2, 3, 0, 0, 0]])
    collated = {
        "input_ids": torch.arange(18).reshape(3, 6),
        "labels": torch.arange(18).reshape(3, 6),
        "_packed_seq_ids": doc,
        "packed_token_indices": torch.tensor(
            [[0, 1, 2, 3, 4, -1], [0, 1, 2, 3, -1, -1], [0, 1, 2, -1, -1, -1]]
        ),
        "cu_seqlens": torch.tensor([[0, 3, 5, -1], [0, 4, -1, -1], [0, 1, 2, 3]], dtype=torch.int32),
        "max_seqlen": 4,
        "cu_seq_lens_q": torch.tensor([0, 3, 5, 6, 10, 12, 13, 14, 15, 18], dtype=torch.int32),
        "max_length_q": 4,
    }
    return batch_from_automodel(
        collated, sample_ids=["r0", "r1", "r2"], source_metadata={}, layout="packed_varlen"
    )


def test_pp_microbatches_slice_per_row_cu_and_token_indices_and_drop_flat_flash_kwargs() -> None:
    first, second = neat_rows().pp_microbatches(2)
    assert first.model_kwargs["cu_seqlens"].tolist() == [[0, 3, 5, -1], [0, 4, -1, -1]]
    assert first.model_kwargs["cu_seqlens"].dtype == torch.int32
    assert first.model_kwargs["packed_token_indices"].tolist() == [[0, 1, 2, 3, 4, -1], [0, 1, 2, 3, -1, -1]]
    assert first.model_kwargs["max_seqlen"] == 4
    assert first.sequence.global_cu_seqlens.tolist() == [0, 3, 5, 9]
    assert second.model_kwargs["cu_seqlens"].tolist() == [[0, 1, 2, 3]]
    assert second.model_kwargs["packed_token_indices"].tolist() == [[0, 1, 2, -1, -1, -1]]
    assert second.model_kwargs["max_seqlen"] == 1
    for group in (first, second):
        assert not {"cu_seq_lens_q", "max_length_q"} & set(group.model_kwargs)
        revalidated(group)


def test_dp_slice_row_blocks_slice_per_row_cu() -> None:
    rank1 = neat_rows().dp_slice(dp_rank=1, dp_size=3)
    assert rank1.model_kwargs["cu_seqlens"].tolist() == [[0, 4, -1, -1]]
    assert rank1.model_kwargs["packed_token_indices"].tolist() == [[0, 1, 2, 3, -1, -1]]
    assert rank1.model_kwargs["max_seqlen"] == 4
    assert "cu_seq_lens_q" not in rank1.model_kwargs
    revalidated(rank1)


def test_pad_batch_pads_per_row_cu_like_automodel_and_it_still_flattens() -> None:
    from nemo_automodel.components.models.common.packing import flatten_packed_sequence_metadata

    out = neat_rows().pad_batch_to_multiple(2)
    cu, indices = out.model_kwargs["cu_seqlens"], out.model_kwargs["packed_token_indices"]
    assert cu[3].tolist() == [0, -1, -1, -1]  # AutoModel's own form of a row without documents
    assert indices[3].tolist() == [-1] * 6
    assert "cu_seq_lens_q" not in out.model_kwargs
    flat_indices, flat_cu = flatten_packed_sequence_metadata(indices, cu, batch_size=4, sequence_length=6)
    assert flat_indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 12, 13, 14]
    assert flat_cu.tolist() == [0, 3, 5, 9, 10, 11, 12]
    revalidated(out)


def thd_rows() -> PuzzletronBatch:
    """2 packed rows of 6 tokens with THD lengths, per-row cu, token indices and flash kwargs."""
    seq_ids = torch.tensor([[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]])
    hidden = seq_ids >= 0
    return PuzzletronBatch(
        model_kwargs={
            "input_ids": torch.arange(12).reshape(2, 6),
            "seq_lens": torch.tensor([[3, 2], [4, -1000]]),
            "seq_lens_padded": torch.tensor([[3, 3], [6, -1000]]),
            "cu_seqlens": torch.tensor([[0, 3, 5], [0, 4, -1]], dtype=torch.int32),
            "packed_token_indices": torch.tensor([[0, 1, 2, 3, 4, -1], [0, 1, 2, 3, -1, -1]]),
            "max_seqlen": 4,
            "cu_seq_lens_q": torch.tensor([0, 3, 5, 6, 10, 12], dtype=torch.int32),
            "cu_seq_lens_k": torch.tensor([0, 3, 5, 6, 10, 12], dtype=torch.int32),
            "max_length_q": 4,
            "max_length_k": 4,
        },
        hidden_mask=hidden,
        sequence=PackedSequenceMetadata(
            global_cu_seqlens=torch.tensor([0, 3, 5, 9], dtype=torch.int32), seq_ids=seq_ids, max_seqlen=4
        ),
        layout="packed_varlen",
    )


def test_cp_partition_rebuilds_per_row_kwargs_for_the_local_layout() -> None:
    b = thd_rows()
    r0 = b.cp_partition(torch.tensor([0, 1, 4, 5]), cp_rank=0, cp_size=2)
    assert r0.sequence.seq_ids.tolist() == [[0, 0, 1, -1], [2, 2, -1, -1]]
    assert r0.sequence.local_cu_seqlens.tolist() == [0, 2, 3, 5]
    assert r0.model_kwargs["cu_seqlens"].tolist() == [[0, 2, 3], [0, 2, -1]]
    assert r0.model_kwargs["cu_seqlens"].dtype == torch.int32
    assert r0.model_kwargs["packed_token_indices"].tolist() == [[0, 1, 2, -1], [0, 1, -1, -1]]
    assert r0.model_kwargs["seq_lens"].tolist() == [[2, 1], [2, -1000]]
    assert r0.model_kwargs["seq_lens_padded"].tolist() == [[2, 2], [4, -1000]]
    assert r0.model_kwargs["max_seqlen"] == 2
    r1 = b.cp_partition(torch.tensor([2, 3]), cp_rank=1, cp_size=2)
    assert r1.sequence.local_cu_seqlens.tolist() == [0, 1, 2, 4]
    assert r1.model_kwargs["cu_seqlens"].tolist() == [[0, 1, 2], [0, 2, -1]]
    assert r1.model_kwargs["packed_token_indices"].tolist() == [[0, 1], [0, 1]]
    assert r1.model_kwargs["seq_lens"].tolist() == [[1, 1], [2, -1000]]
    assert r1.model_kwargs["seq_lens_padded"].tolist() == [[1, 1], [2, -1000]]
    for part in (r0, r1):
        assert not {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"} & set(part.model_kwargs)
        revalidated(part)


def test_cp_partition_gives_a_row_starting_with_padding_a_zero_length_thd_document() -> None:
    from puzzletron.dataset.clients.automodel.adapter import document_map

    # THD row: document 0 (2 tokens + 2 padding), document 1 (2 tokens).
    b = packed_row(
        [2, 2],
        6,
        seq_lens=torch.tensor([[2, 2]]),
        seq_lens_padded=torch.tensor([[4, 2]]),
    )
    b = dataclasses.replace(
        b,
        model_kwargs={**b.model_kwargs, "input_ids": torch.tensor([[0, 1, 9, 9, 4, 5]])},
        sequence=dataclasses.replace(b.sequence, seq_ids=torch.tensor([[0, 0, -1, -1, 1, 1]])),
        hidden_mask=torch.tensor([[True, True, False, False, True, True]]),
        labels=None,
        ce_mask=None,
        kd_mask=None,
    )
    part = b.cp_partition(torch.tensor([2, 3, 4, 5]), cp_rank=1, cp_size=2)
    assert part.model_kwargs["seq_lens"].tolist() == [[0, 2]]
    assert part.model_kwargs["seq_lens_padded"].tolist() == [[2, 2]]
    # AutoModel's reading of the rebuilt THD kwargs finds exactly the local tokens of document 1.
    assert document_map(part.model_kwargs).ids.tolist() == [[-1, -1, 1, 1]]


def test_dp_slice_of_a_packed_row_rebuilds_thd_lengths_and_token_indices() -> None:
    b = packed_row(
        [3, 3, 2, 4],
        14,
        seq_lens=torch.tensor([[3, 3, 2, 4]]),
        seq_lens_padded=torch.tensor([[3, 3, 2, 6]]),
        packed_token_indices=torch.tensor([[*range(12), -1, -1]]),
        cu_seq_lens_q=torch.tensor([0, 3, 6, 8, 12, 14], dtype=torch.int32),
        max_length_q=4,
    )
    r0, r1 = (b.dp_slice(dp_rank=r, dp_size=2) for r in range(2))
    assert r0.model_kwargs["seq_lens"].tolist() == [[3, 3, -1000, -1000]]
    assert r0.model_kwargs["seq_lens_padded"].tolist() == [[3, 3, -1000, -1000]]
    assert r1.model_kwargs["seq_lens"].tolist() == [[2, 4, -1000, -1000]]
    assert r1.model_kwargs["seq_lens_padded"].tolist() == [[2, 4, -1000, -1000]]
    assert r1.model_kwargs["packed_token_indices"].tolist() == [[0, 1, 2, 3, 4, 5]]
    for part in (r0, r1):
        assert not {"cu_seq_lens_q", "max_length_q"} & set(part.model_kwargs)
        revalidated(part)


def test_flash_kwargs_dropped_by_a_split_are_rebuilt_by_forward_kwargs() -> None:
    from puzzletron.dataset.clients.automodel.adapter import forward_kwargs

    part = thd_rows().cp_partition(torch.tensor([0, 1, 4, 5]), cp_rank=0, cp_size=2)
    flash = forward_kwargs(part, backend="flash")
    # Flattened local tokens: row 0 runs [0 0][1][pad], row 1 runs [2 2][pad pad].
    assert flash["cu_seq_lens_q"].tolist() == [0, 2, 3, 4, 6, 8]
    assert flash["max_length_q"] == 2


# -- regressions found by the property tests --------------------------------------------------------


def test_a_cp_rank_without_tokens_rebuilds_thd_lengths() -> None:
    # T=2 over 3 ranks: the balanced split leaves rank 1 with no token at all (it used to raise IndexError).
    b = packed_row([1], 2, seq_lens=torch.tensor([[1]]), seq_lens_padded=torch.tensor([[2]]))
    empty = b.cp_partition(torch.tensor([], dtype=torch.long), cp_rank=1, cp_size=3)
    assert empty.sequence_length == 0
    assert empty.model_kwargs["seq_lens"].tolist() == [[-1000]]
    assert empty.sequence.local_cu_seqlens.tolist() == [0]
    revalidated(empty)


def test_one_row_of_per_row_cu_keeps_its_minus_one_padding_across_cp() -> None:
    from puzzletron.dataset.batch.cp import batch_cp_indices, gather_cp_partitions

    # A row of a larger AutoModel batch: cu_seqlens [1, D+1] padded with -1 after its one document.
    b = packed_row([4], 8, cu_seqlens=torch.tensor([[0, 4, -1]], dtype=torch.int32))
    indices = [batch_cp_indices(b, cp_rank=r, cp_size=2) for r in range(2)]
    parts = [b.cp_partition(i, cp_rank=r, cp_size=2) for r, i in enumerate(indices)]
    assert [p.model_kwargs["cu_seqlens"].tolist() for p in parts] == [[[0, 2, -1]], [[0, 2, -1]]]
    assert gather_cp_partitions(parts, indices).model_kwargs["cu_seqlens"].tolist() == [[0, 4, -1]]

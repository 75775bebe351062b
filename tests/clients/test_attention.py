"""`puzzletron.dataset.clients.attention`: the attention kwargs of a packed batch reproduce per-document
causal attention, and `model_inputs` hands HF the labels so that nothing is shifted twice.

A minimal varlen attention written here consumes the kwargs (flash ``cu_seq_lens_q/k``; Transformer Engine
``cu_seqlens`` + ``cu_seqlens_padded``; Megatron-Core ``PackedSeqParams``, which Megatron hands to TE) and is
compared, in float64 on the CPU, with attention computed document by document from the batch's own token ->
document map. Also after `cp_partition`, with local cu. The sdpa/eager masks are compared with the masks HF
and AutoModel build themselves. Real models run in ``test_model_inputs.py``.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from nemo_automodel.components.datasets.utils import neat_packed_collater
from transformers import Qwen2Config
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from puzzletron.dataset import batch_from_automodel
from puzzletron.dataset.batch.cp import batch_cp_indices
from puzzletron.dataset.clients.attention import model_inputs
from puzzletron.dataset.clients.automodel.adapter import forward_kwargs
from puzzletron.dataset.errors import BatchValidationError, ConfigError

HEADS, DIM = 2, 4


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of one sequence: q, k, v [L, H, D] -> [L, H, D]."""
    scores = torch.einsum("qhd,khd->hqk", q, k) / DIM**0.5
    future = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def flash_varlen_reference(q, k, v, *, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, **_):
    """What ``flash_attn_varlen_func(causal=True)`` computes over flat [N, H, D] tokens."""
    assert torch.equal(cu_seq_lens_q, cu_seq_lens_k) and max_length_q == max_length_k
    out = torch.zeros_like(q)
    cu = cu_seq_lens_q.tolist()
    assert cu[-1] == q.shape[0]
    for start, stop in itertools.pairwise(cu):
        assert stop - start <= max_length_q
        out[start:stop] = _causal(q[start:stop], k[start:stop], v[start:stop])
    return out


def te_thd_reference(q, k, v, *, cu_seqlens_q, cu_seqlens_q_padded, max_seqlen_q, **_):
    """Transformer Engine THD, ``padding_causal``: sequence i holds the first ``cu[i+1]-cu[i]`` tokens of
    its padded span ``[cu_padded[i], cu_padded[i+1])``; outputs on padding are zero."""
    out = torch.zeros_like(q)
    lengths = cu_seqlens_q.diff().tolist()
    starts = cu_seqlens_q_padded.tolist()
    assert starts[-1] == q.shape[0]
    for length, start, stop in zip(lengths, starts[:-1], starts[1:], strict=True):
        assert length <= stop - start and length <= max_seqlen_q
        span = slice(start, start + length)
        out[span] = _causal(q[span], k[span], v[span])
    return out


@dataclasses.dataclass
class PackedSeqParams:
    """Megatron-Core's ``PackedSeqParams`` up to ``max_seqlen_kv`` (NVIDIA/Megatron-LM
    ``megatron/core/packed_seq_params.py``; later fields default to None): a kwarg it lacks is a TypeError."""

    qkv_format: str | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None


def megatron_reference(q, k, v, **kwargs):
    """Megatron-Core builds ``PackedSeqParams(**kwargs)`` and hands its fields to TE's
    ``DotProductAttention`` (``padding_causal``): every field filled, int32 cu, then TE's THD semantics."""
    params = PackedSeqParams(**kwargs)
    assert all(getattr(params, f.name) is not None for f in dataclasses.fields(params))
    assert params.qkv_format == "thd"
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert getattr(params, name).dtype == torch.int32
    assert (
        torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv) and params.max_seqlen_q == params.max_seqlen_kv
    )
    assert isinstance(params.max_seqlen_q, int)
    return te_thd_reference(
        q,
        k,
        v,
        cu_seqlens_q=params.cu_seqlens_q,
        cu_seqlens_q_padded=params.cu_seqlens_q_padded,
        max_seqlen_q=params.max_seqlen_q,
    )


VARLEN = [("flash", flash_varlen_reference), ("te_thd", te_thd_reference), ("megatron", megatron_reference)]


def per_document(q, k, v, seq_ids: torch.Tensor) -> torch.Tensor:
    """Ground truth: each document's tokens (in order) attend causally among themselves."""
    flat = seq_ids.reshape(-1)
    out = torch.zeros_like(q)
    for doc in flat[flat >= 0].unique().tolist():
        where = torch.nonzero(flat == doc).flatten()
        out[where] = _causal(q[where], k[where], v[where])
    return out


def _qkv(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return tuple(torch.randn(n, HEADS, DIM, generator=g, dtype=torch.float64) for _ in range(3))


def _packed(doc_ids: list[list[int]]):
    ids = torch.tensor(doc_ids)
    return batch_from_automodel(
        {"input_ids": torch.arange(ids.numel()).reshape(ids.shape), "_packed_seq_ids": ids},
        sample_ids=[f"pack-{i}" for i in range(ids.shape[0])],
        source_metadata={},
        layout="packed_varlen",
    )


def _expected_positions(seq_ids: torch.Tensor) -> torch.Tensor:
    flat = seq_ids.reshape(-1).tolist()
    row_length = seq_ids.shape[-1]
    positions, previous, run = [], None, 0
    for i, doc in enumerate(flat):
        run = run + 1 if (doc == previous and i % row_length) else 0
        positions.append(run)
        previous = doc
    return torch.tensor(positions).reshape(seq_ids.shape)


PACKS = {
    "one-row": [[1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0, 0]],
    "two-rows": [[1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]],
    "full-rows": [[1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1]],
}


@pytest.mark.parametrize("name", sorted(PACKS))
@pytest.mark.parametrize(("backend", "reference"), VARLEN)
def test_packed_attention_equals_per_document_attention(name: str, backend: str, reference) -> None:
    batch = _packed(PACKS[name])
    kwargs = forward_kwargs(batch, backend=backend)
    seq_ids = batch.sequence.seq_ids
    q, k, v = _qkv(seq_ids.numel())
    valid = (seq_ids >= 0).reshape(-1)
    got = reference(q, k, v, **kwargs)
    want = per_document(q, k, v, seq_ids)
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=1e-12)
    if backend == "megatron":  # PackedSeqParams fields only; positions go to the model's forward
        assert set(kwargs) == {f.name for f in dataclasses.fields(PackedSeqParams)}
        return
    positions = kwargs["position_ids"]
    assert torch.equal(positions[seq_ids >= 0], _expected_positions(seq_ids)[seq_ids >= 0])


def test_flash_kwargs_agree_with_hf_position_id_derivation() -> None:
    batch = _packed(PACKS["two-rows"])
    kwargs = forward_kwargs(batch, backend="flash")
    (cu_q, _), (max_q, _) = prepare_fa_kwargs_from_position_ids(kwargs["position_ids"])
    assert torch.equal(cu_q, kwargs["cu_seq_lens_q"])
    assert int(max_q) == kwargs["max_length_q"]
    # Physical cu over B*T: documents and padding runs; rows never merge.
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 6, 8, 15, 16]
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32


def test_te_kwargs_golden() -> None:
    kwargs = forward_kwargs(_packed(PACKS["two-rows"]), backend="te_thd")
    assert kwargs["qkv_format"] == "thd"
    assert kwargs["cu_seqlens_q"].tolist() == [0, 3, 6, 13]
    assert kwargs["cu_seqlens_q_padded"].tolist() == [0, 3, 8, 16]  # row 0's padding follows its last doc
    assert kwargs["max_seqlen_q"] == 7
    assert kwargs["cu_seqlens_q"].dtype == torch.int32


@pytest.mark.parametrize(("backend", "reference"), VARLEN)
def test_after_cp_partition_local_kwargs_match_local_documents(backend: str, reference) -> None:
    # Contract golden: 16 tokens, samples 4/6/6; rank 0 of 2 holds [0,1,4,5,10,11,12,13]
    # -> local cu [0,2,4,8].
    batch = _packed([[1] * 4 + [2] * 6 + [3] * 6])
    local = batch.cp_partition(torch.tensor([0, 1, 4, 5, 10, 11, 12, 13]), cp_rank=0, cp_size=2)
    assert local.sequence.local_cu_seqlens.tolist() == [0, 2, 4, 8]
    kwargs = forward_kwargs(local, backend=backend)
    cu_key = "cu_seq_lens_q" if backend == "flash" else "cu_seqlens_q"
    assert kwargs[cu_key].tolist() == [0, 2, 4, 8]
    q, k, v = _qkv(8)
    torch.testing.assert_close(
        reference(q, k, v, **kwargs), per_document(q, k, v, local.sequence.seq_ids), rtol=0, atol=1e-12
    )


def test_after_cp_partition_with_padding_and_two_rows() -> None:
    batch = _packed(PACKS["two-rows"])
    local = batch.cp_partition(torch.tensor([0, 2, 3, 5, 6]), cp_rank=1, cp_size=2)
    seq_ids = local.sequence.seq_ids
    assert seq_ids.tolist() == [[0, 0, 1, 1, -1], [2, 2, 2, 2, 2]]
    for backend, reference in VARLEN:
        kwargs = forward_kwargs(local, backend=backend)
        q, k, v = _qkv(seq_ids.numel())
        valid = (seq_ids >= 0).reshape(-1)
        torch.testing.assert_close(
            reference(q, k, v, **kwargs)[valid], per_document(q, k, v, seq_ids)[valid], rtol=0, atol=1e-12
        )


def test_a_document_split_into_two_runs_is_an_error_not_a_dropped_boundary() -> None:
    batch = _packed([[1] * 4 + [2] * 4])
    local = batch.cp_partition(torch.tensor([0, 4, 1, 5]), cp_rank=0, cp_size=2)  # ids 0,1,0,1
    for backend in ("flash", "te_thd"):
        with pytest.raises(BatchValidationError, match="split or merged"):
            forward_kwargs(local, backend=backend)


def test_te_refuses_leading_padding() -> None:
    batch = batch_from_automodel(
        {"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.tensor([[0, 1, 1, 1]])},
        sample_ids=["left-padded"],
        source_metadata={},
        layout="packed_varlen",
    )
    with pytest.raises(BatchValidationError, match="starts with padding"):
        forward_kwargs(batch, backend="te_thd")
    assert forward_kwargs(batch, backend="flash")["cu_seq_lens_q"].tolist() == [0, 1, 4]


def test_unpacked_batch_and_unknown_backend_are_errors() -> None:
    batch = batch_from_automodel(
        {"input_ids": torch.zeros(1, 4, dtype=torch.long)},
        sample_ids=["a"],
        source_metadata={},
        layout="fixed",
    )
    with pytest.raises(BatchValidationError, match="packed"):
        forward_kwargs(batch, backend="flash")
    with pytest.raises(ConfigError, match="backend"):
        forward_kwargs(_packed(PACKS["one-row"]), backend="xla")  # type: ignore[arg-type]


def test_mrope_positions_are_kept() -> None:
    ids = torch.tensor([[1, 1, 2, 2, 2, 0]])
    mrope = torch.arange(18).reshape(3, 1, 6)
    batch = batch_from_automodel(
        {"input_ids": torch.zeros(1, 6, dtype=torch.long), "_packed_seq_ids": ids, "position_ids": mrope},
        sample_ids=["p"],
        source_metadata={},
        layout="packed_varlen",
    )
    assert forward_kwargs(batch, backend="flash")["position_ids"] is mrope


def test_flash_segments_never_cross_a_row_even_between_padding_runs() -> None:
    # Row 0 ends with padding and row 1 is padding only (as `pad_batch_to_multiple` adds): two segments.
    batch = _packed([[1, 1, 0, 0], [0, 0, 0, 0]])
    assert forward_kwargs(batch, backend="flash")["cu_seq_lens_q"].tolist() == [0, 2, 4, 8]


def test_te_padded_cu_with_padding_between_documents() -> None:
    # THD with CP padding: seq_lens [[3, 2]], seq_lens_padded [[4, 4]] (TE's "with offset" cu).
    batch = batch_from_automodel(
        {
            "input_ids": torch.zeros(1, 8, dtype=torch.long),
            "seq_lens": torch.tensor([[3, 2]]),
            "seq_lens_padded": torch.tensor([[4, 4]]),
        },
        sample_ids=["thd"],
        source_metadata={},
        layout="packed_varlen",
    )
    kwargs = forward_kwargs(batch, backend="te_thd")
    assert kwargs["cu_seqlens_q"].tolist() == [0, 3, 5]
    assert kwargs["cu_seqlens_q_padded"].tolist() == [0, 4, 8]
    assert kwargs["max_seqlen_q"] == 3
    q, k, v = _qkv(8)
    valid = (batch.sequence.seq_ids >= 0).reshape(-1)
    torch.testing.assert_close(
        te_thd_reference(q, k, v, **kwargs)[valid],
        per_document(q, k, v, batch.sequence.seq_ids)[valid],
        rtol=0,
        atol=1e-12,
    )


def test_load_balanced_cp_golden_keeps_rope_positions() -> None:
    # Two 8-token documents, cp_size 2: rank 0 holds chunks 0 and 3 of each (tokens 0,1,6,7 | 8,9,14,15).
    batch = _packed([[1] * 8 + [2] * 8])
    batch = batch.replace_model_kwargs(position_ids=forward_kwargs(batch, backend="flash")["position_ids"])
    indices = batch_cp_indices(batch, cp_rank=0, cp_size=2)
    assert indices.tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    local = batch.cp_partition(indices, cp_rank=0, cp_size=2)
    flash = forward_kwargs(local, backend="flash")
    assert flash["cu_seq_lens_q"].tolist() == [0, 4, 8]
    assert flash["position_ids"].tolist() == [[0, 1, 6, 7, 0, 1, 6, 7]]  # not 0,1,2,3: RoPE stays exact
    thd = forward_kwargs(local, backend="te_thd")
    assert thd["cu_seqlens_q"].tolist() == thd["cu_seqlens_q_padded"].tolist() == [0, 4, 8]


def test_cp_local_batch_without_position_ids_gets_none_rather_than_wrong_ones() -> None:
    batch = _packed([[1] * 8 + [2] * 8])
    local = batch.cp_partition(batch_cp_indices(batch, cp_rank=0, cp_size=2), cp_rank=0, cp_size=2)
    assert "position_ids" not in forward_kwargs(local, backend="flash")
    assert "position_ids" not in forward_kwargs(local, backend="te_thd")


@pytest.mark.parametrize("cp_size", [2, 3])
@pytest.mark.parametrize(("backend", "reference"), VARLEN)
def test_load_balanced_cp_every_rank_attends_exactly_within_its_documents(
    cp_size: int, backend: str, reference
) -> None:
    # One packed row: documents of 9, 4, 12 and 1 tokens, then 3 padding tokens.
    doc_ids = [1] * 9 + [2] * 4 + [3] * 12 + [4] + [0] * 3
    batch = _packed([doc_ids])
    positions = _expected_positions(batch.sequence.seq_ids)
    batch = batch.replace_model_kwargs(position_ids=positions)
    held = []
    for rank in range(cp_size):
        indices = batch_cp_indices(batch, cp_rank=rank, cp_size=cp_size)
        held.append(indices)
        local = batch.cp_partition(indices, cp_rank=rank, cp_size=cp_size)
        seq_ids = local.sequence.seq_ids
        assert int(seq_ids.max()) > int(seq_ids[seq_ids >= 0].min())  # the rank holds several documents
        kwargs = forward_kwargs(local, backend=backend)
        cu_key = "cu_seq_lens_q" if backend == "flash" else "cu_seqlens_q"
        local_docs = torch.tensor(doc_ids)[indices]
        if backend != "flash":  # per-document local token counts, written from the map
            counts = [int((local_docs == d).sum()) for d in range(1, 5)]
            assert kwargs[cu_key].diff().tolist() == [c for c in counts if c]
        q, k, v = _qkv(seq_ids.numel())
        valid = (seq_ids >= 0).reshape(-1)
        torch.testing.assert_close(
            reference(q, k, v, **kwargs)[valid], per_document(q, k, v, seq_ids)[valid], rtol=0, atol=1e-12
        )
        if backend != "megatron":
            assert torch.equal(kwargs["position_ids"], positions[:, indices])
    assert torch.equal(torch.cat(held).sort().values, torch.arange(len(doc_ids)))


# --- HF sdpa / eager: masks, and labels for the loss ---------------------------------------------------


def _hf_mask(batch, attn: str, dtype: torch.dtype) -> torch.Tensor:
    """The 4-D mask HF itself builds from packed ``position_ids`` (no 2-D mask, no cache)."""
    config = Qwen2Config(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    config._attn_implementation = attn
    embeds = torch.zeros(*batch.input_ids.shape, 8, dtype=dtype)
    return create_causal_mask(
        config=config,
        inputs_embeds=embeds,
        attention_mask=None,
        past_key_values=None,
        position_ids=forward_kwargs(batch, backend="sdpa")["position_ids"],
    )


@pytest.mark.parametrize("name", sorted(PACKS))
def test_block_causal_mask_equals_the_mask_hf_builds_from_packed_positions(name: str) -> None:
    batch = _packed(PACKS[name])
    bool_mask = forward_kwargs(batch, backend="sdpa", mask="block_causal")["attention_mask"]
    assert bool_mask.dtype == torch.bool and bool_mask.shape == (
        batch.batch_size,
        1,
        *batch.input_ids.shape[1:] * 2,
    )
    valid = batch.sequence.seq_ids >= 0  # query rows of document tokens (HF lets a padding run see itself)
    hf_sdpa = _hf_mask(batch, "sdpa", torch.float64).expand_as(bool_mask)
    assert torch.equal(bool_mask[:, 0][valid], hf_sdpa[:, 0][valid])
    additive = forward_kwargs(batch, backend="eager", mask="block_causal", dtype=torch.float64)
    additive = additive["attention_mask"]
    assert additive.dtype == torch.float64
    hf_eager = _hf_mask(batch, "eager", torch.float64).expand_as(additive)
    assert torch.equal(additive[:, 0][valid], hf_eager[:, 0][valid])


def test_block_causal_mask_equals_automodel_neat_collater_mask_on_every_token() -> None:
    doc_ids = torch.tensor([[1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]])
    items = [
        {
            "input_ids": list(range(8)),
            "labels": [-100] * 8,
            "attention_mask": row.tolist(),
            "position_ids": [0] * 8,
        }
        for row in doc_ids
    ]

    class Contract:  # AutoModel's structural `PackedSequenceContract`
        packed_mask_type = "block_causal"
        requires_packed_sequence_metadata = False

    theirs = neat_packed_collater(items, packing=Contract())["attention_mask"]
    ours = forward_kwargs(_packed(doc_ids.tolist()), backend="sdpa", mask="block_causal")["attention_mask"]
    valid = doc_ids > 0
    assert torch.equal(ours[:, 0][valid], theirs[:, 0][valid])  # every document token: the same keys
    pad = ~valid  # AutoModel's padding rows see nothing; ours see themselves (no NaN in eager softmax)
    assert not theirs[:, 0][pad].any() and torch.equal(
        ours[:, 0][pad].sum(-1), torch.ones(int(pad.sum())).long()
    )


def test_auto_mask_only_where_position_ids_cannot_mark_the_documents() -> None:
    batch = _packed([[1] * 8 + [2] * 8])
    plain = forward_kwargs(batch, backend="sdpa")
    assert set(plain) == {"use_cache", "position_ids"} and plain["use_cache"] is False
    batch = batch.replace_model_kwargs(position_ids=plain["position_ids"])
    local = batch.cp_partition(batch_cp_indices(batch, cp_rank=0, cp_size=2), cp_rank=0, cp_size=2)
    cp = forward_kwargs(local, backend="sdpa")  # positions 0,1,6,7: HF would split each document in two
    assert cp["position_ids"].tolist() == [[0, 1, 6, 7, 0, 1, 6, 7]]
    assert cp["attention_mask"][0, 0].long().tolist() == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 1, 1, 1, 1],
    ]
    with pytest.raises(BatchValidationError, match="do not mark the documents"):
        forward_kwargs(local, backend="sdpa", mask="none")
    with pytest.raises(ConfigError, match=r"dtype=model\.dtype"):
        forward_kwargs(local, backend="eager")  # a bool mask would be added to the scores: refused
    mrope = batch.replace_model_kwargs(position_ids=plain["position_ids"].expand(3, 1, 16))
    assert forward_kwargs(mrope, backend="sdpa")["attention_mask"].shape == (1, 1, 16, 16)
    unpacked = batch_from_automodel(
        {
            "input_ids": torch.zeros(2, 4, dtype=torch.long),
            "attention_mask": torch.tensor([[1, 1, 1, 0]] * 2),
        },
        sample_ids=["a", "b"],
        source_metadata={},
        layout="padded_varlen",
    )
    assert forward_kwargs(unpacked, backend="eager")["attention_mask"].tolist() == [[1, 1, 1, 0]] * 2
    left = batch_from_automodel(
        {"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.tensor([[0, 1, 1, 1]])},
        sample_ids=["left"],
        source_metadata={},
        layout="padded_varlen",
    )
    with pytest.raises(BatchValidationError, match="no position_ids"):
        forward_kwargs(left, backend="sdpa")  # HF would number the tokens from the padding on
    with pytest.raises(ConfigError, match="sdpa and eager only"):
        forward_kwargs(batch, backend="flash", mask="block_causal")


def test_model_inputs_labels_give_one_loss_whether_hf_shifts_or_not() -> None:
    ids = torch.tensor([[1, 1, 1, 2, 2, 2, 0, 0]])
    batch = batch_from_automodel(
        {
            "input_ids": torch.arange(8)[None],
            "_packed_seq_ids": ids,
            "labels": torch.tensor([[5, 6, -100, 7, 8, -100, -100, -100]]),
            "padding_mask": ids == 0,
        },
        sample_ids=["p"],
        source_metadata={},
        layout="packed_varlen",
    )
    inputs = model_inputs(batch, backend="sdpa")
    assert set(inputs) == {
        "input_ids", "position_ids", "use_cache", "labels", "shift_labels", "num_items_in_batch"
    }  # fmt: skip
    assert inputs["shift_labels"].tolist() == [[5, 6, -100, 7, 8, -100, -100, -100]]
    assert inputs["labels"].tolist() == [[-100, 5, 6, -100, 7, 8, -100, -100]]
    assert inputs["num_items_in_batch"].item() == 4  # the supervised tokens
    logits = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    items = inputs["num_items_in_batch"]
    honours = ForCausalLMLoss(
        logits, inputs["labels"], 16, shift_labels=inputs["shift_labels"], num_items_in_batch=items
    )
    shifts = ForCausalLMLoss(logits, inputs["labels"], 16, num_items_in_batch=items)  # ignores shift_labels
    want = (
        torch.nn.functional.cross_entropy(logits[0].float(), inputs["shift_labels"][0], reduction="sum") / 4
    )
    assert honours.item() == shifts.item() == want.item()
    twice = ForCausalLMLoss(logits, inputs["shift_labels"], 16)  # the trap: shifted labels as `labels`
    assert abs(twice.item() - want.item()) > 1e-3
    with pytest.raises(ConfigError, match="te_thd and megatron"):
        model_inputs(batch, backend="megatron")  # type: ignore[arg-type]


def test_model_inputs_drops_media_a_split_left_empty() -> None:
    batch = batch_from_automodel(
        {
            "input_ids": torch.tensor([[7, 7, 7, 1, 2, 3], [4, 5, 6, 7, 8, 9]]),
            "pixel_values": torch.randn(4, 6),
            "image_grid_thw": torch.tensor([[1, 2, 2]]),
            "n_images_per_sample": torch.tensor([1, 0]),
        },
        sample_ids=["with-image", "text"],
        source_metadata={},
        layout="padded_varlen",
    )
    with_image, text_only = (model_inputs(part, backend="sdpa") for part in batch.pp_microbatches(2))
    assert with_image["pixel_values"].shape == (4, 6) and with_image["image_grid_thw"].shape == (1, 3)
    assert "pixel_values" not in text_only and "image_grid_thw" not in text_only
    assert "n_images_per_sample" not in with_image  # consumed by the adapter, never forwarded


def test_model_inputs_with_inputs_embeds_sends_no_input_ids() -> None:
    batch = _packed([[1, 1, 2, 2, 2, 0]])
    embeds = torch.randn(1, 6, 4, dtype=torch.float64)
    inputs = model_inputs(batch.replace_model_kwargs(inputs_embeds=embeds), backend="sdpa")
    assert "input_ids" not in inputs and inputs["inputs_embeds"] is embeds  # HF takes exactly one of them

"""Hostile tensors a `PuzzletronBatch` and `batch_from_automodel` must refuse, each naming the field
(issue 17), and the fast validation pass agreeing with the rule-by-rule one on every mutation of a valid
batch (hypothesis): the fast pass may only ever say what the rules say."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _batch_builders import media_batch, plain
from _batch_strategies import batches
from puzzletron.dataset import DataLayout, PuzzletronBatch, batch_from_automodel
from puzzletron.dataset.batch import _fast, _validation
from puzzletron.dataset.batch._core import MAX_PAD_TOKENS
from puzzletron.dataset.errors import BatchValidationError


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64]
)
def test_token_ids_and_labels_of_other_dtypes_are_refused_naming_the_field(dtype: torch.dtype) -> None:
    ids = torch.zeros(2, 3, dtype=dtype)
    with pytest.raises(BatchValidationError, match=rf"input_ids'\] must hold .* int32 or int64; got {dtype}"):
        PuzzletronBatch(model_kwargs={"input_ids": ids})
    if dtype in (torch.uint8, torch.int8):  # -100 wraps to 156: a target would cross documents
        labels = torch.full((2, 3), -100).to(dtype)
        with pytest.raises(BatchValidationError, match=rf"^labels must hold .* int32 or int64; got {dtype}"):
            PuzzletronBatch(model_kwargs={"input_ids": torch.zeros(2, 3, dtype=torch.long)}, labels=labels)


def test_a_nested_input_ids_is_refused_as_not_dense() -> None:
    nested = torch.nested.nested_tensor([torch.arange(3), torch.arange(5)])
    with pytest.raises(
        BatchValidationError, match=r"must be a dense \(strided\) tensor \[B, T\]; got a nested"
    ):
        PuzzletronBatch(model_kwargs={"input_ids": nested})


@pytest.mark.parametrize("entry", [0, -2])
def test_an_image_grid_with_a_zero_or_negative_entry_is_refused(entry: int) -> None:
    b = media_batch(flat_patches=True)
    grid = b.model_kwargs["image_grid_thw"].clone()
    grid[1, 2] = entry
    with pytest.raises(BatchValidationError, match=r"image_grid_thw'\] must hold \(t, h, w\) > 0"):
        b.replace_model_kwargs(image_grid_thw=grid)


def test_pixels_that_do_not_match_the_grid_are_refused_at_construction() -> None:
    b = media_batch(flat_patches=True)  # 5 images of 4 patches: 20 rows
    with pytest.raises(BatchValidationError, match=r"pixel_values'\] has 19 rows: neither one per item"):
        b.replace_model_kwargs(pixel_values=b.model_kwargs["pixel_values"][:19])
    assert b.replace_model_kwargs(pixel_values=b.model_kwargs["pixel_values"][:5]).batch_size == 3  # per item


def test_padding_past_max_pad_tokens_is_refused_before_allocating() -> None:
    wide = PuzzletronBatch(model_kwargs={"input_ids": torch.zeros(2, 4096, dtype=torch.long)})
    with pytest.raises(BatchValidationError, match=r"would add 65534 rows of 4096 tokens"):
        wide.pad_batch_to_multiple(2**16)
    assert wide.pad_batch_to_multiple(8).batch_size == 8 and MAX_PAD_TOKENS >= 8 * 4096
    assert plain().pad_batch_to_multiple(2**16).batch_size == 2**16  # 3 tokens a row: small


def test_padding_past_max_pad_bytes_is_refused_before_allocating() -> None:
    embeds = PuzzletronBatch(  # 256 tokens a row: tokens alone allow 2**16 rows, their embeddings are 68 GB
        model_kwargs={
            "input_ids": torch.zeros(1, 256, dtype=torch.long),
            "inputs_embeds": torch.zeros(1, 256, 1024),
        }
    )
    with pytest.raises(
        BatchValidationError, match=r"would add 65535 rows of 1050624 bytes .* > MAX_PAD_BYTES"
    ):
        embeds.pad_batch_to_multiple(2**16)
    assert embeds.pad_batch_to_multiple(8).batch_size == 8


# --------------------------------------------------------------------------------------- batch_from_automodel


def _collated(**extra: Any) -> dict[str, Any]:
    return {"input_ids": torch.arange(8).reshape(1, 8), "labels": torch.arange(8).reshape(1, 8), **extra}


def _adapt(collated: dict[str, Any]) -> PuzzletronBatch:
    return batch_from_automodel(collated, sample_ids=["p"], source_metadata={}, layout="packed_varlen")


def test_packed_seq_ids_with_a_split_document_are_refused() -> None:
    with pytest.raises(BatchValidationError, match="row 0 holds a document in more than one run"):
        _adapt(_collated(_packed_seq_ids=torch.tensor([[1, 1, 2, 2, 1, 1, 0, 0]])))
    assert _adapt(
        _collated(_packed_seq_ids=torch.tensor([[1, 1, 2, 2, 3, 3, 0, 0]]))
    ).sequence.global_cu_seqlens.tolist() == [0, 2, 4, 6]


@pytest.mark.parametrize("value", [0.5, 2.5, -1.0])
def test_a_2d_attention_mask_of_fractions_or_negatives_is_refused(value: float) -> None:
    mask = torch.ones(1, 8)
    mask[0, 3] = value
    with pytest.raises(
        BatchValidationError, match=r"'attention_mask' holds .* at \[0, 3\]; a 2-D mask holds 0/1"
    ):
        _adapt(_collated(attention_mask=mask))


def _block_causal(docs: list[int]) -> torch.Tensor:
    ids = torch.tensor(docs)
    return ((ids[:, None] == ids[None, :]) & (ids[:, None] >= 0) & torch.ones(8, 8, dtype=torch.bool).tril())[
        None, None
    ]


def test_a_4d_mask_that_is_not_block_causal_or_holds_other_values_is_refused() -> None:
    good = _block_causal([0, 0, 0, 1, 1, 1, -1, -1])
    assert _adapt(_collated(attention_mask=good)).sequence.global_cu_seqlens.tolist() == [0, 3, 6]
    leaky = good.clone()
    leaky[0, 0, 4, 1] = True  # token 4 (document 1) sees token 1 (document 0)
    with pytest.raises(
        BatchValidationError,
        match="not block-causal over its documents: row 0, token 4 may attend to token 1",
    ):
        _adapt(_collated(attention_mask=leaky))
    twos = good.long() * 2
    with pytest.raises(BatchValidationError, match="an integer mask holds 0 and 1"):
        _adapt(_collated(attention_mask=twos))
    additive = torch.where(good, 0.0, -0.5)
    with pytest.raises(BatchValidationError, match="an additive mask holds 0"):
        _adapt(_collated(attention_mask=additive))


# ------------------------------------------------------------------------- the fast pass = the rules


def _mutate(b: PuzzletronBatch, data: st.DataObject) -> PuzzletronBatch:
    """One token-sized field of `b` with one value changed (what a bug or a hostile caller does)."""
    fields = [f for f in ("labels", "ce_mask", "hidden_mask") if getattr(b, f) is not None]
    seq_ids = b.sequence.seq_ids is not None
    choice = data.draw(st.sampled_from([*fields, "input_ids", *(["seq_ids"] if seq_ids else [])]))
    B, T = b.input_ids.shape
    r, t = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, T - 1))
    if choice == "seq_ids":
        ids = b.sequence.seq_ids.clone()
        ids[r, t] = data.draw(st.integers(-3, int(ids.max()) + 2))
        return dataclasses.replace(b, sequence=dataclasses.replace(b.sequence, seq_ids=ids))
    if choice == "input_ids":
        ids = b.input_ids.clone()
        ids[r, t] = data.draw(st.integers(-2, 5))
        return dataclasses.replace(b, model_kwargs={**b.model_kwargs, "input_ids": ids})
    tensor = getattr(b, choice).clone()
    tensor[r, t] = (
        data.draw(st.sampled_from([-100, -5, 0, 7])) if choice == "labels" else not bool(tensor[r, t])
    )
    return dataclasses.replace(b, **{choice: tensor})


@settings(max_examples=150, deadline=None)
@given(batches(layouts=(DataLayout.PACKED_VARLEN, DataLayout.FIXED)), st.data())
def test_the_fast_pass_agrees_with_the_rules_one_by_one(b: PuzzletronBatch, data: st.DataObject) -> None:
    packed = b.layout is DataLayout.PACKED_VARLEN
    assert all(bool(ok) for ok in _fast.token_rules(b, packed=packed))  # a valid batch: the fast pass says so
    try:
        mutated = _mutate(b, data)
    except BatchValidationError as exc:  # refused: the rules one by one must name a rule it breaks
        assert str(exc)
        return
    # accepted: no rule, evaluated alone, may fail
    checks = _validation._Checks()
    _validation._token_value_rules(mutated, checks)
    if mutated.sequence.global_cu_seqlens is not None:
        _validation._check_cu_values(
            mutated, *mutated.input_ids.shape, checks, packed=mutated.layout is DataLayout.PACKED_VARLEN
        )
    assert checks.first_failure() is None

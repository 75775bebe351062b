"""`PuzzletronBatch` as a value: strings are coerced to enums at construction, mappings are read-only
private copies, `replace_model_kwargs` re-validates and `to` converts only floating tensors, equality and
hashing are by content and never crash, pickling round-trips exactly, and the fingerprint is lazy, cached and
never computed by derived batches (which also skip validation). Expected values are written by hand; derived
batches are re-validated through the public constructor (`dataclasses.replace`)."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import torch

from _batch_builders import media_batch, packed_row, plain, video_batch
from _batch_strategies import revalidated
from puzzletron.dataset import DataLayout, Modality, PackedSequenceMetadata, PuzzletronBatch
from puzzletron.dataset.batch import _core as batch_module
from puzzletron.dataset.batch import _fingerprint, _validation
from puzzletron.dataset.errors import BatchValidationError

# -- enums and construction --------------------------------------------------------------------------


def test_enum_values() -> None:
    assert [m.value for m in DataLayout] == ["fixed", "padded_varlen", "packed_varlen"]
    assert [m.value for m in Modality] == ["text", "multimodal"]
    assert DataLayout("packed_varlen") is DataLayout.PACKED_VARLEN


def test_strings_are_coerced_to_enums_and_sample_ids_to_str_tuple() -> None:
    b = plain(layout="padded_varlen", modality="multimodal", sample_ids=[1, "x"])
    assert b.layout is DataLayout.PADDED_VARLEN
    assert b.modality is Modality.MULTIMODAL
    assert b.sample_ids == ("1", "x")
    assert (b.batch_size, b.sequence_length) == (2, 3)
    assert b.input_ids is b.model_kwargs["input_ids"]


def test_layout_string_is_coerced_before_the_cu_rule_compares_it() -> None:
    b = packed_row([2, 2], 4)
    again = PuzzletronBatch(
        model_kwargs=b.model_kwargs, sequence=b.sequence, hidden_mask=b.hidden_mask, layout="packed_varlen"
    )
    assert again.layout is DataLayout.PACKED_VARLEN


def test_unknown_enum_string_names_the_field() -> None:
    with pytest.raises(BatchValidationError, match="layout must be one of"):
        plain(layout="varlen")
    with pytest.raises(BatchValidationError, match="modality"):
        plain(modality="audio")


def test_model_kwargs_is_a_read_only_private_copy() -> None:
    raw = {"input_ids": torch.zeros(1, 2, dtype=torch.long)}
    b = PuzzletronBatch(model_kwargs=raw)
    assert isinstance(b.model_kwargs, types.MappingProxyType)
    with pytest.raises(TypeError):
        b.model_kwargs["attention_mask"] = torch.ones(1, 2)  # type: ignore[index]
    raw["attention_mask"] = torch.ones(1, 5)  # mutating the caller's dict does not reach the batch
    assert "attention_mask" not in b.model_kwargs
    with pytest.raises(TypeError):
        b.source_metadata["x"] = 1  # type: ignore[index]


def test_fingerprint_is_not_an_init_argument() -> None:
    with pytest.raises(TypeError):
        PuzzletronBatch(model_kwargs={"input_ids": torch.zeros(1, 1, dtype=torch.long)}, fingerprint="x")  # type: ignore[call-arg]


# -- derived batches are not re-validated or hashed ---------------------------------------------------


def test_derived_batches_skip_validation_and_never_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    b = packed_row([3, 3, 2, 4], 12, sample_ids=("row",), cu_seqlens=torch.tensor([0, 3, 6, 8, 12]))
    m = media_batch()

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("must not run")

    monkeypatch.setattr(_validation, "validate", boom)
    monkeypatch.setattr(batch_module, "fingerprint_of", boom)
    monkeypatch.setattr(_fingerprint, "_tensor", boom)  # no tensor is hashed, by any path
    b.to(torch.float16)
    b.dp_slice(dp_rank=1, dp_size=2)
    b.cp_partition(torch.tensor([0, 1, 10, 11]), cp_rank=0, cp_size=2)
    b.pad_batch_to_multiple(4)
    m.pp_microbatches(3)
    m.dp_slice(dp_rank=0, dp_size=3)


def test_construction_does_not_compute_the_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("hashed at construction")

    monkeypatch.setattr(batch_module, "fingerprint_of", boom)
    monkeypatch.setattr(_fingerprint, "_tensor", boom)
    media_batch()
    packed_row([2, 2], 5)
    video_batch()


def test_fingerprint_is_cached_after_first_access(monkeypatch: pytest.MonkeyPatch) -> None:
    b = media_batch()
    first = b.fingerprint
    monkeypatch.setattr(batch_module, "fingerprint_of", lambda *a, **k: "recomputed")
    assert b.fingerprint == first


# -- replace_model_kwargs and to -------------------------------------------------------------------


def test_replace_model_kwargs_merges_and_validates() -> None:
    b = plain()
    mask = torch.ones(2, 3, dtype=torch.long)
    out = b.replace_model_kwargs(attention_mask=mask)
    assert out.model_kwargs["attention_mask"] is mask
    assert out.input_ids is b.input_ids
    assert "attention_mask" not in b.model_kwargs
    with pytest.raises(BatchValidationError, match="attention_mask"):
        b.replace_model_kwargs(attention_mask=torch.ones(2, 4))


def test_to_dtype_converts_floating_tensors_only() -> None:
    b = media_batch()
    b = b.replace_model_kwargs(extra={"nested": [torch.zeros(2), torch.zeros(2, dtype=torch.long)]})
    out = b.to(torch.bfloat16)
    assert out.model_kwargs["pixel_values"].dtype == torch.bfloat16
    assert out.model_kwargs["extra"]["nested"][0].dtype == torch.bfloat16
    assert out.model_kwargs["extra"]["nested"][1].dtype == torch.long
    assert out.input_ids.dtype == torch.long
    assert out.model_kwargs["attention_mask"].dtype == torch.long
    assert out.model_kwargs["image_grid_thw"].dtype == torch.long
    assert out.labels.dtype == torch.long
    assert out.ce_mask.dtype == torch.bool
    assert out.sequence.media_counts.dtype == torch.long
    assert revalidated(out).sample_ids == ("a", "b", "c")


def test_to_accepts_device_and_keyword_forms() -> None:
    b = media_batch()
    out = b.to("cpu", dtype=torch.float64)
    assert out.model_kwargs["pixel_values"].dtype == torch.float64
    assert b.to(device="cpu").input_ids.device.type == "cpu"
    assert b.to(torch.zeros(1, dtype=torch.float16)).model_kwargs["pixel_values"].dtype == torch.float16


def test_to_copy_gives_fresh_storage_and_without_copy_shares_it() -> None:
    b = media_batch()
    copied = b.to("cpu", copy=True)
    same = b.to("cpu")
    assert copied.input_ids.data_ptr() != b.input_ids.data_ptr()
    assert copied.model_kwargs["pixel_values"].data_ptr() != b.model_kwargs["pixel_values"].data_ptr()
    assert torch.equal(copied.input_ids, b.input_ids)
    assert same.input_ids.data_ptr() == b.input_ids.data_ptr()
    assert copied.fingerprint == b.fingerprint


# -- equality and hashing ------------------------------------------------------------------------


def test_equality_and_hash_are_by_content_and_never_crash() -> None:
    a, b = media_batch(), media_batch()
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    changed = a.replace_model_kwargs(attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]))
    assert a != changed
    assert a != "not a batch"
    assert a.sequence == b.sequence
    assert hash(a.sequence) == hash(b.sequence)


def test_equality_and_hash_never_crash_on_values_without_a_canonical_encoding() -> None:
    # The fingerprint of such a batch is a TypeError (no repr() with a memory address), but == and hash
    # must not raise: the batch is then equal only to itself and hashes by identity.
    class Opaque:
        pass

    marker = Opaque()
    a = media_batch().replace_model_kwargs(thing=marker)
    same_content = media_batch().replace_model_kwargs(thing=marker)
    with pytest.raises(TypeError, match="Opaque"):
        a.fingerprint  # noqa: B018
    assert a == a
    assert (a == same_content) is False
    assert (a != media_batch()) is True
    assert hash(a) == hash(a)
    assert a in {a}
    assert len({a, same_content, media_batch()}) == 3
    assert (media_batch() == a) is False
    seq = PackedSequenceMetadata(seq_ids=torch.eye(2, dtype=torch.long).to_sparse())
    assert seq == seq
    assert seq != PackedSequenceMetadata()
    assert hash(seq) == hash(seq)


# -- pickling ------------------------------------------------------------------------------------


def test_batch_pickles_round_trip_exactly_with_read_only_mappings() -> None:
    import pickle

    b = packed_row([3, 2], 6, sample_ids=("pack-0",), nested={"k": torch.tensor([1, 2])})
    b = dataclasses.replace(b, source_metadata={"epoch": 3})
    out = pickle.loads(pickle.dumps(b))
    assert isinstance(out, PuzzletronBatch)
    assert out.fingerprint == b.fingerprint
    assert isinstance(out.model_kwargs, types.MappingProxyType)
    assert isinstance(out.source_metadata, types.MappingProxyType)
    assert out.source_metadata["epoch"] == 3
    assert out.sequence.global_cu_seqlens.tolist() == [0, 3, 5]
    assert out.sequence.seq_ids.tolist() == [[0, 0, 0, 1, 1, -1]]
    assert out.layout is DataLayout.PACKED_VARLEN
    with pytest.raises(TypeError):
        out.model_kwargs["input_ids"] = torch.zeros(1, 6)  # type: ignore[index]
    revalidated(out)


def test_pickled_batch_carries_no_cached_fingerprint_and_pickles_after_hashing() -> None:
    import pickle

    b = media_batch()
    expected = b.fingerprint  # cached in the instance: must not break pickling
    out = pickle.loads(pickle.dumps(b))
    assert "fingerprint" not in vars(out)
    assert out.fingerprint == expected
    assert out.sample_ids == ("a", "b", "c") and out.modality is Modality.MULTIMODAL


def test_sequence_metadata_pickles_round_trip_exactly() -> None:
    import pickle

    seq = PackedSequenceMetadata(
        global_cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32),
        local_cu_seqlens=torch.tensor([0, 2], dtype=torch.int32),
        max_seqlen=2,
        seq_ids=torch.tensor([[0, 0, -1]]),
        sample_offsets=((0, 3), (3, 5)),
        cp_rank=1,
        cp_size=2,
    )
    out = pickle.loads(pickle.dumps(seq))
    assert out == seq
    assert out.local_cu_seqlens.dtype == torch.int32
    assert (out.cp_rank, out.cp_size, out.sample_offsets) == (1, 2, ((0, 3), (3, 5)))

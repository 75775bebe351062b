"""Fingerprints (contract 3.2): content addressed, byte exact, process independent, no `repr()` fallback."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import warnings
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _batch_builders import two_by_three
from _batch_strategies import batches, revalidated
from puzzletron.dataset import DataLayout, Modality, PackedSequenceMetadata, PuzzletronBatch
from puzzletron.dataset.batch import _tables
from puzzletron.dataset.batch._fingerprint import fingerprint_of
from puzzletron.dataset.errors import BatchValidationError

SRC = Path(__file__).resolve().parents[2] / "src"

# Builds one fixed batch; printed fingerprint must agree across processes.
SCRIPT = """
import torch
from puzzletron.dataset import PuzzletronBatch, PackedSequenceMetadata
torch.set_printoptions(precision=2, threshold=3, edgeitems=1, profile="short")
seq_ids = torch.tensor([[0, 0, 1, 1, 1, -1]])
b = PuzzletronBatch(
    {"input_ids": torch.arange(6).reshape(1, 6),
     "pixel_values": torch.linspace(0, 1, 12).to(torch.bfloat16).reshape(2, 6),
     "scale": torch.tensor(0.5)},
    labels=torch.tensor([[1, 2, 3, 4, 5, -100]]),
    hidden_mask=seq_ids >= 0,
    sequence=PackedSequenceMetadata(
        global_cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32), seq_ids=seq_ids
    ),
    sample_ids=("s",), source_metadata={"revision": "abc", "b": [1, 2.5, None], "a": {"z": 1, "y": True}},
    layout="packed_varlen",
)
print(b.fingerprint)
"""


def _batch(**changes: object) -> PuzzletronBatch:
    seq_ids = torch.tensor([[0, 0, 1, 1, 1, -1]])
    fields: dict[str, object] = {
        "model_kwargs": {
            "input_ids": torch.arange(6).reshape(1, 6),
            "pixel_values": torch.linspace(0, 1, 12).to(torch.bfloat16).reshape(2, 6),
            "scale": torch.tensor(0.5),
        },
        "labels": torch.tensor([[1, 2, 3, 4, 5, -100]]),
        "hidden_mask": seq_ids >= 0,
        "sequence": PackedSequenceMetadata(
            global_cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32), seq_ids=seq_ids
        ),
        "sample_ids": ("s",),
        "source_metadata": {"revision": "abc", "b": [1, 2.5, None], "a": {"z": 1, "y": True}},
        "layout": "packed_varlen",
    }
    fields.update(changes)
    return PuzzletronBatch(**fields)  # type: ignore[arg-type]


def test_fingerprint_is_a_sha256_hex_digest_equal_for_equal_content() -> None:
    a, b = _batch(), _batch()
    assert len(a.fingerprint) == 64
    assert int(a.fingerprint, 16) >= 0
    assert a.fingerprint == b.fingerprint


def _variants() -> dict[str, PuzzletronBatch]:
    base = _batch()
    kw = dict(base.model_kwargs)
    flipped_bf16 = kw["pixel_values"].clone()
    flipped_bf16.view(torch.int16)[1, 5] ^= 1  # one bit of one bfloat16 value
    hidden = base.hidden_mask.clone()
    hidden[0, 4] = False
    labels = base.labels.clone()
    labels[0, 0] = 7
    return {
        "token": base.replace_model_kwargs(input_ids=torch.tensor([[0, 1, 2, 3, 5, 5]])),
        "label": dataclasses.replace(base, labels=labels),
        "mask bit": _batch(
            hidden_mask=hidden,
            labels=torch.tensor([[1, 2, 3, 4, -100, -100]]),
            sequence=PackedSequenceMetadata(
                global_cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32),
                seq_ids=torch.tensor([[0, 0, 1, 1, -1, -1]]),
            ),
        ),
        "bf16 bit": base.replace_model_kwargs(pixel_values=flipped_bf16),
        "0-dim value": base.replace_model_kwargs(scale=torch.tensor(0.25)),
        "dtype only": base.replace_model_kwargs(scale=torch.tensor(0.5, dtype=torch.float64)),
        "metadata value": dataclasses.replace(
            base, sequence=dataclasses.replace(base.sequence, max_seqlen=3)
        ),
        "source revision": dataclasses.replace(
            base, source_metadata={**base.source_metadata, "revision": "abd"}
        ),
        "sample id": dataclasses.replace(base, sample_ids=("t",)),
        "layout": dataclasses.replace(base, layout=DataLayout.PACKED_VARLEN, modality="multimodal"),
        "new kwarg": base.replace_model_kwargs(extra=None),
    }


@pytest.mark.parametrize("name", sorted(_variants()))
def test_any_single_change_changes_the_fingerprint(name: str) -> None:
    assert _variants()[name].fingerprint != _batch().fingerprint


def test_seq_ids_differing_mid_row_are_not_collapsed_by_repr() -> None:
    # With print threshold 3, repr() of both tensors is identical; their bytes are not.
    torch.set_printoptions(threshold=3, edgeitems=1)
    try:
        a = torch.tensor([0] * 50 + [1] * 50)
        b = torch.tensor([0] * 49 + [1] * 51)
        assert repr(a) == repr(b)
        assert fingerprint_of(a) != fingerprint_of(b)
    finally:
        torch.set_printoptions(profile="default")


def test_mapping_order_does_not_matter_but_sequence_order_and_types_do() -> None:
    assert fingerprint_of({"a": 1, "b": 2}) == fingerprint_of({"b": 2, "a": 1})
    assert fingerprint_of([1, 2]) != fingerprint_of([2, 1])
    assert fingerprint_of(["ab"]) != fingerprint_of(["a", "b"])
    assert fingerprint_of(1) != fingerprint_of(1.0)
    assert fingerprint_of(1) != fingerprint_of("1")
    assert fingerprint_of(True) != fingerprint_of(1)
    assert fingerprint_of(torch.tensor([1], dtype=torch.int32)) != fingerprint_of(torch.tensor([1]))
    assert fingerprint_of(torch.zeros(2, 3)) != fingerprint_of(torch.zeros(3, 2))


def test_enums_hash_by_value_and_tensors_by_bytes_not_layout() -> None:
    class OtherLayout(str, Enum):
        FIXED = "fixed"

    assert fingerprint_of(OtherLayout.FIXED) == fingerprint_of(DataLayout.FIXED)  # by value, not class
    assert fingerprint_of(DataLayout("fixed")) == fingerprint_of(DataLayout.FIXED)
    assert fingerprint_of(DataLayout.FIXED) != fingerprint_of(DataLayout.PACKED_VARLEN)
    t = torch.arange(6).reshape(2, 3)
    assert fingerprint_of(t.t().contiguous().t()) == fingerprint_of(t)  # strides are not content
    assert fingerprint_of(torch.tensor(3)) != fingerprint_of(torch.tensor([3]))  # 0-dim vs 1-dim


def test_objects_without_a_canonical_encoding_are_type_errors() -> None:
    with pytest.raises(TypeError, match=r"builtins\.object"):
        fingerprint_of({"x": object()})
    with pytest.raises(TypeError, match=r"\['model_kwargs'\]\['fn'\]"):
        _batch().replace_model_kwargs(fn=lambda: None).fingerprint  # noqa: B018
    with pytest.raises(TypeError, match="layout"):
        fingerprint_of(torch.eye(2).to_sparse())


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), "a nested tensor"),
        (lambda: torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.quint8), "quantized"),
        (lambda: torch.zeros(3, device="meta"), "a meta tensor has no data"),
        (lambda: {1, 2}, r"builtins\.set"),
        (lambda: (i for i in range(2)), "generator"),
        (lambda: np.array([object()]), "dtype object"),
        (lambda: torch.float32, r"torch\.dtype"),
    ],
)
def test_values_without_a_canonical_encoding_are_type_errors_naming_where(make: Any, what: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nested-tensor prototype warning
        value = make()
    with pytest.raises(TypeError, match=what) as info:
        _batch(source_metadata={"origin": {"bad": value}}).fingerprint  # noqa: B018
    assert "['source_metadata']['origin']['bad']" in str(info.value)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.float8_e4m3fn,
    ],
)
def test_zero_dim_tensors_of_every_dtype_hash_by_dtype_and_value(dtype: torch.dtype) -> None:
    one, two = torch.tensor(1, dtype=dtype), torch.tensor(0, dtype=dtype)
    assert fingerprint_of(one) == fingerprint_of(torch.tensor(1, dtype=dtype))
    assert fingerprint_of(one) != fingerprint_of(two)
    assert fingerprint_of(one) != fingerprint_of(one.reshape(1))  # 0-dim is not [1]
    batch = _batch(model_kwargs={**_batch().model_kwargs, "scale": one})
    assert (
        batch.fingerprint == _batch(model_kwargs={**_batch().model_kwargs, "scale": one.clone()}).fingerprint
    )


def test_print_options_never_change_a_fingerprint() -> None:
    expected = _batch().fingerprint
    try:
        for options in (
            {"threshold": 1, "edgeitems": 1},
            {"precision": 1, "sci_mode": True},
            {"profile": "full", "linewidth": 10},
        ):
            torch.set_printoptions(**options)
            assert _batch().fingerprint == expected
    finally:
        torch.set_printoptions(profile="default")


def test_device_moves_and_memory_layouts_never_change_a_fingerprint() -> None:
    b = _batch()
    assert b.to("cpu").fingerprint == b.fingerprint
    assert b.to(device=torch.device("cpu"), non_blocking=True).fingerprint == b.fingerprint
    strided = torch.arange(12).reshape(2, 6)[:, ::1].t().contiguous().t()  # column-major storage
    assert fingerprint_of(strided) == fingerprint_of(torch.arange(12).reshape(2, 6))
    assert fingerprint_of(torch.arange(6.0).requires_grad_()) == fingerprint_of(torch.arange(6.0))
    assert fingerprint_of(torch.tensor([1 + 2j]).conj()) == fingerprint_of(torch.tensor([1 - 2j]))


def test_fingerprint_is_identical_in_a_fresh_process_with_other_hash_seed_and_print_options() -> None:
    local = _batch().fingerprint
    outputs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(SRC)}
        result = subprocess.run(
            [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True, timeout=120
        )
        outputs.add(result.stdout.strip())
    assert outputs == {local}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an accelerator")
def test_fingerprint_is_the_same_on_every_device() -> None:
    b = _batch()
    assert b.to("cuda").fingerprint == b.fingerprint


def test_a_tensor_changed_in_place_after_the_fingerprint_was_read_is_refused_not_a_stale_fingerprint() -> (
    None
):
    b = PuzzletronBatch(**two_by_three(labels=torch.zeros(2, 3, dtype=torch.long)))
    first = b.fingerprint
    assert b.fingerprint == first and hash(b) == hash(revalidated(b))  # reads again: no change, no error
    b.input_ids[0, 0] = 7  # the caller edits the batch's tensor in place
    for read in (lambda: b.fingerprint, lambda: b == revalidated(b), lambda: hash(b)):
        with pytest.raises(
            BatchValidationError, match=r"model_kwargs\['input_ids'\] was changed in place after"
        ):
            read()
    fresh = PuzzletronBatch(**two_by_three(labels=torch.zeros(2, 3, dtype=torch.long)))
    fresh.labels.add_(1)  # before any fingerprint: the first read is of the content it then holds
    assert fresh.fingerprint != first


def test_one_ce_mask_bit_changes_the_fingerprint() -> None:
    mask = torch.tensor([[True, True, True, True, True, False]])
    flipped = mask.clone()
    flipped[0, 2] = False
    assert _batch(ce_mask=mask).fingerprint != _batch(ce_mask=flipped).fingerprint
    assert _batch(ce_mask=mask).fingerprint == _batch(ce_mask=mask.clone()).fingerprint


# -- properties over random batches ---------------------------------------------------------------


def _tensor_fields(b: PuzzletronBatch) -> list[tuple[str, str]]:
    """Every tensor of a batch as ``(kind, name)``: model kwargs, labels/masks, sequence metadata."""
    out = [("kw", k) for k, v in b.model_kwargs.items() if isinstance(v, torch.Tensor) and v.numel()]
    out += [
        ("field", n) for n in ("labels", "ce_mask", "kd_mask", "hidden_mask") if getattr(b, n) is not None
    ]
    seq = b.sequence
    out += [
        ("seq", n)
        for n in ("global_cu_seqlens", "local_cu_seqlens", "seq_ids", "media_counts", "media_offsets")
        if getattr(seq, n) is not None and getattr(seq, n).numel()
    ]
    return out


def _with_tensor(b: PuzzletronBatch, kind: str, name: str, value: torch.Tensor) -> PuzzletronBatch:
    # Built without validation on purpose: the fingerprint is a function of content, valid or not.
    if kind == "kw":
        return _tables.derive(b, model_kwargs={**b.model_kwargs, name: value})
    if kind == "field":
        return _tables.derive(b, **{name: value})
    return _tables.derive(b, sequence=dataclasses.replace(b.sequence, **{name: value}))


def _one_element_changed(t: torch.Tensor, flat_index: int) -> torch.Tensor:
    out = t.clone()
    view = out.reshape(-1)
    if t.dtype == torch.bool:
        view[flat_index] = ~view[flat_index]
    else:
        view[flat_index] += 1
    return out


@settings(max_examples=60, deadline=None)
@given(batches(), st.data())
def test_any_single_tensor_element_changes_the_fingerprint(b: PuzzletronBatch, data: st.DataObject) -> None:
    assert revalidated(b).fingerprint == b.fingerprint  # equal content, fresh object
    assert pickle.loads(pickle.dumps(b)).fingerprint == b.fingerprint
    assert b.to("cpu").fingerprint == b.fingerprint
    kind, name = data.draw(st.sampled_from(_tensor_fields(b)))
    owner = {"seq": b.sequence, "field": b}.get(kind)
    t = b.model_kwargs[name] if owner is None else getattr(owner, name)
    index = data.draw(st.integers(0, t.numel() - 1))
    changed = _with_tensor(b, kind, name, _one_element_changed(t, index))
    assert changed.fingerprint != b.fingerprint, (kind, name, index)
    # The same values in another dtype are other content too.
    if t.dtype != torch.bool:
        other = torch.float64 if not t.is_floating_point() or t.dtype != torch.float64 else torch.float32
        assert _with_tensor(b, kind, name, t.to(other)).fingerprint != b.fingerprint


@settings(max_examples=60, deadline=None)
@given(batches(), st.data())
def test_any_metadata_or_source_value_changes_the_fingerprint(
    b: PuzzletronBatch, data: st.DataObject
) -> None:
    seq = b.sequence
    variants = {
        "max_seqlen": dataclasses.replace(seq, max_seqlen=(seq.max_seqlen or 0) + 1),
        "cp": dataclasses.replace(seq, cp_rank=1, cp_size=2),
        "offsets": dataclasses.replace(seq, sample_offsets=(*seq.sample_offsets, (0, 1))),
    }
    if seq.global_cu_seqlens is not None:
        variants["no cu"] = dataclasses.replace(seq, global_cu_seqlens=None)
    for what, new_seq in variants.items():
        assert _tables.derive(b, sequence=new_seq).fingerprint != b.fingerprint, what
    key = data.draw(st.sampled_from(sorted(b.source_metadata)))
    value = b.source_metadata[key]
    for source in (
        {**b.source_metadata, key: value + "x"},
        {**b.source_metadata, key: [value]},
        {k: v for k, v in b.source_metadata.items() if k != key},
        {**b.source_metadata, "extra": None},
    ):
        assert dataclasses.replace(b, source_metadata=source).fingerprint != b.fingerprint
    sample_ids = tuple(f"{s}'" for s in b.sample_ids) or tuple(map(str, range(b.batch_size)))
    assert dataclasses.replace(b, sample_ids=sample_ids).fingerprint != b.fingerprint
    other_modality = "text" if b.modality.value == "multimodal" else "multimodal"
    assert _tables.derive(b, modality=Modality(other_modality)).fingerprint != b.fingerprint
    for key, value in b.model_kwargs.items():
        if isinstance(value, list) and value:  # e.g. second_per_grid_ts, n_videos_per_sample
            changed = _tables.derive(b, model_kwargs={**b.model_kwargs, key: [*value[:-1], value[-1] + 1]})
            assert changed.fingerprint != b.fingerprint, key


FRESH_PROCESS = """
import pickle, sys
import torch
torch.set_printoptions(precision=1, threshold=2, edgeitems=1, linewidth=20, sci_mode=True)
for b in pickle.load(open(sys.argv[1], "rb")):
    print(b.fingerprint)
"""


@pytest.mark.slow
@settings(max_examples=3, deadline=None)
@given(st.lists(batches(), min_size=8, max_size=8))
def test_random_batch_fingerprints_are_identical_in_a_fresh_process_with_another_hash_seed(
    tmp_path_factory: pytest.TempPathFactory, bs: list[PuzzletronBatch]
) -> None:
    path = tmp_path_factory.mktemp("fp") / "batches.pkl"
    path.write_bytes(pickle.dumps(bs))
    env = {**os.environ, "PYTHONHASHSEED": str(len(path.read_bytes()) % 4093 + 1), "PYTHONPATH": str(SRC)}
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(path)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert result.stdout.split() == [b.fingerprint for b in bs]

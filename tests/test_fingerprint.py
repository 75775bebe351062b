"""Fingerprints (contract 3.2): content addressed, byte exact, process independent, no `repr()` fallback."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from enum import Enum
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _batch_strategies import batches, revalidated
from puzzletron.dataset import DataLayout, PackedSequenceMetadata, PuzzletronBatch
from puzzletron.dataset._fingerprint import fingerprint_of

SRC = Path(__file__).resolve().parents[1] / "src"

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


def test_one_ce_mask_bit_changes_the_fingerprint() -> None:
    mask = torch.tensor([[True, True, True, True, True, False]])
    flipped = mask.clone()
    flipped[0, 2] = False
    assert _batch(ce_mask=mask).fingerprint != _batch(ce_mask=flipped).fingerprint
    assert _batch(ce_mask=mask).fingerprint == _batch(ce_mask=mask.clone()).fingerprint


@settings(max_examples=30, deadline=None)
@given(batches(), st.data())
def test_random_batches_fingerprint_by_content(b: PuzzletronBatch, data: st.DataObject) -> None:
    assert revalidated(b).fingerprint == b.fingerprint  # equal content, fresh object
    row = data.draw(st.integers(0, b.batch_size - 1))
    col = data.draw(st.integers(0, b.sequence_length - 1))
    ids = b.input_ids.clone()
    ids[row, col] += 1
    assert b.replace_model_kwargs(input_ids=ids).fingerprint != b.fingerprint
    ce = b.ce_mask.clone()
    if bool(b.hidden_mask[row, col]):
        ce[row, col] = ~ce[row, col]
        assert dataclasses.replace(b, ce_mask=ce).fingerprint != b.fingerprint
    meta = {**b.source_metadata, "revision": "r2"}
    assert dataclasses.replace(b, source_metadata=meta).fingerprint != b.fingerprint

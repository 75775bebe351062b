"""`batch_from_automodel` on the outputs of the real NeMo AutoModel 0.7 text collators: ``default_collater``,
THD packing (with and without CP gaps) and neat packing in every mask form. Conversations come from a
materialised subset through `load_materialized_conversation_dataset`, tokenised by AutoModel's own
`format_chat_template`; the checks (``_collator_checks``) compare with the collators' own maps and builders
and follow every batch through `dp_slice`, `pp_microbatches` and `cp_partition`. `nemo_automodel` is a test
dependency (the `automodel` extra): if it is missing this module fails."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from nemo_automodel.components.datasets.llm.formatting_utils import format_chat_template
from nemo_automodel.components.datasets.llm.neat_packing import neat_pack_dataset
from nemo_automodel.components.datasets.llm.packed_sequence import pack_dataset
from nemo_automodel.components.datasets.utils import (
    default_collater,
    neat_packed_collater,
    packed_sequence_thd_collater,
)
from nemo_automodel.components.distributed.thd_utils import process_input_for_thd
from transformers import AutoTokenizer

from _collator_checks import (
    MASK_TYPES,
    PACKED,
    Contract,
    check_cp_partition,
    check_labels,
    check_packed_against_doc_ids,
    check_row_splits,
    convert,
    sample_lengths,
    thd_doc_ids,
)
from puzzletron.dataset import (
    Modality,
    load_materialized_conversation_dataset,
    materialize_normalized_conversation_samples,
)
from puzzletron.dataset.clients.automodel.adapter import forward_kwargs
from puzzletron.fixtures.tokenizer import build_chat_tokenizer


def _text_sample(i: int) -> dict[str, Any]:
    question = "Question: " + "what is the total in the table? " * (1 + i % 5)
    return {
        "conversation": [
            {"role": "user", "content": [{"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"The total is {i * 37}."}]},
        ],
        "image_count": 0,
        "source": {"dataset": f"fixture/text-{i % 2}", "revision": "r1", "row_id": str(i)},
    }


@pytest.fixture(scope="module")
def tokenizer(workdir: Path) -> Any:
    return AutoTokenizer.from_pretrained(build_chat_tokenizer(workdir / "tokenizer"))


@pytest.fixture(scope="module")
def text_samples(workdir: Path, tokenizer: Any) -> list[dict[str, Any]]:
    """AutoModel-tokenised samples (``input_ids``, shifted ``labels``, ``attention_mask``) from the subset."""
    materialize_normalized_conversation_samples((_text_sample(i) for i in range(10)), workdir / "text")
    dataset = load_materialized_conversation_dataset(workdir / "text", num_samples=10)
    assert len(dataset) == 10
    return [
        format_chat_template(
            tokenizer, dataset[i]["conversation"], tokenizer.eos_token_id, tokenizer.pad_token_id
        )
        for i in range(len(dataset))
    ]


@pytest.mark.parametrize("layout", ["padded_varlen", PACKED])
def test_default_collater(text_samples: list[dict[str, Any]], layout: str) -> None:
    samples = copy.deepcopy(text_samples[:4])
    collated = default_collater(copy.deepcopy(samples))
    labels = collated["labels"]
    batch = convert(collated, layout)
    assert batch.batch_size == 4
    assert int(batch.hidden_mask.sum()) == sum(sample_lengths(samples))
    assert batch.labels is labels  # padding already -100: untouched and not copied
    assert torch.equal(batch.ce_mask, labels != -100)
    assert batch.model_kwargs["attention_mask"] is collated["attention_mask"]
    assert "padding_mask" in batch.model_kwargs
    assert batch.modality is Modality.TEXT
    if layout == PACKED:
        assert batch.sequence.global_cu_seqlens.diff().tolist() == sample_lengths(samples)
    doc_ids = collated["attention_mask"].long()  # the collator's map: one document per row
    check_labels(batch, labels, doc_ids)
    check_row_splits(batch, collated, doc_ids)
    check_cp_partition(batch, collated, doc_ids)


@pytest.mark.parametrize("cp_size", [1, 2])
def test_thd_packing(text_samples: list[dict[str, Any]], cp_size: int) -> None:
    packs = pack_dataset(copy.deepcopy(text_samples), split=None, packed_sequence_size=96, cp_size=cp_size)
    collated = packed_sequence_thd_collater([packs[i] for i in range(len(packs))])
    assert collated["qkv_format"] == "thd"
    labels = collated["labels"].clone()
    batch = convert(collated, PACKED)
    seq_lens, padded = collated["seq_lens"], collated["seq_lens_padded"]
    lengths = seq_lens[seq_lens >= 0]
    assert batch.sequence.global_cu_seqlens.diff().tolist() == lengths.tolist()
    assert int(batch.hidden_mask.sum()) == sum(sample_lengths(text_samples))
    # Each document starts at the collator's padded offset, where its position ids restart at 0.
    starts = padded.clamp(min=0).cumsum(dim=1) - padded.clamp(min=0)
    seq_ids = batch.sequence.seq_ids
    for row in range(seq_ids.shape[0]):
        row_starts = starts[row][seq_lens[row] >= 0]
        first = torch.nonzero(seq_ids[row, 1:] != seq_ids[row, :-1]).flatten() + 1
        doc_first = torch.cat([torch.tensor([0]), first])[
            seq_ids[row, torch.cat([torch.tensor([0]), first])] >= 0
        ]
        assert doc_first.tolist() == row_starts.tolist()
        assert collated["position_ids"][row, doc_first].tolist() == [0] * len(doc_first)
    assert torch.equal(batch.labels, labels)
    assert batch.model_kwargs["qkv_format"] == "thd"
    if cp_size == 2:
        assert bool((padded >= seq_lens).all()) and bool((padded > seq_lens).any())  # CP gaps exist
    # Transformer Engine kwargs equal AutoModel's own THD conversion (real and padded cu over B*T).
    reference = process_input_for_thd(dict(collated))
    thd = forward_kwargs(batch, backend="te_thd")
    assert torch.equal(thd["cu_seqlens_q"], reference["cu_seqlens"])
    assert torch.equal(
        thd["cu_seqlens_q_padded"], reference.get("cu_seqlens_padded", reference["cu_seqlens"])
    )
    doc_ids = thd_doc_ids(seq_lens, padded, collated["input_ids"].shape[1])
    assert int(doc_ids.max()) >= 2  # packs really hold several documents
    check_packed_against_doc_ids(batch, doc_ids)
    check_labels(batch, labels, doc_ids)
    check_row_splits(batch, collated, doc_ids)
    check_cp_partition(batch, collated, doc_ids)


@pytest.fixture(scope="module")
def neat_packs(text_samples: list[dict[str, Any]]) -> Any:
    return neat_pack_dataset(
        datasets.Dataset.from_list(copy.deepcopy(text_samples)), split=None, pack_size=96
    )


@pytest.mark.parametrize("metadata", [False, True])
@pytest.mark.parametrize("mask_type", MASK_TYPES)
def test_neat_packing_every_mask_form(
    text_samples: list[dict[str, Any]], neat_packs: Any, mask_type: str, metadata: bool
) -> None:
    collated = neat_packed_collater(
        [neat_packs[i] for i in range(len(neat_packs))], packing=Contract(mask_type, metadata)
    )
    doc_ids = collated["_packed_seq_ids"]
    assert int(doc_ids.max()) >= 2  # packs really hold several documents
    labels = collated["labels"].clone()
    batch = convert(dict(collated), PACKED)
    check_packed_against_doc_ids(batch, doc_ids)
    assert int(batch.hidden_mask.sum()) == sum(sample_lengths(text_samples))
    assert torch.equal(batch.labels, labels)
    assert "_packed_seq_ids" not in batch.model_kwargs
    if mask_type == "flash_varlen":
        assert "attention_mask" not in batch.model_kwargs
        # Every sample starts on a boundary of the collator's physical cu_seq_lens_q (flattened B*T).
        cu = batch.sequence.global_cu_seqlens.long()
        valid_positions = torch.nonzero(batch.hidden_mask.flatten()).flatten()
        sample_starts = valid_positions[cu[:-1]]
        assert bool(torch.isin(sample_starts, collated["cu_seq_lens_q"].long()).all())
    if metadata:
        cu_rows = collated["cu_seqlens"]
        per_row = [row[row >= 0].diff() for row in cu_rows]
        assert torch.cat(per_row).tolist() == batch.sequence.global_cu_seqlens.diff().tolist()
    # The same collator output without `_packed_seq_ids` parses to the same samples from the mask form.
    if mask_type != "flash_varlen" or metadata:
        stripped = {k: v for k, v in collated.items() if k != "_packed_seq_ids"}
        again = convert(stripped, PACKED)
        assert torch.equal(again.sequence.seq_ids, batch.sequence.seq_ids)
    check_labels(batch, labels, doc_ids)
    check_row_splits(batch, collated, doc_ids)
    check_cp_partition(batch, collated, doc_ids)


@pytest.mark.parametrize("mask_type", MASK_TYPES)
def test_neat_packing_with_one_document_per_pack_keeps_cu(
    text_samples: list[dict[str, Any]], mask_type: str
) -> None:
    lengths = sample_lengths(text_samples)
    pack_size = max(lengths) + 1
    single = [s for s in text_samples if 2 * len(s["input_ids"]) > pack_size]
    assert len(single) >= 2
    packs = neat_pack_dataset(
        datasets.Dataset.from_list(copy.deepcopy(single)), split=None, pack_size=pack_size
    )
    items = [packs[i] for i in range(len(packs))]
    collated = neat_packed_collater(copy.deepcopy(items), packing=Contract(mask_type, False))
    assert "_packed_seq_ids" not in collated  # AutoModel drops the map when no pack holds two documents
    doc_ids = torch.stack([torch.as_tensor(item["attention_mask"]) for item in items])  # the packer's map
    labels = collated["labels"].clone()
    batch = convert(collated, PACKED)
    expected = sorted(sample_lengths(single))
    assert sorted(batch.sequence.global_cu_seqlens.diff().tolist()) == expected
    assert batch.sequence.seq_ids is not None
    assert int(batch.hidden_mask.sum()) == sum(expected)
    assert batch.sequence.seq_ids.amax(dim=1).tolist() == list(range(len(single)))  # one sample per row
    check_packed_against_doc_ids(batch, doc_ids)
    check_labels(batch, labels, doc_ids)
    check_row_splits(batch, collated, doc_ids)
    check_cp_partition(batch, collated, doc_ids)

"""`make_puzzletron_chat_dataset`: AutoModel LLM items in every layout, collated by AutoModel's own
``default_collater``, with the library's shifted labels and the spec options checked up front.

The recipe itself runs in ``test_recipes.py``; these are the fast checks of the items."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from nemo_automodel.components.datasets.utils import default_collater

from _tiny_models import conversations
from puzzletron.dataset.clients.automodel.llm_factory import make_puzzletron_chat_dataset
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.pipelines.text import build_batches
from puzzletron.fixtures.tokenizer import build_chat_tokenizer


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llm-factory")
    rows = datasets.Dataset.from_list(conversations(12, seed=3, longest=8))
    datasets.DatasetDict({"train": rows}).save_to_disk(str(root / "snapshot"))
    return {"path": root / "snapshot", "tokenizer": build_chat_tokenizer(root / "tokenizer")}


def _make(snapshot: dict[str, Path], **options: Any) -> Any:
    return make_puzzletron_chat_dataset(snapshot["path"], tokenizer_path=snapshot["tokenizer"], **options)


def test_packed_items_are_the_library_packs_in_its_seeded_order(snapshot: dict[str, Path]) -> None:
    rows = _make(snapshot, seq_length=96, seed=5)
    spec = PuzzletronDataSpec("text", "packed_varlen", 96, packing=PackingSpec(pack_size=96))
    batches = build_batches(
        snapshot["path"], tokenizer=snapshot["tokenizer"], spec=spec, batch_size=1, seed=5
    )
    assert len(rows) == len(batches) and len(rows) < 12  # packs, several chats each
    collated = default_collater([copy.deepcopy(rows[i]) for i in range(2)])
    want = [batches.dataset[batches.sampler.key(step)] for step in range(2)]
    assert torch.equal(collated["input_ids"], torch.cat([b.input_ids for b in want]))
    assert torch.equal(collated["labels"], torch.cat([b.labels for b in want]))  # shifted, -100 on padding
    assert torch.equal(collated["position_ids"], torch.cat([b.model_kwargs["position_ids"] for b in want]))
    assert "attention_mask" not in collated  # a 2-D mask would hide the documents from HF
    assert torch.equal(collated["padding_mask"], torch.cat([~b.hidden_mask for b in want]))


def test_padded_varlen_items_keep_their_length_and_the_collator_pads(snapshot: dict[str, Path]) -> None:
    rows = _make(snapshot, seq_length=64, layout="padded_varlen", seed=0, shuffle=False)
    assert len(rows) == 12
    items = [copy.deepcopy(rows[i]) for i in range(3)]
    lengths = [len(item["input_ids"]) for item in items]
    assert len(set(lengths)) > 1 and all(
        item["attention_mask"] == [1] * n for item, n in zip(items, lengths, strict=True)
    )
    collated = default_collater(items)
    assert collated["input_ids"].shape == (3, max(lengths))
    for row, n in enumerate(lengths):
        assert collated["labels"][row, n - 1 :].eq(-100).all()  # each sample's last token and the padding
        assert collated["padding_mask"][row].sum() == max(lengths) - n


def test_fixed_items_from_a_data_block_and_num_samples(snapshot: dict[str, Path]) -> None:
    data = {"modality": "text", "layout": "fixed", "max_sample_length": 24}
    rows = _make(snapshot, data=data, num_samples=5)
    assert len(rows) == 5
    item = rows[0]
    assert item["input_ids"].shape == item["labels"].shape == item["attention_mask"].shape == (24,)
    assert set(item["___PAD_TOKEN_IDS___"]) == {"input_ids", "labels", "attention_mask"}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"seq_length": 64, "tokenizer_path": None}, "tokenizer_path is required"),
        ({}, "seq_length is required"),
        ({"seq_length": 64, "num_samples": 99}, "exceeds"),
        ({"seq_length": 64, "layout": "fixed", "pack_size": 64}, "packed_varlen only"),
        (
            {"data": {"modality": "text", "layout": "fixed", "max_sample_length": 8}, "layout": "fixed"},
            "not both",
        ),
        (
            {"data": {"modality": "text", "layout": "fixed", "max_sample_length": 8}, "seq_length": 9},
            "disagrees",
        ),
        ({"data": {"modality": "multimodal", "layout": "fixed", "max_sample_length": 8}}, "builds text rows"),
        ({"seq_length": 64, "layout": "varlen"}, "data.layout"),
    ],
)
def test_bad_options_are_config_errors(
    snapshot: dict[str, Path], options: dict[str, Any], message: str
) -> None:
    options = {"tokenizer_path": snapshot["tokenizer"], **options}
    with pytest.raises(ConfigError, match=message):
        make_puzzletron_chat_dataset(snapshot["path"], **options)


def _items(rows: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in rows[i].items() if k != "___PAD_TOKEN_IDS___"} for i in range(len(rows))]


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True)
    )


def test_with_a_cache_dir_the_recipe_reads_a_token_store_built_once(
    snapshot: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AutoModel builds the dataset on every rank and every run: with ``cache_dir`` only the first call
    tokenises; the rows are the in-memory ones, and the store alone (no tokenizer) gives them too."""
    from puzzletron.dataset.pipelines import _core as pipeline
    from puzzletron.dataset.tokenize import store as build_store

    in_memory = _items(_make(snapshot, seq_length=96, seed=5))
    first = _items(_make(snapshot, seq_length=96, seed=5, cache_dir=tmp_path / "stores"))
    (store,) = (p for p in (tmp_path / "stores").iterdir() if not p.name.startswith("."))  # plans are hidden

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the token store in cache_dir must be reused")

    for module, name in ((build_store, "tokenize_rows"), (pipeline, "tokenize_conversations")):
        monkeypatch.setattr(module, name, never)
    again = _items(_make(snapshot, seq_length=96, seed=5, cache_dir=tmp_path / "stores"))
    from_store = _items(make_puzzletron_chat_dataset(store, seq_length=96, seed=5))  # no tokenizer_path
    assert _same(first, in_memory) and _same(again, in_memory) and _same(from_store, in_memory)


def test_a_yaml_typo_is_a_type_error_naming_the_option_meant(snapshot: dict[str, Path]) -> None:
    """The LLM factory says "did you mean" as the VLM factory does (one helper: `refuse_unknown`), through
    Hydra as well; before, it was Python's bare "unexpected keyword argument"."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    target = "puzzletron.dataset.clients.automodel.make_puzzletron_chat_dataset"
    cfg = OmegaConf.create(
        {"_target_": target, "dataset_path": str(snapshot["path"]), "tokeniser_path": "x", "seq_length": 64}
    )
    with pytest.raises(Exception, match=r"'tokeniser_path' \(did you mean 'tokenizer_path'\?\)") as info:
        instantiate(cfg)
    cause = info.value if isinstance(info.value, TypeError) else info.value.__cause__
    assert isinstance(cause, TypeError)
    with pytest.raises(
        TypeError, match=r"got unknown option\(s\): 'seq_len' \(did you mean 'seq_length'\?\)"
    ):
        _make(snapshot, seq_len=64)


def test_a_wrong_tokenizer_path_for_a_token_store_is_an_error_naming_both(
    snapshot: dict[str, Path], tmp_path: Path
) -> None:
    _make(snapshot, seq_length=96, cache_dir=tmp_path / "stores")
    (store,) = (p for p in (tmp_path / "stores").iterdir() if not p.name.startswith("."))
    other = build_chat_tokenizer(tmp_path / "other")
    (other / "chat_template.jinja").write_text("{{ 'x' }}" + (other / "chat_template.jinja").read_text())
    with pytest.raises(ConfigError, match=rf"the token store {store} was built with another tokenizer than"):
        make_puzzletron_chat_dataset(store, seq_length=96, tokenizer_path=other)
    with pytest.raises(ConfigError, match="holds split 'train', not the split 'validation' asked for"):
        make_puzzletron_chat_dataset(store, seq_length=96, split="validation")
    assert make_puzzletron_chat_dataset(store, seq_length=96, tokenizer_path=snapshot["tokenizer"])  # its own


def test_a_text_snapshot_at_an_url_gives_the_items_of_its_folder(
    fixture_hub: Any, tokenizer_dir: Path, tmp_path: Path, bucket: str
) -> None:
    from _token_store_data import make_snapshot
    from puzzletron.dataset.storage.objects import Objects

    local = make_snapshot(fixture_hub, tmp_path / "puzzle-kd")
    url = f"{bucket}/snapshots/pk"
    Objects(url).upload(local)
    options = {"tokenizer_path": tokenizer_dir, "seq_length": 4096, "seed": 1, "cache_dir": tmp_path / "c"}
    from_url = make_puzzletron_chat_dataset(url, **options)
    from_folder = make_puzzletron_chat_dataset(local, **options)  # reuses the store the URL built
    assert len(from_url) == len(from_folder) > 0

    def items(rows: Any) -> list[dict[str, Any]]:
        return [
            {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in rows[i].items()}
            for i in range(len(rows))
        ]

    assert items(from_url) == items(from_folder)
    assert len(list((tmp_path / "c").iterdir())) == 2  # one store (and its plans)

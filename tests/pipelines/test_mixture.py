"""`build_mixture_batches`: several stores, one exact token-weighted stream, dealt and resumed at any DP size;
every document equals its sample in its own store (text) or alone through the processor (images)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from _vlm_checks import Reference, documents
from puzzletron.dataset import PuzzletronDataSpec
from puzzletron.dataset.batch import Modality
from puzzletron.dataset.clients.attention import model_inputs
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.formats.token_store import TokenStore
from puzzletron.dataset.pipelines.mixture import build_mixture_batches
from puzzletron.dataset.tokenize import build_token_store

PACK = 512


def _spec(modality: str = "text", layout: str = "packed_varlen", **packing) -> PuzzletronDataSpec:
    raw = {"modality": modality, "layout": layout, "max_sample_length": PACK}
    if layout == "packed_varlen":
        raw["packing"] = {"pack_size": PACK, **packing}
    return PuzzletronDataSpec.from_mapping(raw)


@pytest.fixture(scope="module")
def text_stores(snapshot: Path, tokenizer_dir: Path, tmp_path_factory) -> dict[str, Path]:
    """The snapshot's two splits as token stores of one tokenizer (two components of a text mixture)."""
    cache = tmp_path_factory.mktemp("mixture-stores")
    return {
        split: build_token_store(snapshot, tokenizer=tokenizer_dir, cache_dir=cache, split=split)
        for split in ("train", "validation")
    }


def _shares(batches_by_step, weights: dict[str, float]) -> float:
    """The largest gap, in packs, between a component's real tokens and its share of all, after any step."""
    names = list(weights)
    share = np.array([weights[n] for n in names]) / sum(weights.values())
    delivered = np.zeros(len(names))
    worst = 0.0
    for step in batches_by_step:
        for batch in step:
            lengths = np.diff(batch.sequence.global_cu_seqlens.numpy())
            for name, tokens in zip(batch.source_metadata["document_components"], lengths, strict=True):
                delivered[names.index(name)] += tokens
        worst = max(worst, float(np.abs(delivered - delivered.sum() * share).max()) / PACK)
    return worst


def _epoch(batches, dp_size: int) -> list[list]:
    """Every rank's batches of the epoch, step by step."""
    ranks = [batches.for_rank(r) for r in range(dp_size)]
    return [list(step) for step in zip(*ranks, strict=True)]


def test_text_mixture_holds_each_share_at_every_step_and_names_each_documents_component(text_stores) -> None:
    weights = {"train": 0.75, "validation": 0.25}
    batches = build_mixture_batches(
        text_stores, weights=weights, spec=_spec(), batch_size=1, dp_size=2, seed=3, num_tokens=60 * PACK
    )
    steps = _epoch(batches, 2)
    assert _shares(steps, weights) <= 2
    stores = {name: TokenStore(path) for name, path in text_stores.items()}
    for step in steps:
        for batch in step:
            meta = batch.source_metadata
            assert len(meta["document_components"]) == len(meta["document_ids"])
            cu = batch.sequence.global_cu_seqlens.tolist()
            flat_ids = batch.input_ids[batch.hidden_mask]
            pairs = zip(meta["document_components"], meta["document_ids"], strict=True)
            for k, (name, doc) in enumerate(pairs):
                store = stores[name]
                index = store.sample_ids(np.arange(len(store))).index(doc)
                assert torch.equal(flat_ids[cu[k] : cu[k + 1]], torch.from_numpy(store.tokens(index)).long())
    report = {c.name: c for c in batches.plan.report()}
    total = sum(c.real_tokens for c in report.values())
    assert abs(total - 60 * PACK) <= PACK
    assert report["validation"].passes > 1  # 24 rows cannot give 25 % of 60 packs in one pass
    assert abs(report["train"].share_achieved - 0.75) <= 2 * PACK / total


def test_the_stream_is_the_same_at_any_dp_and_batch_size(text_stores) -> None:
    orders = []
    for dp, bs in ((1, 1), (2, 2), (3, 1)):
        batches = build_mixture_batches(
            text_stores,
            weights={"train": 2, "validation": 1},
            spec=_spec(),
            batch_size=bs,
            dp_size=dp,
            seed=5,
        )
        rows = batches.sampler.deal().reshape(-1)
        orders.append(sorted(rows[rows >= 0].tolist()))
        assert np.array_equal(np.sort(batches.plan.order(0)), np.sort(rows[rows >= 0]))
        stream = batches.plan.order(0)
        g = dp * bs
        deal = batches.sampler.deal()
        for s, step in enumerate(deal):  # each step: the stream's next dp * bs rows
            assert sorted(step[step >= 0].tolist()) == sorted(stream[s * g : (s + 1) * g].tolist())
    assert orders[0] == orders[1] == orders[2]


def test_a_state_saved_at_one_dp_size_resumes_at_another_with_nothing_lost(text_stores) -> None:
    options = {"weights": {"train": 1, "validation": 1}, "spec": _spec(), "seed": 2, "num_tokens": 40 * PACK}
    first = build_mixture_batches(text_stores, batch_size=2, dp_size=4, **options)
    stream = sorted(first.plan.order(0).tolist())
    taken: list[int] = []
    ranks = [first.for_rank(r) for r in range(4)]
    iterators = [iter(r.sampler) for r in ranks]
    for _ in range(2):
        for it in iterators:
            taken += [i for i in next(it).indices if i >= 0]
    state = ranks[0].sampler.state_dict()
    second = build_mixture_batches(text_stores, batch_size=1, dp_size=3, **options)
    for r in range(3):
        sampler = second.for_rank(r).sampler
        sampler.load_state_dict(state)
        taken += [i for key in sampler for i in key.indices if i >= 0]
    assert sorted(taken) == stream
    other = build_mixture_batches(text_stores, batch_size=1, dp_size=3, **{**options, "seed": 9})
    with pytest.raises(ConfigError, match="another mixture"):
        other.sampler.load_state_dict(state)


def test_batches_are_identical_across_workers_and_builds(text_stores) -> None:
    options = {"weights": {"train": 3, "validation": 1}, "spec": _spec(), "batch_size": 2, "seed": 4}
    one = build_mixture_batches(text_stores, **options)
    fingerprints = [b.fingerprint for b in one]
    assert [b.fingerprint for b in one.loader(num_workers=2)] == fingerprints
    assert [b.fingerprint for b in build_mixture_batches(text_stores, **options)] == fingerprints


def test_the_epoch_is_planned_once_and_a_damaged_cache_is_planned_again(text_stores, tmp_path) -> None:
    options = {"weights": {"train": 1, "validation": 1}, "spec": _spec(), "plan_cache": tmp_path}
    first = build_mixture_batches(text_stores, batch_size=1, **options)
    order = np.array(first.plan.order(0))
    (folder,) = tmp_path.glob("mixture-*-e0")
    data = bytearray((folder / "order.npy").read_bytes())
    data[-8:] = (10**9).to_bytes(8, "little")
    (folder / "order.npy").write_bytes(bytes(data))  # one row id changed: a damaged cache entry
    again = build_mixture_batches(text_stores, batch_size=1, **options)
    assert np.array_equal(again.plan.order(0), order)


def test_bad_mixtures_are_one_clear_error(
    text_stores, vlm_stores, processor_dirs, vlm_subset, snapshot, tokenizer_dir, tmp_path
) -> None:
    spec = _spec()
    with pytest.raises(ConfigError, match="unknown component 'nope'"):
        build_mixture_batches(text_stores, weights={"train": 1, "nope": 1}, spec=spec, batch_size=1)
    with pytest.raises(
        ConfigError, match=r"is a VLM store: its batches hold images, but data\.modality is text"
    ):
        build_mixture_batches(
            {"text": text_stores["train"], "vlm": vlm_stores["qwen2_5_vl"]},
            weights={"text": 1, "vlm": 1},
            spec=spec,
            batch_size=1,
        )
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tokenizer_dir, other)
    template = other / "chat_template.jinja"
    template.write_text(template.read_text() + "{#- another template -#}")
    edited = build_token_store(snapshot, tokenizer=other, cache_dir=tmp_path / "stores")
    with pytest.raises(ConfigError, match="different tokenizers") as info:
        build_mixture_batches(
            {"text": edited, "vlm": vlm_stores["qwen2_5_vl"]},
            weights={"text": 1, "vlm": 1},
            spec=_spec("multimodal"),
            batch_size=1,
            processor=processor_dirs["qwen2_5_vl"],
            subsets={"vlm": vlm_subset},
        )
    assert "chat_template.jinja" in str(info.value)
    assert str(edited) in str(info.value) and str(vlm_stores["qwen2_5_vl"]) in str(info.value)


@pytest.fixture(scope="module")
def vlm_mixture(snapshot, vlm_subset, processor_dirs, tmp_path_factory):
    cache = tmp_path_factory.mktemp("vlm-mixture")
    return dict(
        sources={"vlm": vlm_subset, "text": snapshot},
        weights={"vlm": 0.6, "text": 0.4},
        spec=_spec("multimodal"),
        processor=processor_dirs["qwen2_5_vl"],
        cache_dir=cache,
    )


def test_every_document_of_a_vlm_mixture_equals_its_sample(vlm_mixture, processor_dirs, vlm_subset) -> None:
    reference = Reference("qwen2_5_vl", processor_dirs["qwen2_5_vl"], vlm_subset)
    batches = build_mixture_batches(**vlm_mixture, batch_size=2, seed=1)
    text = batches.components["text"].store
    names = text.sample_ids(np.arange(len(text)))
    seen = {"vlm": 0, "text": 0}
    for batch in batches:
        assert batch.modality is Modality.MULTIMODAL
        kwargs = batch.model_kwargs
        assert kwargs["position_ids"].shape == (3, *batch.input_ids.shape)
        image = patch = 0
        components = iter(batch.source_metadata["document_components"])
        for name, row, cols in documents(batch):
            component = next(components)
            seen[component] += 1
            if component == "text":
                want = torch.from_numpy(text.tokens(names.index(name))).long()
                assert torch.equal(batch.input_ids[row, cols], want)
                positions = torch.arange(cols.numel()).expand(3, -1)
                assert torch.equal(kwargs["position_ids"][:, row, cols], positions)
                assert not kwargs["mm_token_type_ids"][row, cols].any()
                continue
            want = reference(name)
            assert torch.equal(batch.input_ids[row, cols], want["input_ids"])
            assert torch.equal(kwargs["position_ids"][:, row, cols], want["positions"])
            grid = want.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))
            p = int(grid.prod(dim=-1).sum()) if grid.numel() else 0
            assert torch.equal(kwargs["image_grid_thw"][image : image + grid.shape[0]], grid)
            if p:
                assert torch.equal(kwargs["pixel_values"][patch : patch + p], want["pixel_values"])
            image, patch = image + grid.shape[0], patch + p
        assert image == kwargs["image_grid_thw"].shape[0] and patch == kwargs["pixel_values"].shape[0]
    assert seen["vlm"] > 0 and seen["text"] > 0


def test_a_vlm_mixture_with_device_resize_gives_the_float32_pixels_after_model_inputs(vlm_mixture) -> None:
    floats = build_mixture_batches(**vlm_mixture, batch_size=2, seed=1)
    decoded = build_mixture_batches(
        **vlm_mixture, batch_size=2, seed=1, pixel_dtype=torch.uint8, device_resize=True
    )
    images = 0
    for want, got in zip(floats, decoded, strict=True):
        assert isinstance(got.model_kwargs["pixel_values"], list)
        assert torch.equal(got.input_ids, want.input_ids)
        ours, theirs = model_inputs(got, backend="sdpa"), model_inputs(want, backend="sdpa")
        assert ours.keys() == theirs.keys()
        if "pixel_values" in theirs:
            assert torch.equal(ours["pixel_values"], theirs["pixel_values"])
            images += int(theirs["image_grid_thw"].shape[0])
    assert images > 0
    with pytest.raises(ConfigError, match=r"device_resize=True ships uint8 decoded images"):
        build_mixture_batches(**vlm_mixture, batch_size=2, device_resize=True)


def test_every_rank_of_a_step_holds_an_image_or_none_does(vlm_mixture) -> None:
    batches = build_mixture_batches(**vlm_mixture, batch_size=1, dp_size=2, seed=0)
    steps = _epoch(batches, 2)
    mixed = 0
    for step in steps:
        with_images = [int(b.sequence.media_counts.sum()) > 0 for b in step]
        mixed += any(with_images) and not all(with_images)
    assert mixed == batches.sampler.image_exceptions() <= 1  # at most where the images run out


def test_the_report_counts_the_supervised_tokens_its_batches_hold(text_stores) -> None:
    batches = build_mixture_batches(
        text_stores, weights={"train": 1, "validation": 1}, spec=_spec(), batch_size=2, num_tokens=30 * PACK
    )
    counted = {"train": 0, "validation": 0}
    for batch in batches:
        cu = batch.sequence.global_cu_seqlens.tolist()
        supervised = (batch.labels[batch.hidden_mask] != -100).long()
        for k, name in enumerate(batch.source_metadata["document_components"]):
            counted[name] += int(supervised[cu[k] : cu[k + 1]].sum())
    report = {c.name: c.supervised_tokens for c in batches.report()}
    assert report == counted and min(counted.values()) > 0


def test_a_small_component_repeated_within_one_batch_builds(text_stores) -> None:
    batches = build_mixture_batches(
        text_stores, weights={"train": 1, "validation": 9}, spec=_spec(), batch_size=16, num_tokens=64 * PACK
    )
    repeated = 0
    for key in batches.sampler:
        items = [i for i in key.indices if i >= 0]
        repeated += len(items) - len(set(items))
        batch = batches.dataset[key]
        assert len(batch.source_metadata["document_ids"]) == len(batch.source_metadata["document_components"])
    assert repeated > 0  # the validation split's few packs, several times in one batch


_FINGERPRINTS = """
import json, sys
from puzzletron.dataset import PuzzletronDataSpec
from puzzletron.dataset.pipelines.mixture import build_mixture_batches
spec = PuzzletronDataSpec.from_mapping(json.loads(sys.argv[1]))
batches = build_mixture_batches(json.loads(sys.argv[2]), weights={"train": 3, "validation": 1}, spec=spec,
                                batch_size=2, dp_rank=1, dp_size=2, seed=4)
print(json.dumps([b.fingerprint for b in batches]))
"""


def test_fingerprints_are_the_same_in_another_process_and_after_a_mid_epoch_resume(text_stores) -> None:
    import json
    import subprocess
    import sys

    raw = {
        "modality": "text",
        "layout": "packed_varlen",
        "max_sample_length": PACK,
        "packing": {"pack_size": PACK},
    }
    options = {
        "weights": {"train": 3, "validation": 1},
        "spec": _spec(),
        "batch_size": 2,
        "dp_size": 2,
        "seed": 4,
    }
    batches = build_mixture_batches(text_stores, dp_rank=1, **options)
    here = [b.fingerprint for b in batches]
    sources = json.dumps({k: str(v) for k, v in text_stores.items()})
    out = subprocess.run(
        [sys.executable, "-c", _FINGERPRINTS, json.dumps(raw), sources],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here
    state = batches.sampler.state_dict(consumed=2)
    resumed = build_mixture_batches(text_stores, dp_rank=1, **options)
    resumed.sampler.load_state_dict(state)
    assert [b.fingerprint for b in resumed] == here[2:]

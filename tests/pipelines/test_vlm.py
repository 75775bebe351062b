"""`build_vlm_batches`, subset (or VLM store) + processor + spec -> multimodal batches, checked per document
against the model's own code on each sample alone (Qwen2.5-VL and Qwen3-VL fixture processors, tiny random
float64 models): tokens, labels, pixels, grids, ``get_rope_index`` positions and the forward's logits, in
every layout and after ``dp_slice``, ``pp_microbatches`` and a gathered ``cp_partition``."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _tiny_models import tiny_qwen2_5_vl, tiny_qwen3_vl
from _vlm_checks import Reference, check_documents, check_forward
from _vlm_data import PLANTED, vlm_samples
from puzzletron.dataset import materialize_normalized_conversation_samples
from puzzletron.dataset.batch import DataLayout, Modality
from puzzletron.dataset.batch.cp import batch_cp_indices, gather_cp_partitions
from puzzletron.dataset.clients.attention import model_inputs
from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.errors import ConfigError, PackingError
from puzzletron.dataset.pipelines.vlm import build_vlm_batches
from puzzletron.dataset.tokenize import normalize_pixels

KINDS = ("qwen2_5_vl", "qwen3_vl")
MODELS = {"qwen2_5_vl": tiny_qwen2_5_vl, "qwen3_vl": tiny_qwen3_vl}


def _spec(
    layout: str = "packed_varlen", *, pack_size: int = 512, length: int = 512, **packing
) -> PuzzletronDataSpec:
    raw = {"modality": "multimodal", "layout": layout, "max_sample_length": length}
    if layout == "packed_varlen":
        raw["max_sample_length"] = min(length, pack_size)
        raw["packing"] = {"pack_size": pack_size, **packing}
    return PuzzletronDataSpec.from_mapping(raw)


@pytest.fixture(scope="module")
def references(processor_dirs: dict[str, Path], vlm_subset: Path) -> dict[str, Reference]:
    return {kind: Reference(kind, processor_dirs[kind], vlm_subset) for kind in KINDS}


def _batches(kind: str, vlm_stores, processor_dirs, vlm_subset, spec, **kwargs):
    return build_vlm_batches(
        vlm_stores[kind], processor=processor_dirs[kind], subset=vlm_subset, spec=spec, **kwargs
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("layout", "length"), [("packed_varlen", 512), ("padded_varlen", 512), ("fixed", 320)]
)
def test_every_document_equals_its_sample_alone(
    kind, layout, length, vlm_stores, processor_dirs, vlm_subset, references
) -> None:
    spec = _spec(layout, length=length)
    batches = _batches(kind, vlm_stores, processor_dirs, vlm_subset, spec, batch_size=2, seed=3)
    seen = []
    for batch in batches:
        assert batch.modality is Modality.MULTIMODAL and batch.layout is DataLayout(layout)
        assert batch.model_kwargs["position_ids"].shape == (3, *batch.input_ids.shape)
        seen.append(check_documents(batch, references[kind]))
    assert sum(seen) == 40 - len(PLANTED)  # every kept sample exactly once
    if layout == "packed_varlen":
        plan = batches.plan
        assert plan.row_lengths.max() <= 512 and np.diff(plan.row_offsets).min() >= 1  # none over, none empty
        assert plan.num_rows == plan.lower_bound_rows  # exact lengths: as few packs as possible


@pytest.mark.parametrize(
    ("kind", "backend", "layout"),
    [
        ("qwen2_5_vl", "sdpa", "packed_varlen"),
        ("qwen3_vl", "sdpa", "packed_varlen"),
        ("qwen2_5_vl", "eager", "packed_varlen"),
        ("qwen3_vl", "eager", "padded_varlen"),
    ],
)
def test_batch_logits_equal_every_document_run_alone(
    kind, backend, layout, vlm_stores, processor_dirs, vlm_subset, references
) -> None:
    spec = _spec(layout)
    batches = _batches(kind, vlm_stores, processor_dirs, vlm_subset, spec, batch_size=2, seed=1)
    model = MODELS[kind](references[kind].processor.tokenizer, backend)
    batch = next(iter(batches))
    if layout == "packed_varlen":
        assert len(batch.sample_ids[0].split("|")) >= 3  # several documents share a row
    check_forward(model, batch, references[kind], backend=backend, tol=1e-10)


def test_truncate_cuts_only_text_after_the_last_image_and_split_is_refused(
    vlm_stores, processor_dirs, vlm_subset, references
) -> None:
    spec = _spec(pack_size=96, length=96, long_samples="truncate")
    batches = _batches("qwen2_5_vl", vlm_stores, processor_dirs, vlm_subset, spec, batch_size=2)
    plan, store = batches.plan, batches.store
    lengths, media_end = store.lengths.astype(np.int64), store.media_end.astype(np.int64)
    long = lengths > 96
    assert plan.cut_samples == int((long & (media_end <= 96)).sum()) > 0
    assert set(plan.dropped) == set(np.flatnonzero(long & (media_end > 96)).tolist()) != set()
    assert plan.cut_tokens == int((lengths[long & (media_end <= 96)] - 96).sum())
    seen = sum(check_documents(batch, references["qwen2_5_vl"]) for batch in batches)
    assert seen == len(store) - len(plan.dropped)
    with pytest.raises(ConfigError, match="long_samples='split' is not supported for multimodal samples"):
        _batches(
            "qwen2_5_vl",
            vlm_stores,
            processor_dirs,
            vlm_subset,
            _spec(pack_size=96, long_samples="split"),
            batch_size=1,
        )
    with pytest.raises(PackingError, match=r"sample \d+ \('\d+:row\d+'\) has \d+ tokens > pack_size 96"):
        _batches(
            "qwen2_5_vl",
            vlm_stores,
            processor_dirs,
            vlm_subset,
            _spec(pack_size=96, drop_long_samples=False),
            batch_size=1,
        )


def test_packing_ratio_caps_the_fill_of_every_pack(vlm_stores, processor_dirs, vlm_subset) -> None:
    spec = _spec(pack_size=400, packing_ratio=0.75)
    plan = _batches("qwen3_vl", vlm_stores, processor_dirs, vlm_subset, spec, batch_size=1).plan
    capacity = int(400 * 0.75)
    singles = np.diff(plan.row_offsets) == 1
    assert plan.capacity == capacity and plan.row_lengths[~singles].max() <= capacity
    assert plan.row_lengths.max() <= 400 and plan.num_samples == 38


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2, 3]),
    cp=st.sampled_from([2, 3]),
    seed=st.integers(0, 3),
)
def test_splits_keep_every_document_and_image_whole(
    dp, pp, cp, seed, vlm_stores, processor_dirs, vlm_subset, references
) -> None:
    batches = _batches(
        "qwen3_vl", vlm_stores, processor_dirs, vlm_subset, _spec(pack_size=300), batch_size=4, seed=seed
    )
    reference = references["qwen3_vl"]
    for batch in batches:
        total = check_documents(batch, reference)
        rows = (
            [batch.dp_slice(dp_rank=r, dp_size=dp) for r in range(dp)]
            if batch.batch_size % dp == 0
            else [batch]
        )
        seen = 0
        for part in rows:
            padded = part.pad_batch_to_multiple(pp)
            for micro in padded.pp_microbatches(pp):
                seen += check_documents(micro, reference)
                idx = [batch_cp_indices(micro, cp_rank=r, cp_size=cp) for r in range(cp)]
                local = [micro.cp_partition(i, cp_rank=r, cp_size=cp) for r, i in enumerate(idx)]
                assert gather_cp_partitions(local, idx).fingerprint == micro.fingerprint
        assert seen == total


def test_split_batches_still_give_each_document_its_own_logits(
    vlm_stores, processor_dirs, vlm_subset, references
) -> None:
    batches = _batches(
        "qwen2_5_vl", vlm_stores, processor_dirs, vlm_subset, _spec(pack_size=300), batch_size=4
    )
    model = tiny_qwen2_5_vl(references["qwen2_5_vl"].processor.tokenizer, "sdpa")
    batch = next(iter(batches))
    for part in (batch.dp_slice(dp_rank=1, dp_size=2), *batch.pp_microbatches(2)):
        check_forward(model, part, references["qwen2_5_vl"], tol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_decoded_images_resized_on_the_device_give_the_uint8_batches_bit_for_bit(
    kind, vlm_stores, processor_dirs, vlm_subset, references
) -> None:
    spec = _spec()
    raw = _batches(kind, vlm_stores, processor_dirs, vlm_subset, spec, batch_size=2, seed=1,
                   pixel_dtype=torch.uint8)  # fmt: skip
    decoded = _batches(kind, vlm_stores, processor_dirs, vlm_subset, spec, batch_size=2, seed=1,
                       pixel_dtype=torch.uint8, device_resize=True)  # fmt: skip
    seen = 0
    for want, got in zip(raw, decoded, strict=True):
        images, grid = got.model_kwargs["pixel_values"], want.model_kwargs["image_grid_thw"]
        assert isinstance(images, list) and len(images) == grid.shape[0]
        seen += len(images)
        assert all(i.dtype == torch.uint8 and i.dim() == 3 and i.shape[2] == 3 for i in images)
        assert sum(i.nbytes for i in images) <= want.model_kwargs["pixel_values"].nbytes
        for key in ("input_ids", "position_ids", "image_grid_thw", "mm_token_type_ids"):
            assert torch.equal(got.model_kwargs[key], want.model_kwargs[key]), key
        splits = [(got, want), *zip(got.pp_microbatches(2), want.pp_microbatches(2), strict=True)]
        splits += [
            (got.dp_slice(dp_rank=r, dp_size=2), want.dp_slice(dp_rank=r, dp_size=2)) for r in range(2)
        ]
        for part, same in splits:  # each row keeps its images, resized and normalised where they are
            ours, theirs = model_inputs(part, backend="sdpa"), model_inputs(same, backend="sdpa")
            assert ours.keys() == theirs.keys()  # a part without images has no pixel_values in either
            for key in ("pixel_values", "image_grid_thw"):
                assert key not in theirs or torch.equal(ours[key], theirs[key]), key
    assert seen > 0
    model = MODELS[kind](references[kind].processor.tokenizer, "sdpa")
    check_forward(model, next(iter(decoded)), references[kind], backend="sdpa", tol=1e-10)
    with pytest.raises(
        ConfigError, match=r"device_resize=True ships uint8 decoded images; it needs pixel_dtype"
    ):
        _batches(kind, vlm_stores, processor_dirs, vlm_subset, spec, batch_size=1, device_resize=True)


def _jpeg_subset(out: Path) -> Path:
    """`vlm_samples` with their JPEG images as JPEG bytes (kept as they are; a PIL image becomes a PNG)."""
    samples = vlm_samples(40)
    for sample in samples:
        for turn in sample["conversation"]:
            for item in turn["content"] if isinstance(turn["content"], list) else ():
                if item.get("type") == "image" and item["image"].format == "JPEG":
                    buffer = io.BytesIO()
                    item["image"].save(buffer, format="JPEG", quality=85)
                    item["image"] = buffer.getvalue()
    materialize_normalized_conversation_samples(iter(samples), out)
    return out


def test_draft_decoded_images_resized_on_the_device_give_the_draft_uint8_batches(
    processor_dirs, tmp_path
) -> None:
    subset = _jpeg_subset(tmp_path / "jpegs")
    tight = tmp_path / "tight"  # a small pixel budget: targets at most half their JPEGs' sides get drafted
    shutil.copytree(processor_dirs["qwen2_5_vl"], tight)
    config = json.loads((tight / "preprocessor_config.json").read_text())
    (tight / "preprocessor_config.json").write_text(
        json.dumps({**config, "min_pixels": 784, "max_pixels": 3136})
    )
    common = {"processor": tight, "spec": _spec(), "batch_size": 2, "seed": 1,
              "cache_dir": tmp_path / "stores", "pixel_dtype": torch.uint8}  # fmt: skip
    full = build_vlm_batches(subset, **common)
    patches = build_vlm_batches(subset, **common, draft=True)
    decoded = build_vlm_batches(subset, **common, draft=True, device_resize=True)
    drafted = 0
    for whole, want, got in zip(full, patches, decoded, strict=True):
        ours, theirs = model_inputs(got, backend="sdpa"), model_inputs(want, backend="sdpa")
        assert ours.keys() == theirs.keys()
        if "pixel_values" in theirs:
            assert torch.equal(ours["pixel_values"], theirs["pixel_values"])
            drafted += not torch.equal(want.model_kwargs["pixel_values"], whole.model_kwargs["pixel_values"])
    assert drafted > 0  # some images were decoded at a reduced size (their pixels differ from a full decode)


def test_pixels_in_bfloat16(vlm_stores, processor_dirs, vlm_subset, references) -> None:
    batches = _batches(
        "qwen2_5_vl",
        vlm_stores,
        processor_dirs,
        vlm_subset,
        _spec(),
        batch_size=2,
        pixel_dtype=torch.bfloat16,
    )
    batch = next(iter(batches))
    assert batch.model_kwargs["pixel_values"].dtype == torch.bfloat16
    assert check_documents(batch, references["qwen2_5_vl"]) >= 3  # compared with the reference cast


@pytest.mark.parametrize("kind", KINDS)
def test_uint8_pixels_normalise_to_the_float32_batches_and_their_logits(
    kind, vlm_stores, processor_dirs, vlm_subset, references
) -> None:
    spec = _spec()
    floats = _batches(kind, vlm_stores, processor_dirs, vlm_subset, spec, batch_size=2, seed=1)
    raw = _batches(kind, vlm_stores, processor_dirs, vlm_subset, spec, batch_size=2, seed=1,
                   pixel_dtype=torch.uint8)  # fmt: skip
    for want, got in zip(floats, raw, strict=True):
        pixels, norm = got.model_kwargs["pixel_values"], got.source_metadata["pixel_normalization"]
        assert pixels.dtype == torch.uint8 and pixels.nbytes * 4 == want.model_kwargs["pixel_values"].nbytes
        assert torch.equal(normalize_pixels(pixels, norm), want.model_kwargs["pixel_values"])
        for key in ("input_ids", "position_ids", "image_grid_thw", "mm_token_type_ids"):
            assert torch.equal(got.model_kwargs[key], want.model_kwargs[key]), key
        inputs = model_inputs(got, backend="sdpa")  # normalised where the pixels are
        assert torch.equal(inputs["pixel_values"], model_inputs(want, backend="sdpa")["pixel_values"])
    model = MODELS[kind](references[kind].processor.tokenizer, "sdpa")
    check_forward(model, next(iter(raw)), references[kind], backend="sdpa", tol=1e-10)
    with pytest.raises(ConfigError, match=r"pixel_dtype must be a floating torch\.dtype or torch\.uint8"):
        _batches(kind, vlm_stores, processor_dirs, vlm_subset, spec, batch_size=1, pixel_dtype=torch.int16)

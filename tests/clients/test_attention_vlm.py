"""`model_inputs` / `forward_kwargs` on multimodal batches of `build_vlm_batches`: mRoPE positions ``[3, B,
T]`` cannot mark documents, so packed rows get the 4-D block-causal mask (bool for sdpa, additive for
eager); no packing metadata reaches the model (a ``cu_seqlens`` kwarg would hijack the vision tower); a
split left without images drops its empty media; a CP-local batch must be embedded first. The logits these
kwargs give are checked per document in ``tests/pipelines/test_vlm.py``."""

from __future__ import annotations

import pytest
import torch

from puzzletron.dataset.batch.cp import batch_cp_indices
from puzzletron.dataset.clients.attention import forward_kwargs, model_inputs
from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.errors import BatchValidationError, ConfigError
from puzzletron.dataset.pipelines.vlm import build_vlm_batches


def _batch(vlm_stores, processor_dirs, vlm_subset, layout: str = "packed_varlen"):
    raw = {"modality": "multimodal", "layout": layout, "max_sample_length": 300}
    if layout == "packed_varlen":
        raw["packing"] = {"pack_size": 300}
    spec = PuzzletronDataSpec.from_mapping(raw)
    batches = build_vlm_batches(
        vlm_stores["qwen2_5_vl"],
        processor=processor_dirs["qwen2_5_vl"],
        subset=vlm_subset,
        spec=spec,
        batch_size=4,
    )
    return next(iter(batches))


def test_packed_rows_get_the_block_causal_mask_and_the_batch_positions(
    vlm_stores, processor_dirs, vlm_subset
):
    batch = _batch(vlm_stores, processor_dirs, vlm_subset)
    inputs = model_inputs(batch, backend="sdpa")
    b, t = batch.input_ids.shape
    mask = inputs["attention_mask"]
    assert mask.dtype == torch.bool and mask.shape == (b, 1, t, t)
    seq = batch.sequence.seq_ids
    same = (seq[:, :, None] == seq[:, None, :]) & (seq >= 0)[:, :, None]
    assert torch.equal(mask[:, 0] & (seq >= 0)[:, :, None], same & torch.ones(t, t, dtype=torch.bool).tril())
    assert inputs["position_ids"] is batch.model_kwargs["position_ids"] and inputs["use_cache"] is False
    assert {"pixel_values", "image_grid_thw", "mm_token_type_ids", "input_ids"} <= set(inputs)
    assert not {"cu_seqlens", "seq_lens", "n_images_per_sample"} & set(inputs)
    eager = model_inputs(batch, backend="eager", dtype=torch.float64)["attention_mask"]
    assert eager.dtype == torch.float64 and torch.equal(eager == 0, mask)
    with pytest.raises(ConfigError, match=r"pass dtype=model\.dtype"):
        model_inputs(batch, backend="eager")
    with pytest.raises(BatchValidationError, match="do not mark the documents"):
        forward_kwargs(batch, backend="sdpa", mask="none")


def test_unpacked_rows_get_the_padding_mask(vlm_stores, processor_dirs, vlm_subset):
    batch = _batch(vlm_stores, processor_dirs, vlm_subset, "padded_varlen")
    inputs = model_inputs(batch, backend="sdpa")
    assert torch.equal(inputs["attention_mask"], batch.hidden_mask.long())
    assert inputs["position_ids"].shape == (3, *batch.input_ids.shape)


def test_a_split_without_images_drops_the_empty_media(vlm_stores, processor_dirs, vlm_subset):
    batch = _batch(vlm_stores, processor_dirs, vlm_subset)
    empty = batch.pad_batch_to_multiple(5).pp_microbatches(5)[-1]  # a padding row: no image
    assert empty.model_kwargs["image_grid_thw"].shape[0] == 0
    inputs = model_inputs(empty, backend="sdpa")
    assert "pixel_values" not in inputs and "image_grid_thw" not in inputs


def test_a_cp_local_multimodal_batch_must_be_embedded_first(vlm_stores, processor_dirs, vlm_subset):
    (row,) = [m for m in _batch(vlm_stores, processor_dirs, vlm_subset).pp_microbatches(4)][:1]
    local = row.cp_partition(batch_cp_indices(row, cp_rank=0, cp_size=2), cp_rank=0, cp_size=2)
    with pytest.raises(BatchValidationError, match="compute inputs_embeds on the full batch"):
        model_inputs(local, backend="sdpa")
    assert local.model_kwargs["position_ids"].shape[-1] == local.sequence_length  # gathered with the tokens


def test_a_multimodal_batch_for_a_text_only_model_is_refused_naming_both(
    vlm_stores, processor_dirs, vlm_subset
):
    """Before: a raw rotary-embedding shape error inside transformers (mRoPE positions, a text model)."""
    from _tiny_models import tiny_qwen2

    batch = _batch(vlm_stores, processor_dirs, vlm_subset)
    model = tiny_qwen2("sdpa", vocab_size=int(batch.input_ids.max()) + 1)
    with pytest.raises(
        ConfigError, match=r"a multimodal batch .* for Qwen2ForCausalLM \(qwen2\), a model without"
    ):
        model_inputs(batch, model=model)

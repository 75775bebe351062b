"""What the model's own code says about one sample alone: the processor's output (ids, assistant mask,
pixels, grids) and the model's ``get_rope_index`` positions. These are the references the VLM tests compare
against; nothing here uses the library's tokenisation, grids or positions.

Images are decoded as the pipeline documents it (``Image.open(file).convert("RGB")``, no EXIF rotation) and
handed to the processor as PIL images.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import torch
from PIL import Image

from puzzletron.dataset.formats.subset import SubsetReader
from puzzletron.fixtures.tokenizer import load_qwen2_5_vl_processor, load_qwen3_vl_processor

__all__ = ["LOADERS", "ROPE_MODELS", "processor_output", "rope_index", "sample_of"]

LOADERS = {"qwen2_5_vl": load_qwen2_5_vl_processor, "qwen3_vl": load_qwen3_vl_processor}


def _rope_models() -> dict[str, tuple[type, Any]]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen3VLConfig, Qwen3VLModel

    return {"qwen2_5_vl": (Qwen2_5_VLModel, Qwen2_5_VLConfig()), "qwen3_vl": (Qwen3VLModel, Qwen3VLConfig())}


ROPE_MODELS = _rope_models()


def sample_of(reader: SubsetReader, sample_id: str) -> dict[str, Any]:
    """The subset sample a store names ``"<index>:<row id>"``, images decoded to RGB PIL images."""
    sample = reader[int(sample_id.split(":")[0])]
    for turn in sample["conversation"]:
        if isinstance(turn["content"], list):
            for item in turn["content"]:
                if item["type"] == "image":
                    item["image"] = Image.open(item["image"]).convert("RGB")
    return sample


def processor_output(processor: Any, sample: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``input_ids`` ``[T]``, ``assistant_mask`` ``[T]`` bool, ``mm_token_type_ids`` ``[T]``, and (when the
    sample has images) ``pixel_values`` and ``image_grid_thw`` of the processor on the sample alone."""
    out = processor.apply_chat_template(
        sample["conversation"],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        return_tensors="pt",
    )
    result = {
        "input_ids": out["input_ids"][0],
        "assistant_mask": torch.as_tensor(np.asarray(out["assistant_masks"])).reshape(-1).bool(),
        "mm_token_type_ids": out["mm_token_type_ids"][0],
    }
    if "pixel_values" in out:
        result |= {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    return result


def rope_index(kind: str, mm_token_type_ids: torch.Tensor, grid: torch.Tensor | None) -> torch.Tensor:
    """``[3, T]``: the model's own ``get_rope_index`` (``Qwen2_5_VLModel`` / ``Qwen3VLModel``) of one sample,
    called on a config-only stand-in (it reads ``vision_config.spatial_merge_size`` alone)."""
    model_cls, config = ROPE_MODELS[kind]
    stub = types.SimpleNamespace(config=config)
    stub.get_vision_position_ids = types.MethodType(model_cls.get_vision_position_ids, stub)
    fn = types.MethodType(model_cls.get_rope_index, stub)
    tokens = mm_token_type_ids.reshape(1, -1).long()
    positions, _ = fn(
        input_ids=torch.zeros_like(tokens),
        mm_token_type_ids=tokens,
        image_grid_thw=grid if grid is not None and grid.numel() else None,
    )
    return positions[:, 0]

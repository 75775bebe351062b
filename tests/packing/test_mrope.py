"""`mrope_ids` against the models' own ``get_rope_index`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): random rows of
packed documents with 0-4 images of random grids (two images with one text token between them, an image
first or last), every document compared with the model's positions of that document alone; and the error
for image tokens that do not match their grids."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLModel,
    Qwen2VLConfig,
    Qwen2VLModel,
    Qwen3VLConfig,
    Qwen3VLModel,
)

from puzzletron.dataset.errors import PackingError
from puzzletron.dataset.packing import mrope_ids

MODELS = {"qwen2_vl": (Qwen2VLModel, Qwen2VLConfig), "qwen2_5_vl": (Qwen2_5_VLModel, Qwen2_5_VLConfig),
          "qwen3_vl": (Qwen3VLModel, Qwen3VLConfig)}  # fmt: skip


def _get_rope_index(kind: str):
    model_cls, config_cls = MODELS[kind]
    stub = types.SimpleNamespace(config=config_cls())
    stub.get_vision_position_ids = types.MethodType(model_cls.get_vision_position_ids, stub)
    return types.MethodType(model_cls.get_rope_index, stub)


def _document(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(image mask [L], grids [k, 3])`` of one document: text runs and images of random merged grids."""
    parts, grids = [np.zeros(rng.integers(0, 4), bool)], []
    for _ in range(rng.integers(0, 5)):
        h, w = 2 * rng.integers(1, 7), 2 * rng.integers(1, 7)
        grids.append([1, h, w])
        parts += [np.ones(h * w // 4, bool), np.zeros(rng.integers(1, 4), bool)]
    if rng.random() < 0.3 and grids:
        parts.pop()  # the document ends with an image
    mask = np.concatenate(parts)
    return (mask if mask.size else np.zeros(1, bool)), np.array(grids, dtype=np.int64).reshape(-1, 3)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_packed_document_gets_the_model_positions(kind: str) -> None:
    fn, rng = _get_rope_index(kind), np.random.default_rng(7)
    for _ in range(60):
        docs = [_document(rng) for _ in range(rng.integers(1, 5))]
        image = np.concatenate([d[0] for d in docs])
        doc = np.repeat(np.arange(len(docs)), [d[0].size for d in docs])
        grid = np.concatenate([d[1] for d in docs])
        got = mrope_ids(image, doc, grid, 2)
        start = 0
        for mask, g in docs:
            tokens = torch.from_numpy(mask.astype(np.int64))[None]
            want, _ = fn(input_ids=torch.zeros_like(tokens), mm_token_type_ids=tokens,
                         image_grid_thw=torch.from_numpy(g) if g.size else None)  # fmt: skip
            assert np.array_equal(got[:, start : start + mask.size], want[:, 0].numpy())
            start += mask.size


def test_image_tokens_must_be_one_run_of_their_grid() -> None:
    grid = np.array([[1, 4, 4]])
    with pytest.raises(PackingError, match=r"runs of \[3\] but the grids give \[4\]"):
        mrope_ids(np.array([0, 1, 1, 1, 0], bool), np.zeros(5, int), grid, 2)
    with pytest.raises(PackingError, match="t = 1"):
        mrope_ids(np.ones(8, bool), np.zeros(8, int), np.array([[2, 4, 4]]), 2)

"""Tiny random Qwen2 / Qwen2.5-VL models (float64, CPU) and per-document references for the feeding tests.

The reference for a packed batch runs every document *alone*: its own tokens in a row of their own, with
nothing else in the input. ``aligned=False`` gives the document exactly its tokens (``[1, L]``, a 2-D mask of
ones so HF reads no packing into the position ids); ``aligned=True`` puts them at the columns they occupy in
the packed row, padding elsewhere, under a causal mask over those columns written here (a padding token sees
itself: HF's 2-D padding mask would leave left padding fully masked, a NaN in eager attention that spreads
through the next layer). Neither uses this library's masks. The aligned form exists for HF's eager
attention, whose softmax runs in float32 even for a float64 model
(``transformers/models/qwen2/modeling_qwen2.py:167`` and ``qwen2_5_vl/modeling_qwen2_5_vl.py:254``,
transformers 5.18): float32 sums of the same scores in the same columns round identically, in other columns
(a shorter row) they may not (about 1e-7).
"""

from __future__ import annotations

import random
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

__all__ = [
    "TINY_TEXT",
    "WORDS",
    "conversations",
    "document_logits",
    "hf_loss",
    "qwen2_5_vl_config",
    "randomize",
    "reference_loss",
    "tiny_qwen2",
    "tiny_qwen2_5_vl",
    "tiny_qwen2_config",
    "tiny_qwen3_vl",
]

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "small")


def conversations(n: int, *, seed: int = 0, longest: int = 12) -> list[dict[str, Any]]:
    """``n`` two-turn chats (``uuid``, ``messages``) of 2..``longest`` words per turn, seeded."""
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        user = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(2, longest)))
        answer = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(2, longest)))
        rows.append(
            {
                "uuid": f"chat-{i}",
                "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
            }
        )
    return rows


# Two layers, 4 heads (2 KV heads), hidden 32: a real decoder with grouped-query attention and RoPE.
TINY_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


def tiny_qwen2_config(vocab_size: int, **overrides: Any) -> Qwen2Config:
    """A `Qwen2Config` of `TINY_TEXT` size."""
    return Qwen2Config(vocab_size=vocab_size, **{**TINY_TEXT, **overrides})


def qwen2_5_vl_config(tokenizer: Any) -> dict[str, Any]:
    """A tiny Qwen2.5-VL ``config.json`` (dict) for the fixture processor's ``tokenizer``: `TINY_TEXT` with
    mRoPE sections ``[1, 1, 2]`` (head dim 8), a one-block vision tower, the tokenizer's image/video ids."""
    tokens = {key: tokenizer.convert_tokens_to_ids(token) for key, token in _VISION_TOKENS.items()}
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "text_config": {
            "model_type": "qwen2_5_vl_text",
            "vocab_size": len(tokenizer),
            "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [1, 1, 2]},
            **TINY_TEXT,
        },
        "vision_config": {
            "model_type": "qwen2_5_vl",
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": TINY_TEXT["hidden_size"],
            "fullatt_block_indexes": [0],
        },
        "tie_word_embeddings": False,
        **tokens,
    }


_VISION_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


def randomize(model: torch.nn.Module, *, seed: int = 0, std: float = 0.2) -> torch.nn.Module:
    """Redraw every weight from N(0, std) (seeded): sharper attention than the default init, so a token that
    sees another document changes its logits visibly."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * std)
    return model


def _vision_ids(tokenizer: Any) -> dict[str, int]:
    return {key: tokenizer.convert_tokens_to_ids(token) for key, token in _VISION_TOKENS.items()}


def tiny_qwen2_5_vl(tokenizer: Any, attn: str, *, seed: int = 0) -> torch.nn.Module:
    """A float64 Qwen2.5-VL (2 text layers, hidden 32, mRoPE sections [2, 3, 3]; a 2-block vision tower with
    window attention over 2x2 merged windows), seeded random weights (std 0.3: logits of about 8), eval."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 32,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    }
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_vision_ids(tokenizer))
    model = Qwen2_5_VLForConditionalGeneration._from_config(
        config, attn_implementation=attn, dtype=torch.float64
    )
    return randomize(model, seed=seed, std=0.3).eval()


def tiny_qwen3_vl(tokenizer: Any, attn: str, *, seed: int = 0) -> torch.nn.Module:
    """A float64 Qwen3-VL (3 text layers, interleaved mRoPE [4, 2, 2], a 3-block vision tower with deepstack
    features into layers 0 and 1, patch 16), seeded random weights (std 0.3), eval."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    }
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "pad_token_id": tokenizer.pad_token_id,
        "rope_parameters": rope,
    }
    vision = {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 32,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1],
    }
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **_vision_ids(tokenizer))
    model = Qwen3VLForConditionalGeneration._from_config(
        config, attn_implementation=attn, dtype=torch.float64
    )
    return randomize(model, seed=seed, std=0.3).eval()


def tiny_qwen2(attn: str, vocab_size: int, *, seed: int = 0, **overrides: Any) -> Qwen2ForCausalLM:
    """A float64 `Qwen2ForCausalLM` with ``attn_implementation=attn`` and seeded random weights (eval)."""
    config = tiny_qwen2_config(vocab_size, **overrides)
    model = Qwen2ForCausalLM._from_config(config, attn_implementation=attn, dtype=torch.float64)
    return randomize(model, seed=seed).eval()


def _documents(seq_ids: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``(row, columns)`` of every document of ``seq_ids`` ``[B, T]`` (-1 = padding), in id order."""
    out = []
    for doc in seq_ids[seq_ids >= 0].unique().tolist():
        rows, cols = torch.nonzero(seq_ids == doc, as_tuple=True)
        assert bool((rows == rows[0]).all()), "a document spans two rows"
        out.append((int(rows[0]), cols))
    return out


def document_logits(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    seq_ids: torch.Tensor,
    *,
    aligned: bool = False,
    media: Any = None,
) -> torch.Tensor:
    """Logits ``[B, T, V]`` (float64, 0 on padding) of every document of ``seq_ids`` run alone.

    Text: each document's ``input_ids`` and ``position_ids`` (a text batch's own, 1-D per document) from
    ``inputs``. ``media(row, cols)`` (VLMs) returns the document's extra kwargs and position ids instead:
    ``(kwargs, position_ids or None)``; a ``mm_token_type_ids`` ``[1, L]`` among them is placed at the
    document's columns when aligned.
    """
    ids = inputs["input_ids"]
    out = torch.zeros(*ids.shape, model.config.get_text_config().vocab_size, dtype=torch.float64)
    for row, cols in _documents(seq_ids):
        extra: dict[str, Any] = {}
        if media is not None:
            extra, positions = media(row, cols)
        else:
            positions = inputs["position_ids"][row, cols] if "position_ids" in inputs else None
        if aligned:
            length = ids.shape[-1]
            tokens = torch.zeros_like(ids[row])
            tokens[cols] = ids[row, cols]
            inside = torch.zeros(length, dtype=torch.bool)
            inside[cols] = True
            allowed = (inside[:, None] & inside[None, :]).tril() | torch.eye(length, dtype=torch.bool)
            mask = torch.zeros(1, 1, length, length, dtype=torch.float64)
            mask = mask.masked_fill(~allowed, torch.finfo(torch.float64).min)
            spread = {"position_ids": positions} if positions is not None else {}
            if "mm_token_type_ids" in extra:
                spread["mm_token_type_ids"] = extra["mm_token_type_ids"][0]
            for name, value in spread.items():
                full = torch.zeros(*value.shape[:-1], length, dtype=value.dtype)
                full[..., cols] = value
                spread[name] = full
            positions = spread.get("position_ids")
            if "mm_token_type_ids" in spread:
                extra = {**extra, "mm_token_type_ids": spread["mm_token_type_ids"][None]}
            where = cols
        else:
            tokens, mask, where = ids[row, cols], torch.ones_like(cols)[None], slice(None)
        kwargs = {"input_ids": tokens[None], "attention_mask": mask, "use_cache": False, **extra}
        if positions is not None:
            kwargs["position_ids"] = positions[..., None, :]
        with torch.no_grad():
            out[row, cols] = model(**kwargs).logits[0, where].double()
    return out


def hf_loss(logits: torch.Tensor, shift_labels: torch.Tensor, *, num_items: int | None = None) -> float:
    """HF's own causal-LM loss (float32, ``loss_utils.ForCausalLMLoss``) of ``logits`` ``[B, T, V]`` laid
    out like the packed batch: the packed loss must equal it exactly when the logits do."""
    items = None if num_items is None else torch.tensor(num_items)
    vocab = logits.shape[-1]
    return float(ForCausalLMLoss(logits, None, vocab, num_items_in_batch=items, shift_labels=shift_labels))


def reference_loss(logits: torch.Tensor, shift_labels: torch.Tensor) -> tuple[float, int]:
    """Mean float64 cross-entropy of ``logits`` ``[B, T, V]`` against already-shifted labels, and the count
    of supervised tokens (label != -100)."""
    flat = shift_labels.reshape(-1)
    total = torch.nn.functional.cross_entropy(
        logits.reshape(flat.numel(), -1), flat, ignore_index=-100, reduction="sum"
    )
    count = int((flat != -100).sum())
    return float(total) / count, count

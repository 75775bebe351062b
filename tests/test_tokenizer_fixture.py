"""The local chat tokenizer and Qwen2.5-VL processor fixtures: loadable, deterministic, template-correct."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from PIL import Image
from transformers import AutoTokenizer

from puzzletron.fixtures.tokenizer import (
    build_chat_tokenizer,
    build_qwen2_5_vl_processor,
    load_qwen2_5_vl_processor,
)

CONVERSATION = [
    {"role": "user", "content": "What is the total?"},
    {"role": "assistant", "content": "The total is 12."},
]


def _digest(directory: Path) -> str:
    return hashlib.sha256((directory / "tokenizer.json").read_bytes()).hexdigest()


def test_tokenizer_round_trips_through_autotokenizer(tmp_path: Path) -> None:
    assert build_chat_tokenizer(tmp_path / "tok") == tmp_path / "tok"
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert tok.pad_token == "<|endoftext|>"
    assert tok.eos_token == "<|im_end|>"
    text = "Any text, even ünïcode 🙂, encodes byte-level."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    for special in ("<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|vision_start|>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1


def test_tokenizer_build_is_deterministic(tmp_path: Path) -> None:
    build_chat_tokenizer(tmp_path / "a")
    build_chat_tokenizer(tmp_path / "b")
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")


def test_chat_template_renders_qwen_turns_and_marks_assistant_tokens(tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(build_chat_tokenizer(tmp_path / "tok"))
    rendered = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert rendered == (
        "<|im_start|>user\nWhat is the total?<|im_end|>\n<|im_start|>assistant\nThe total is 12.<|im_end|>\n"
    )
    out = tok.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    marked = [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tok.decode(marked) == "The total is 12.<|im_end|>"
    generation = tok.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=True)
    assert generation.endswith("<|im_start|>assistant\n")


def test_processor_expands_image_tokens_per_grid(tmp_path: Path) -> None:
    processor = load_qwen2_5_vl_processor(build_qwen2_5_vl_processor(tmp_path / "proc"))
    image = Image.new("RGB", (56, 112), (200, 10, 10))  # 56x112 -> grid 1x8x4 -> 32 patches, 8 tokens
    conversation = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "A red bar."}]},
    ]
    text = processor.apply_chat_template(conversation, tokenize=False)
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe<|im_end|>")
    out = processor(text=[text], images=[image], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 8, 4]]
    assert tuple(out["pixel_values"].shape) == (32, 3 * 2 * 14 * 14)
    assert int((out["input_ids"] == processor.image_token_id).sum()) == 32 // 4


def test_processor_refuses_videos(tmp_path: Path) -> None:
    processor = load_qwen2_5_vl_processor(build_qwen2_5_vl_processor(tmp_path / "proc"))
    with pytest.raises(NotImplementedError, match="video"):
        processor.video_processor([])


def test_loading_a_directory_without_the_processor_files_names_them(tmp_path: Path) -> None:
    build_chat_tokenizer(tmp_path / "tok")  # tokenizer only: no image-processor config
    with pytest.raises(FileNotFoundError, match=r"\(missing preprocessor_config\.json\)"):
        load_qwen2_5_vl_processor(tmp_path / "tok")

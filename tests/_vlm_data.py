"""Deterministic image conversations for the VLM store, pipeline and client tests, and a subset of them.

`vlm_samples(n)` mixes what a Nemotron-like subset holds: 0-4 images a sample (PNG and JPEG, sides from 20
to 180 px, so the fixture processors' pixel limits round both up and down), one to three user/assistant
turns, images before, between and after text, two images side by side in one turn, text-only samples, and
string content. `PLANTED` rows break a rule on purpose: a literal ``<|image_pad|>`` typed into a question and
an image with an aspect ratio over 200 (both skipped by the store, with their reasons).
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

from PIL import Image

from _conversation_samples import pil_image
from puzzletron.dataset import materialize_normalized_conversation_samples

__all__ = ["PLANTED", "WORDS", "image_sizes", "make_subset", "vlm_samples"]

WORDS = ("red", "blue", "chart", "table", "the", "value", "rises", "falls", "in", "2020", "of", "a", "plot")
PLANTED = {5: "image_placeholder_in_text", 11: "image_aspect_ratio"}


def _image(seed: int, size: tuple[int, int], jpeg: bool) -> Image.Image:
    image = pil_image(seed, size)
    if not jpeg:
        return image
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=85)
    # JPEG's values, but a PIL image with no file behind it: the subset stores it as a PNG (JPEG bytes, kept
    # as they are, are what tests of JPEG decoding pass: tests/pipelines/test_vlm.py::_jpeg_subset)
    return Image.open(io.BytesIO(buffer.getvalue()))


def _text(rnd: random.Random, longest: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(1, longest)))


def _sample(i: int, rnd: random.Random, longest: int) -> dict[str, Any]:
    images = rnd.choice((0, 1, 1, 2, 2, 3, 4))
    turns: list[dict[str, Any]] = []
    n_turns = rnd.randint(1, 3)
    left = images
    for t in range(n_turns):
        here = left if t == n_turns - 1 else rnd.randint(0, left)
        left -= here
        items: list[dict[str, Any]] = [{"type": "text", "text": _text(rnd, longest)}]
        for k in range(here):
            size = (rnd.randint(20, 180), rnd.randint(20, 180))
            item = {"type": "image", "image": _image(i * 10 + k + 100 * t, size, jpeg=rnd.random() < 0.5)}
            items.insert(rnd.randint(0, len(items)), item)  # before, between or after the text
        turns.append({"role": "user", "content": items})
        answer = [{"type": "text", "text": _text(rnd, longest)}]
        turns.append({"role": "assistant", "content": answer})
    if i == 5:
        turns[0] = {"role": "user", "content": [{"type": "text", "text": "what is <|image_pad|> here?"}]}
    if i == 11:
        wide = {"type": "image", "image": _image(i, (450, 2), jpeg=False)}
        turns[0] = {"role": "user", "content": [wide, {"type": "text", "text": "a thin line"}]}
    count = sum(1 for turn in turns for c in turn["content"] if c["type"] == "image")
    return {
        "conversation": turns,
        "image_count": count,
        "source": {"dataset": "fixture/vlm", "revision": "r1", "row_id": f"row{i}"},
    }


def vlm_samples(n: int, *, seed: int = 0, longest: int = 12) -> list[dict[str, Any]]:
    """``n`` normalised samples (see the module docstring), seeded."""
    rnd = random.Random(seed)
    return [_sample(i, rnd, longest) for i in range(n)]


def make_subset(out: Path, n: int, *, seed: int = 0, longest: int = 12) -> Path:
    """`vlm_samples` materialised as a conversation subset at `out`."""
    materialize_normalized_conversation_samples(iter(vlm_samples(n, seed=seed, longest=longest)), out)
    return out


def image_sizes(sample: dict[str, Any]) -> list[tuple[int, int]]:
    """``(width, height)`` of a sample's images as read back from a subset (absolute paths)."""
    return [
        Image.open(item["image"]).size
        for turn in sample["conversation"]
        if isinstance(turn["content"], list)
        for item in turn["content"]
        if item["type"] == "image"
    ]

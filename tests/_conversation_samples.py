"""Deterministic real images and source rows shared by the conversation / subset / factory tests."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

from puzzletron.dataset.conversation import normalize_intersyn_multi, normalize_intersyn_single

__all__ = [
    "MULTI",
    "SINGLE",
    "jpeg_bytes",
    "multi_row",
    "nemotron_row",
    "pil_image",
    "png_bytes",
    "single_row",
    "single_samples",
]

# The (dataset, revision) the InterSyn normalisers stamp on `single_samples` / `multi_samples`, written out.
SINGLE = ("finyorko/single_turn", "59acf6773cd2bf5b485f37296e862216aa99516b")
MULTI = ("finyorko/multi-turn", "728987eff962e9df6f3da5ad5824a4accdd62bd2")


def pil_image(seed: int, size: tuple[int, int] = (32, 24)) -> Image.Image:
    """A photo-like RGB image: a smooth gradient plus seeded noise."""
    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), np.full((h, w), seed * 37 % 256)], -1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def jpeg_bytes(seed: int, size: tuple[int, int] = (32, 24)) -> bytes:
    buffer = io.BytesIO()
    pil_image(seed, size).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def png_bytes(seed: int, size: tuple[int, int] = (32, 24)) -> bytes:
    buffer = io.BytesIO()
    pil_image(seed, size).save(buffer, format="PNG")
    return buffer.getvalue()


def single_row(i: int, **overrides: Any) -> dict[str, Any]:
    row = {
        "id": f"s{i}",
        "topic": "nature",
        "human": f"  What is in picture {i}?  ",
        "gpt": f"Answer {i}.",
        "caption": f"caption {i}",
        "image": {"bytes": jpeg_bytes(i), "path": None},
    }
    row.update(overrides)
    return row


def multi_row(i: int, groups: int = 2, **overrides: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"id": f"m{i}", "topic": "art"}
    for g in range(1, 6):
        used = g <= groups
        row[f"human{g}"] = f"q{g}" if used else None
        row[f"gpt{g}"] = f"a{g}" if used else None
        row[f"caption{g}"] = f"c{g}" if used else None
        row[f"image{g}"] = {"bytes": png_bytes(100 * i + g), "path": None} if used else None
    row.update(overrides)
    return row


def nemotron_row(i: int, **overrides: Any) -> dict[str, Any]:
    row = {
        "id": f"n{i}",
        "messages": [
            {"role": "system", "content": ""},
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": f"{i}.png", "metadata": {"width": 32, "height": 24}},
                    {"type": "text", "text": "Read the table."},
                ],
            },
            {"role": "assistant", "content": "<think>ok</think> 42"},
        ],
        "image": {"bytes": png_bytes(1000 + i), "path": f"{i}.png"},
    }
    row.update(overrides)
    return row


def single_samples(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [normalize_intersyn_single(single_row(i)) for i in range(start, start + n)]


def multi_samples(n: int) -> list[dict[str, Any]]:
    return [normalize_intersyn_multi(multi_row(i)) for i in range(n)]

"""The parts of a Qwen2-VL-family processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) the VLM path uses, and the
image grid its image processor gives an image, computed from the image's size alone.

`vlm_processor(processor)` takes an HF processor object (``Qwen2_5_VLProcessor``, ``Qwen3VLProcessor`` ...)
or a local processor directory (``tokenizer.json``, ``preprocessor_config.json``, a chat template) and
returns a `VlmProcessor`: the tokenizer (rendering with the *processor's* chat template, as
``processor.apply_chat_template`` does), the image processor, the image token and the `GridConfig`. Nothing
here needs torchvision: a directory's image processor loads through ``AutoImageProcessor`` (the PIL backend
when torchvision is missing) and no video processor is built.

`GridConfig.grids` is the image processor's ``smart_resize`` + patchify, vectorised::

    grid (t, h, w) = (1, H' / patch, W' / patch)      tokens = t * h * w / merge**2

where ``(H', W')`` is ``(height, width)`` rounded to multiples of ``patch * merge`` and scaled into
``[min_pixels, max_pixels]`` (the image processor's ``size["shortest_edge"]`` / ``size["longest_edge"]``).
An image with an aspect ratio over 200 is refused by the processor; `grids` marks it instead.

A processor of another family is a `ConfigError` naming what is missing.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import ConfigError

__all__ = [
    "IMAGE_TOKEN",
    "PROCESSOR_FILE",
    "VIDEO_TOKEN",
    "GridConfig",
    "VlmProcessor",
    "vlm_processor",
]

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
MAX_ASPECT = 200  # the image processor refuses max(h, w) / min(h, w) above this
# The files of a processor directory its tokens and pixels depend on (besides the tokenizer's).
PROCESSOR_FILE = re.compile(
    r"preprocessor_config\.json|processor_config\.json|image_processor.*\.json|chat_template.*"
)
_PROCESSORS: dict[str, VlmProcessor] = {}  # per-process cache: directory -> parts (workers load once)


@dataclass(frozen=True)
class GridConfig:
    """What the image grid depends on: ``patch_size``, ``merge_size``, ``temporal_patch_size`` and the
    pixel budget ``[min_pixels, max_pixels]`` (the image processor's ``size``)."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int

    def grids(self, widths: np.ndarray, heights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(grid int64 [m, 3], refused bool [m])`` of images of ``widths`` / ``heights`` ``[m]``: exactly
        the image processor's ``image_grid_thw`` (``smart_resize``: Python's round-half-even, float64);
        ``refused`` marks aspect ratios over 200, which the processor rejects (their grid is meaningless).

        >>> g = GridConfig(14, 2, 2, 56 * 56, 448 * 448)
        >>> g.grids(np.array([56, 640]), np.array([56, 480]))[0].tolist()  # 640x480 is over max_pixels
        [[1, 4, 4], [1, 26, 36]]
        """
        w = np.asarray(widths, dtype=np.float64)
        h = np.asarray(heights, dtype=np.float64)
        factor = self.patch_size * self.merge_size
        small = np.maximum(np.minimum(w, h), 1.0)
        refused = (np.minimum(w, h) <= 0) | (np.maximum(w, h) / small > MAX_ASPECT)
        h_bar = np.round(h / factor) * factor  # numpy rounds half to even, like Python's round
        w_bar = np.round(w / factor) * factor
        area = np.maximum(h * w, 1.0)
        over = h_bar * w_bar > self.max_pixels
        under = ~over & (h_bar * w_bar < self.min_pixels)
        beta = np.sqrt(area / self.max_pixels)
        h_over = np.maximum(factor, np.floor(h / beta / factor) * factor)
        w_over = np.maximum(factor, np.floor(w / beta / factor) * factor)
        beta = np.sqrt(self.min_pixels / area)
        h_under = np.ceil(h * beta / factor) * factor
        w_under = np.ceil(w * beta / factor) * factor
        h_bar = np.where(over, h_over, np.where(under, h_under, h_bar))
        w_bar = np.where(over, w_over, np.where(under, w_under, w_bar))
        grid = np.stack(
            [np.ones_like(h_bar), h_bar // self.patch_size, w_bar // self.patch_size], axis=-1
        ).astype(np.int64)
        grid[refused] = 0
        return grid.reshape(-1, 3), refused.reshape(-1)

    def tokens(self, grid: np.ndarray) -> np.ndarray:
        """``[m]`` tokens each image of ``grid`` ``[m, 3]`` becomes: ``t * h * w / merge**2``."""
        grid = np.asarray(grid, dtype=np.int64).reshape(-1, 3)
        return grid.prod(axis=1) // self.merge_size**2

    def facts(self) -> dict[str, int]:
        return {
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
        }


@dataclass(frozen=True, eq=False)
class VlmProcessor:
    """A processor's parts: ``tokenizer`` (its ``chat_template`` is the processor's), ``image_processor``,
    ``grid``, ``image_token`` and its id, and ``name`` (the processor's class, for messages)."""

    tokenizer: Any
    image_processor: Any
    grid: GridConfig
    image_token_id: int
    name: str
    image_token: str = IMAGE_TOKEN

    def pixels(self, images: list[Any], grid: np.ndarray, *, dtype: Any = None) -> tuple[Any, Any, bool]:
        """``(pixel_values [patches, C*T*P*P] in dtype, image_grid_thw int64 [m, 3], computed)`` of RGB PIL
        ``images`` whose grids (from their sizes) are ``grid``: what the image processor gives, cast to
        ``dtype`` (default float32). A plain ``Qwen2VLImageProcessorPil`` is computed here bit for bit
        (`puzzletron.dataset.tokenize._pixels`, ``computed`` True: the grid is ``grid``); any other runs
        itself, one call for all images (``computed`` False: its own grid, for the caller to check)."""
        import torch

        from puzzletron.dataset.tokenize._pixels import fast_pixels

        dtype = torch.float32 if dtype is None else dtype
        g = self.grid
        fast = fast_pixels(
            self.image_processor, images, grid, patch_size=g.patch_size, merge_size=g.merge_size,
            temporal_patch_size=g.temporal_patch_size, dtype=dtype,
        )  # fmt: skip
        if fast is not None:
            return fast, torch.as_tensor(np.asarray(grid, dtype=np.int64).reshape(-1, 3)), True
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"].to(dtype), out["image_grid_thw"], False


def _grid_config(image_processor: Any, name: str) -> GridConfig:
    """The grid facts of a Qwen2-VL-family image processor; `ConfigError` naming what is missing."""
    kind = type(image_processor).__name__
    size = getattr(image_processor, "size", None)
    get = (lambda k: size.get(k) if hasattr(size, "get") else getattr(size, k, None)) if size else None
    facts = {
        "patch_size": getattr(image_processor, "patch_size", None),
        "merge_size": getattr(image_processor, "merge_size", None),
        "temporal_patch_size": getattr(image_processor, "temporal_patch_size", None),
        "min_pixels": get("shortest_edge") if get else None,
        "max_pixels": get("longest_edge") if get else None,
    }
    missing = [k for k, v in facts.items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0]
    if not kind.startswith("Qwen2VLImageProcessor") or missing:
        raise ConfigError(
            f"processor {name} is not supported: the VLM path needs a Qwen2-VL-family image processor "
            "(Qwen2VLImageProcessor*, as Qwen2-VL, Qwen2.5-VL and Qwen3-VL use) with patch_size, "
            f"merge_size, temporal_patch_size and size{{shortest_edge, longest_edge}}; got {kind}"
            + (f" without {', '.join(missing)}" if missing else "")
        )
    return GridConfig(**{k: int(v) for k, v in facts.items()})


def _parts(tokenizer: Any, image_processor: Any, template: str | None, name: str) -> VlmProcessor:
    if tokenizer is None or image_processor is None:
        what = "tokenizer" if tokenizer is None else "image processor"
        raise ConfigError(f"processor {name} is not supported: it has no {what} (tokenizer, image_processor)")
    grid = _grid_config(image_processor, name)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if not isinstance(image_id, int) or image_id == tokenizer.unk_token_id or image_id < 0:
        raise ConfigError(f"processor {name} is not supported: its tokenizer has no {IMAGE_TOKEN} token")
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError(f"processor {name} has no chat template (chat_template.jinja or the tokenizer's)")
    if getattr(tokenizer, "chat_template", None) != template:
        tokenizer = copy.copy(tokenizer)  # render with the processor's template, leave the caller's alone
        tokenizer.chat_template = template
    return VlmProcessor(tokenizer, image_processor, grid, int(image_id), name)


def _directory_template(root: Path) -> str | None:
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    if (root / "chat_template.json").is_file():
        return json.loads((root / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    return None


def vlm_processor(processor: str | Path | Any) -> VlmProcessor:
    """The `VlmProcessor` of an HF processor object or a local processor directory (cached per process);
    a `VlmProcessor` as it is. `ConfigError` for an unsupported processor, naming what is missing."""
    if isinstance(processor, VlmProcessor):
        return processor
    if not isinstance(processor, str | Path):
        name = type(processor).__name__
        if not hasattr(processor, "image_processor") and hasattr(processor, "convert_tokens_to_ids"):
            raise ConfigError(
                f"processor {name} is a tokenizer, not a processor (no image processor): give the processor "
                "folder, or the HF processor object load_hf_processor(folder) builds (tokenize.hf_processor)"
            )
        tokenizer = getattr(processor, "tokenizer", None)
        image_processor = getattr(processor, "image_processor", None)
        return _parts(tokenizer, image_processor, getattr(processor, "chat_template", None), name)
    root = Path(processor)
    if not root.is_dir():
        raise ConfigError(f"processor {root} is not a directory (give a local processor directory)")
    key = str(root.resolve())
    if key not in _PROCESSORS:
        if not (root / "preprocessor_config.json").is_file():
            raise ConfigError(
                f"processor {root} is not supported: no preprocessor_config.json (the image processor)"
            )
        from transformers import AutoImageProcessor, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(key)
        image_processor = AutoImageProcessor.from_pretrained(key)
        _PROCESSORS[key] = _parts(tokenizer, image_processor, _directory_template(root), str(root))
    return _PROCESSORS[key]

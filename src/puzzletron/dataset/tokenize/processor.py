"""The parts of a Qwen2-VL-family processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) the VLM path uses, and the
settings the image grid depends on (`tokenize.grid`).

`vlm_processor(processor)` takes an HF processor object (``Qwen2_5_VLProcessor``, ``Qwen3VLProcessor`` ...)
or a local processor directory (``tokenizer.json``, ``preprocessor_config.json``, a chat template) and
returns a `VlmProcessor`: the tokenizer (rendering with the *processor's* chat template, as
``processor.apply_chat_template`` does), the image processor, the image token and the `GridConfig`. Nothing
here needs torchvision: a directory's image processor loads through ``AutoImageProcessor`` (the PIL backend
when torchvision is missing) and no video processor is built.

The image grid an image's size gives is `tokenize.grid.GridConfig` (re-exported here).

A processor of another family is a `ConfigError` naming what is missing.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.formats.vlm_store.settings import PIXEL_KEYS, pixel_problems
from puzzletron.dataset.tokenize._content import PROCESSOR_FILE, check_template, content_key, load_directory
from puzzletron.dataset.tokenize.grid import GridConfig

__all__ = [
    "IMAGE_TOKEN",
    "MAX_GRID",
    "PROCESSOR_FILE",
    "VIDEO_TOKEN",
    "GridConfig",
    "VlmProcessor",
    "pixel_settings",
    "vlm_processor",
]

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
# Grid facts past these are refused at load: a patch of 4096 pixels square makes one image's pixel values
# tens of GiB (Qwen2-VL family: patch 14 or 16, merge 2, temporal 2, at most ~16M pixels an image).
MAX_GRID = {
    "patch_size": 64,
    "merge_size": 8,
    "temporal_patch_size": 8,
    "min_pixels": 2**26,
    "max_pixels": 2**26,
}
# Per-process cache: the content of a directory's files (`_content.content_key`) -> its parts (workers load
# once); never keyed by the path, so a directory edited between two builds is loaded again.
_PROCESSORS: dict[str, VlmProcessor] = {}


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
    settings: Mapping[str, Any] = field(default_factory=dict)  # the pixel settings (`pixel_settings`)

    def facts(self) -> dict[str, Any]:
        """What a VLM store records of its processor (its manifest's ``processor``)."""
        return {
            "image_processor": type(self.image_processor).__name__,
            "image_token": self.image_token,
            "image_token_id": self.image_token_id,
            **self.grid.facts(),
            "pixels": dict(self.settings),
        }

    def differences(self, recorded: Mapping[str, Any]) -> list[str]:
        """``"key: store X vs processor Y"`` for every fact the store's tokens, grids and pixels depend on
        that differs from `recorded` (a VLM store's ``processor``)."""
        ours = _flat(self.facts())
        theirs = _flat(recorded)
        return [
            f"{k}: store {theirs.get(k)!r} vs processor {ours.get(k)!r}"
            for k in sorted(set(ours) | set(theirs))
            if theirs.get(k) != ours.get(k)
        ]

    def pixels(self, images: list[Any], grid: np.ndarray, *, dtype: Any = None) -> tuple[Any, Any, bool]:
        """``(pixel_values [patches, C*T*P*P] in dtype, image_grid_thw int64 [m, 3], computed)`` of RGB PIL
        ``images`` whose grids (from their sizes) are ``grid``: what the image processor gives, cast to
        ``dtype`` (default float32; ``torch.uint8``: the resized values before rescale and normalise). A
        plain ``Qwen2VLImageProcessorPil`` is computed here bit for bit (`tokenize._pixels`,
        ``computed`` True: the grid is ``grid``); any other runs itself, one call for all images
        (``computed`` False: its own grid, for the caller to check)."""
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
        raw = {"do_rescale": False, "do_normalize": False} if dtype == torch.uint8 else {}
        out = self.image_processor(images=images, return_tensors="pt", **raw)
        pixels = out["pixel_values"]
        if raw and not torch.equal(pixels, pixels.round().clamp(0, 255)):
            raise ConfigError(
                f"{self.name}: its resized pixels are not uint8 values; use a float pixel_dtype"
            )
        return pixels.to(dtype), out["image_grid_thw"], False

    def check_device_resize(self) -> None:
        """`ConfigError` unless this processor's resize is one the device reproduces bit for bit (a plain
        ``Qwen2VLImageProcessorPil``; `tokenize._resize`): what ``device_resize=True`` needs."""
        from puzzletron.dataset.tokenize._pixels import resizes_exactly

        if not resizes_exactly(self.image_processor):
            raise ConfigError(
                f"{self.name}: device_resize needs a Qwen2VLImageProcessorPil that resizes (bicubic), "
                f"rescales and normalises, whose resize the device reproduces exactly; this image processor "
                f"is {type(self.image_processor).__name__}: leave device_resize off"
            )

    def decoded(self, images: list[Any], grid: np.ndarray) -> list[Any]:
        """The decoded-image transport's ``pixel_values`` of RGB PIL ``images`` whose grids are ``grid``:
        uint8 ``[H, W, 3]`` tensors, each at its own or its target size (`tokenize._pixels.decoded_pixels`),
        resized and normalised after ``.to(device)`` by `tokenize._pixels.normalized_pixels`."""
        from puzzletron.dataset.tokenize._pixels import decoded_pixels

        self.check_device_resize()
        return decoded_pixels(images, grid, self.grid)


def _flat(facts: Mapping[str, Any]) -> dict[str, Any]:
    pixels = facts.get("pixels")
    out = {k: v for k, v in facts.items() if k != "pixels"}
    return out | {f"pixels.{k}": v for k, v in (pixels.items() if isinstance(pixels, Mapping) else ())}


def _channels(value: Any) -> Any:
    """``image_mean`` / ``image_std`` as 3 floats (a single number is every channel's), else as given."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return [float(value)] * 3
    if isinstance(value, list | tuple) and all(isinstance(v, int | float) for v in value):
        return [float(v) for v in value]
    return value


def pixel_settings(image_processor: Any, name: str) -> dict[str, Any]:
    """The settings the pixels of `image_processor` depend on besides its grid
    (`formats.vlm_store.settings.PIXEL_KEYS`), JSON-ready; a `ConfigError` naming the first unsound one (a
    NaN ``image_mean``, a zero or negative ``image_std``, two values where there are three channels ...)."""
    raw = {k: getattr(image_processor, k, None) for k in PIXEL_KEYS}
    raw["resample"] = int(raw["resample"]) if isinstance(raw["resample"], int) else raw["resample"]
    factor = raw["rescale_factor"]
    raw["rescale_factor"] = float(factor) if isinstance(factor, int | float) else factor
    raw["image_mean"], raw["image_std"] = _channels(raw["image_mean"]), _channels(raw["image_std"])
    problems = pixel_problems(raw)
    if problems:
        raise ConfigError(
            f"processor {name}: {problems[0]} (preprocessor_config.json); its pixels would be wrong or not "
            "finite"
        )
    return raw


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
    over = [f"{k} {facts[k]} (at most {bound})" for k, bound in MAX_GRID.items() if facts[k] > bound]
    if facts["min_pixels"] > facts["max_pixels"]:
        over.append(f"min_pixels {facts['min_pixels']} (at most max_pixels {facts['max_pixels']})")
    if over:
        raise ConfigError(
            f"processor {name}: {', '.join(over)} (preprocessor_config.json); its pixel values would not fit "
            "in memory"
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
    check_template(template, f"processor {name}")
    if getattr(tokenizer, "chat_template", None) != template:
        tokenizer = copy.copy(tokenizer)  # render with the processor's template, leave the caller's alone
        tokenizer.chat_template = template
    settings = pixel_settings(image_processor, name)
    return VlmProcessor(tokenizer, image_processor, grid, int(image_id), name, settings=settings)


def _directory_template(root: str | Path) -> str | None:
    root = Path(root)
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    if (root / "chat_template.json").is_file():
        raw = json.loads((root / "chat_template.json").read_text(encoding="utf-8"))
        return raw.get("chat_template") if isinstance(raw, dict) else raw
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
    if not (root / "preprocessor_config.json").is_file():
        raise ConfigError(
            f"processor {root} is not supported: no preprocessor_config.json (the image processor)"
        )
    key = content_key(root.resolve(), processor=True)
    if key not in _PROCESSORS:
        from transformers import AutoImageProcessor, AutoTokenizer

        tokenizer = load_directory(AutoTokenizer.from_pretrained, root.resolve(), "processor")
        image_processor = load_directory(AutoImageProcessor.from_pretrained, root.resolve(), "processor")
        template = load_directory(_directory_template, root, "processor")
        _PROCESSORS[key] = _parts(tokenizer, image_processor, template, str(root))
    return _PROCESSORS[key]

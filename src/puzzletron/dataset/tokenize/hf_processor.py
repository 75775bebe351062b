"""transformers' own processor object of a Qwen2-VL-family folder, on the stack this project installs.

`load_hf_processor(directory)` returns a ``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor`` or
``Qwen3VLProcessor`` (transformers' classes: ``processor(text=..., images=...)``,
``apply_chat_template``, ``.tokenizer``, ``.image_processor``), the "HF processor object" that
`build_vlm_batches`, `build_vlm_store` and the AutoModel VLM factory accept as ``processor=``. Why not
transformers' loaders: ``AutoProcessor.from_pretrained`` of a folder that names no processor class returns
its tokenizer, and ``Qwen2_5_VLProcessor.from_pretrained`` builds the torchvision video processor, whose
registry wheel needs CUDA libraries (it does not import beside a CPU torch). So the processor is assembled
from its parts: the folder's tokenizer and chat template, the PIL image processor
(``Qwen2VLImageProcessorPil`` with the folder's ``preprocessor_config.json``: the processor this library's
bit-exact pixel path reproduces) and, in the video slot the class requires, a video processor that refuses
videos (the library's batches carry images only; no torchvision needed).

The class: the ``processor_class`` the folder names (``processor_config.json``, ``preprocessor_config.json``
or ``tokenizer_config.json``, as ``save_pretrained`` writes it), else its ``config.json`` ``model_type``,
else by the image processor's patch: 16 is Qwen3-VL's, otherwise Qwen2.5-VL (Qwen2-VL's images are
processed the same way).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import ConfigError

__all__ = ["PROCESSOR_CLASSES", "load_hf_processor"]

PROCESSOR_CLASSES = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor")
_MODEL_TYPES = dict(zip(("qwen2_vl", "qwen2_5_vl", "qwen3_vl"), PROCESSOR_CLASSES, strict=True))


def _json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot be read as JSON ({exc})") from None
    return loaded if isinstance(loaded, dict) else {}


def _class_name(root: Path, image_config: dict[str, Any]) -> str:
    """The processor class of the folder `root` (the module docstring's order)."""
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        named = _json(root / name).get("processor_class")
        if named:
            return str(named)
    model_type = _json(root / "config.json").get("model_type")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    return "Qwen3VLProcessor" if image_config.get("patch_size") == 16 else "Qwen2_5_VLProcessor"


@functools.cache
def _images_only_class() -> type:
    """The video processor that refuses videos (made on first use: it subclasses a transformers class)."""
    from transformers import BaseVideoProcessor

    class _ImagesOnlyVideoProcessor(BaseVideoProcessor):  # without torchvision its __init__ would raise
        def __init__(self, image_processor: Any) -> None:  # the sizes the processor classes read of one
            for name in ("merge_size", "patch_size", "temporal_patch_size"):
                setattr(self, name, getattr(image_processor, name))
            self.model_input_names = ["pixel_values_videos", "video_grid_thw"]

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise ConfigError("load_hf_processor: this processor takes images and text only, no videos")

        preprocess = __call__

    _ImagesOnlyVideoProcessor.__module__ = __name__  # pickled by name (DataLoader workers): `__getattr__`
    _ImagesOnlyVideoProcessor.__qualname__ = "_ImagesOnlyVideoProcessor"
    return _ImagesOnlyVideoProcessor


def __getattr__(name: str) -> Any:
    if name == "_ImagesOnlyVideoProcessor":
        return _images_only_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_hf_processor(directory: str | Path) -> Any:
    """transformers' Qwen2-VL-family processor of the local folder `directory` (see the module docstring),
    with the PIL image processor and no torchvision; `ConfigError` for a folder that is not one (no
    ``preprocessor_config.json``, another processor class)."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    root = Path(directory)
    config = _json(root / "preprocessor_config.json")
    if not config:
        raise ConfigError(f"{root}: no preprocessor_config.json: not a processor folder")
    name = _class_name(root, config)
    if name not in PROCESSOR_CLASSES:
        raise ConfigError(
            f"{root}: processor class {name!r}; load_hf_processor builds {', '.join(PROCESSOR_CLASSES)}"
        )
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(root))
    tokenizer = AutoTokenizer.from_pretrained(str(root))
    template = root / "chat_template.jinja"
    return getattr(transformers, name)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=_images_only_class()(image_processor),
        chat_template=template.read_text(encoding="utf-8") if template.is_file() else None,
    )

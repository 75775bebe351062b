"""Hugging Face models as this library meets them: what a model's own config says about how to feed it, and
importing transformers' model and Trainer classes without their dependencies' import-time noise.

`model_backend` and `model_dtype`: the attention backend its text layers run, and its dtype.
`model_inputs` (``model=``) and the Trainer's collator read them instead of trusting the caller's
``backend=`` / ``dtype=``: a bool mask handed to eager attention is *added* to its scores, a float mask of
another dtype is misread by torch's CPU SDPA, both silently.

`quiet_imports`: while transformers imports its optional quantizers (with the Trainer, or a model class),
torchao (a NeMo AutoModel dependency) warns about CUDA kernels it cannot load on this machine and torch
about torchao's pytree registrations. Neither concerns this library; the loggers are silenced only for
that import, their other and later messages are untouched.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from puzzletron.dataset.errors import ConfigError

__all__ = ["model_backend", "model_dtype", "quiet_imports"]

_IMPORT_NOISE = ("torchao", "torch.utils._pytree")  # loggers that warn while transformers imports torchao

# HF `config._attn_implementation` -> the backend name of `forward_kwargs` (flash kernels from the Hub,
# "kernels-community/flash-attn*", are matched by name below).
_HF_ATTENTION = {
    "sdpa": "sdpa",
    "eager": "eager",
    "flash_attention_2": "flash",
    "flash_attention_3": "flash",
}


def model_backend(model: Any) -> str:
    """The `forward_kwargs` backend of ``model``'s text layers (``config.get_text_config()
    ._attn_implementation``): ``"sdpa"``, ``"eager"`` or ``"flash"``; `ConfigError` for anything else."""
    config = getattr(model, "config", None)
    if config is None:
        raise ConfigError(f"model_inputs(model=...): {type(model).__name__} has no HF config")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = getattr(text, "_attn_implementation", None) or "eager"
    backend = _HF_ATTENTION.get(name, "flash" if "flash" in str(name) else None)
    if backend is None:
        raise ConfigError(
            f"model_inputs: the model's text layers run attention {name!r}; packed batches are fed to sdpa, "
            "eager and flash attention (set attn_implementation to one of them)"
        )
    return backend


def model_dtype(model: Any) -> torch.dtype:
    """``model.dtype`` (HF models), else the dtype of its first floating parameter."""
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    raise ConfigError(f"model_inputs(model=...): {type(model).__name__} has no floating parameter")


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """While open, the loggers of `_IMPORT_NOISE` report only errors; their levels are restored after."""
    loggers = [logging.getLogger(name) for name in _IMPORT_NOISE]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)

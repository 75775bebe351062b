"""The value rules of `PuzzletronBatch` on floating model inputs (``docs/batch-contract.md``, "Validation").

NaN is never a meaningful model input, and Inf is not one in embeddings or positions either (an additive
attention mask holds -inf, so other floating kwargs may hold Inf). Each rule is a lazy 0-d bool tensor for
`_validation`'s one host sync: one ``aminmax`` pass (min and max propagate NaN), no temporary of the
tensor's size. Pixels are exempt: a pass over 64 MB of them costs more than every other rule together, and
the data stage computes them from a checked processor (`tokenize.processor.pixel_settings`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["FINITE_KWARGS", "PIXEL_KWARGS", "float_rules"]

PIXEL_KWARGS = frozenset({"pixel_values", "pixel_values_videos"})
FINITE_KWARGS = frozenset({"inputs_embeds", "position_ids"})  # floats that must be finite, not only NaN-free


def _aminmax(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of `t` (NaN when it holds one); float8, which has no ``aminmax``, through float32."""
    return torch.aminmax(t if t.element_size() > 1 else t.to(torch.float32))


def _finite(t: torch.Tensor) -> torch.Tensor:
    """0-d: no NaN or Inf in `t`; one pass, no temporary of its size (min and max propagate NaN)."""
    low, high = _aminmax(t)
    return torch.isfinite(low) & torch.isfinite(high)


def _no_nan(t: torch.Tensor) -> torch.Tensor:
    low, high = _aminmax(t)
    return ~(low.isnan() | high.isnan())


def float_rules(kwargs: Mapping[str, Any], add: Callable[[Callable[[], torch.Tensor], str], None]) -> None:
    """NaN is never a meaningful model input; Inf is not one either in embeddings or positions (an additive
    attention mask holds -inf). Pixels are exempt: a pass over them costs more than every other rule
    together, and the data stage computes them from a checked processor (``docs/batch-contract.md``)."""
    for key, t in kwargs.items():
        if (
            not isinstance(t, torch.Tensor)
            or not t.is_floating_point()
            or not t.numel()
            or key in PIXEL_KWARGS
        ):
            continue
        if key in FINITE_KWARGS:
            add(lambda t=t: _finite(t), f"model_kwargs[{key!r}] must be finite (no NaN or Inf)")
        else:
            add(lambda t=t: _no_nan(t), f"model_kwargs[{key!r}] must hold no NaN")

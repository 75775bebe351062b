"""The image processor settings a VLM store records (``processor.pixels``, ``docs/vlm-store-format.md``):
everything a batch's ``pixel_values`` depend on besides the grid facts, so batches built with another
processor than the store's are refused rather than served with other pixels (``docs/trust-model.md``).

`pixel_problems` says what is wrong with a settings mapping: the same rules when a processor is loaded (a
`ConfigError` at tokenize time: a NaN ``image_mean`` or a zero ``image_std`` would give NaN or Inf pixels)
and when a manifest is read (a `SnapshotError`).

>>> pixel_problems({**EXAMPLE, "image_std": [0.5, 0.0, 0.5]})
['image_std is [0.5, 0.0, 0.5]; expected 3 finite numbers above 0']
>>> pixel_problems(EXAMPLE)
[]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["EXAMPLE", "PIXEL_FLAGS", "PIXEL_KEYS", "pixel_problems"]

PIXEL_FLAGS = ("do_convert_rgb", "do_normalize", "do_rescale", "do_resize")
PIXEL_KEYS = (*PIXEL_FLAGS, "image_mean", "image_std", "resample", "rescale_factor")
EXAMPLE = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3, "rescale_factor": 1 / 255,
}  # fmt: skip


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def pixel_problems(settings: Any) -> list[str]:
    """What is wrong with `settings` (``{key: value}`` of `PIXEL_KEYS`), one phrase each; empty when sound:
    flags are booleans, ``resample`` a PIL filter (0..5), ``rescale_factor`` a finite number above 0,
    ``image_mean`` 3 finite numbers and ``image_std`` 3 finite numbers above 0 (one per RGB channel)."""
    if not isinstance(settings, Mapping) or set(settings) != set(PIXEL_KEYS):
        return [f"the pixel settings are {settings!r:.120}; expected the keys {list(PIXEL_KEYS)}"]
    out = [
        f"{k} is {settings[k]!r:.40}; expected true or false"
        for k in PIXEL_FLAGS
        if type(settings[k]) is not bool
    ]
    resample = settings["resample"]
    if type(resample) is not int or not 0 <= resample <= 5:
        out.append(f"resample is {resample!r:.40}; expected a PIL resampling filter 0..5")
    factor = settings["rescale_factor"]
    if not _number(factor) or factor <= 0:
        out.append(f"rescale_factor is {factor!r:.40}; expected a finite number above 0")
    for key, low in (("image_mean", None), ("image_std", 0.0)):
        value = settings[key]
        sound = isinstance(value, list | tuple) and len(value) == 3 and all(_number(v) for v in value)
        if not sound or (low is not None and min(value) <= low):
            what = "3 finite numbers" + (" above 0" if low is not None else "")
            out.append(f"{key} is {value!r:.60}; expected {what}")
    return out

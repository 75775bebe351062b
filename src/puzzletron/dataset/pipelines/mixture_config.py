"""The YAML form of a mixture: a ``data.mixture:`` block beside the data spec's keys (``docs/mixtures.md``).

`read_mixture` is the one function that reads it; `mixture_batches` is a Hydra ``_target_`` that reads a
whole ``data:`` block and calls `build_mixture_batches`::

    data:
      modality: multimodal
      layout: packed_varlen
      max_sample_length: 4096
      packing: {pack_size: 4096}
      mixture:
        vlm:  {path: subsets/vlm, weight: 0.7}          # a store, snapshot or subset; weight: share of tokens
        text: {path: snapshots/puzzle-kd, weight: 0.3}
        num_tokens: 1000000000                            # optional: the epoch's real tokens

or, with shares that change as tokens are delivered, no ``weight`` on the components and a schedule::

      mixture:
        vlm:  {path: stores/vlm, subset: subsets/vlm}   # subset: where a VLM store's images are
        text: {path: stores/puzzle-kd}
        schedule:
          - {from_token: 0, weights: {vlm: 0.8, text: 0.2}}
          - {from_token: 500000000, weights: {vlm: 0.5, text: 0.5}}

``schedule`` and ``num_tokens`` are the block's own keys; every other key is a component.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from puzzletron.dataset._checks import did_you_mean, plain_mapping
from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.packing.mixture import MixtureWeights
from puzzletron.dataset.pipelines.mixture import MixtureRankBatches, build_mixture_batches

__all__ = ["MixtureConfig", "mixture_batches", "read_mixture"]

_OWN_KEYS = ("schedule", "num_tokens")
_COMPONENT_KEYS = ("path", "weight", "subset")


@dataclass(frozen=True)
class MixtureConfig:
    """A ``data:`` block with a mixture: the spec, each component's source (and subset), the weights (a
    mapping or a schedule, as `build_mixture_batches` takes them) and the epoch's ``num_tokens``."""

    spec: PuzzletronDataSpec
    sources: Mapping[str, str]
    weights: Any
    subsets: Mapping[str, str]
    num_tokens: int | None = None


def _component(name: str, raw: Any) -> dict[str, Any]:
    where = f"data.mixture.{name}"
    if isinstance(raw, str | Path):
        raw = {"path": raw}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be {{path: ..., weight: ...}}, got {type(raw).__name__}")
    raw = plain_mapping(raw, where, error=ConfigError)
    for key in raw:
        if key not in _COMPONENT_KEYS:
            raise ConfigError(
                f"{where}.{key} is not a component key{did_you_mean(str(key), _COMPONENT_KEYS)}"
            )
    if not isinstance(raw.get("path"), str | Path) or not str(raw["path"]):
        raise ConfigError(f"{where}.path is required: the component's store, snapshot or subset")
    return raw


def read_mixture(data: Mapping[str, Any] | PuzzletronDataSpec) -> MixtureConfig | None:
    """The mixture of a ``data:`` block (a mapping, an OmegaConf ``DictConfig`` or a parsed spec whose
    ``extras`` hold it), None when it has no ``mixture`` key; `ConfigError` naming the key at fault."""
    spec = data if isinstance(data, PuzzletronDataSpec) else PuzzletronDataSpec.from_mapping(data)
    block = getattr(spec, "extras", {}).get("mixture")
    if block is None:
        return None
    if not isinstance(block, Mapping):
        raise ConfigError(f"data.mixture must be a mapping of components, got {type(block).__name__}")
    block = plain_mapping(block, "data.mixture", error=ConfigError)
    components = {str(k): _component(str(k), v) for k, v in block.items() if k not in _OWN_KEYS}
    if not components:
        raise ConfigError("data.mixture names no component ({name: {path, weight}})")
    weighted = [n for n, c in components.items() if "weight" in c]
    if "schedule" in block:
        if weighted:
            raise ConfigError(
                f"data.mixture has a schedule and data.mixture.{weighted[0]}.weight: give the shares in one "
                "place (the schedule's weights)"
            )
        weights: Any = block["schedule"]
    else:
        unweighted = [n for n in components if n not in weighted]
        if unweighted:
            raise ConfigError(
                f"data.mixture.{unweighted[0]}.weight is missing (or give data.mixture.schedule)"
            )
        weights = {n: c["weight"] for n, c in components.items()}
    MixtureWeights.parse(tuple(components), weights)  # its errors now, naming the key
    num_tokens = block.get("num_tokens")
    return MixtureConfig(
        spec=spec,
        sources={n: str(c["path"]) for n, c in components.items()},
        weights=weights,
        subsets={n: str(c["subset"]) for n, c in components.items() if "subset" in c},
        num_tokens=num_tokens,
    )


def mixture_batches(data: Mapping[str, Any], **options: Any) -> MixtureRankBatches:
    """Hydra ``_target_``: the batches of the mixture of a ``data:`` block; ``options`` are
    `build_mixture_batches`' (``batch_size``, ``tokenizer``, ``processor``, ``cache_dir``, ...)."""
    config = read_mixture(data)
    if config is None:
        raise ConfigError("data has no mixture block (data.mixture: {name: {path, weight}})")
    return build_mixture_batches(
        config.sources,
        weights=config.weights,
        spec=config.spec,
        subsets=config.subsets,
        num_tokens=config.num_tokens,
        **options,
    )

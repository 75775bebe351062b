"""STUB — replaced by the config implementation (issue 2)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from puzzletron.dataset.batch import DataLayout, Modality

__all__ = ["PackingSpec", "PuzzletronDataSpec"]


@dataclass(frozen=True)
class PackingSpec:
    pack_size: int
    packing_ratio: float = 1.0
    drop_long_samples: bool = True


@dataclass(frozen=True)
class PuzzletronDataSpec:
    modality: Modality
    layout: DataLayout
    max_sample_length: int
    packing: PackingSpec | None = None

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> PuzzletronDataSpec:
        raise NotImplementedError

"""STUB — replaced by Hub acquisition (issue 4)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "TextAcquisitionSpec",
    "VlmAcquisitionSpec",
    "materialize_intersyn_subset",
    "materialize_nemotron_vlm_dataset",
    "materialize_puzzle_kd_dataset",
]


@dataclass(frozen=True, kw_only=True)
class TextAcquisitionSpec:
    """A bounded local snapshot of Puzzle-KD's two canonical splits."""

    output_dir: Path
    train_samples: int = 8192
    validation_samples: int = 1024
    seed: int = 408
    revision: str | None = None
    source: str = "nvidia/Puzzle-KD-Nemotron-Post-Training-Dataset-v2"

    def identity(self, *, revision: str) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class VlmAcquisitionSpec:
    """A bounded local image-conversation snapshot of Nemotron-VLM v2."""

    output_dir: Path
    subsets: tuple[str, ...] = ("sparsetables", "plotqa_cot", "wiki_en")
    subset_rows: tuple[tuple[str, int], ...] = ()
    num_samples: int = 512
    seed: int = 42
    max_shards_per_subset: int = 1
    revision: str | None = None
    source: str = "nvidia/Nemotron-VLM-Dataset-v2"

    def identity(self, *, revision: str) -> dict[str, Any]:
        raise NotImplementedError


def _resolve_revision(source: str, revision: str | None) -> str:
    raise NotImplementedError


def materialize_puzzle_kd_dataset(
    spec: TextAcquisitionSpec,
    *,
    dataset_loader: Callable[..., Iterable[Mapping[str, Any]]] | None = None,
    revision_resolver: Callable[[str, str | None], str] = _resolve_revision,
) -> dict[str, Any]:
    """Materialize bounded Puzzle-KD train/validation splits for offline tokenization."""
    raise NotImplementedError


def materialize_nemotron_vlm_dataset(
    spec: VlmAcquisitionSpec,
    *,
    sample_loader: Callable[..., Iterable[Mapping[str, Any]]] | None = None,
    revision_resolver: Callable[[str, str | None], str] = _resolve_revision,
) -> dict[str, Any]:
    """Materialize a bounded, row-proportional Nemotron image-conversation subset."""
    raise NotImplementedError


def materialize_intersyn_subset(
    output_dir: str | Path,
    *,
    rows_per_source: int = 8,
    dataset_loader: Callable[..., Iterable[Mapping[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Download once, validate, and cache the pinned 8+8 InterSyn acceptance set."""
    raise NotImplementedError

"""What to acquire: one frozen spec per source, validated on construction, and its identity.

The identity (the fields minus ``output_dir``, plus the adapter name and the resolved revision) is what a
snapshot records as its ``acquisition`` and what reuse compares (``docs/acquisition.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from puzzletron.dataset._checks import require_int
from puzzletron.dataset.config import MAX_ROW_BYTES, MAX_TURN_BYTES, check_size_limits
from puzzletron.dataset.conversation import NEMOTRON_VLM_DATASET
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.storage.atomic import check_destination

__all__ = [
    "NEMOTRON_VLM_ADAPTER",
    "PUZZLE_KD_ADAPTER",
    "PUZZLE_KD_DATASET",
    "TextAcquisitionSpec",
    "VlmAcquisitionSpec",
    "output_path",
]

PUZZLE_KD_ADAPTER = "puzzle_kd_v2"
NEMOTRON_VLM_ADAPTER = "nemotron_vlm_v2"
PUZZLE_KD_DATASET = "nvidia/Puzzle-KD-Nemotron-Post-Training-Dataset-v2"


def output_path(value: Any, what: str) -> Path:
    """`value` as the `Path` of a snapshot directory; `ConfigError` naming `what` when it is not a path, its
    name is too long for any file system (`check_destination`), or it is not valid UTF-8 (pyarrow and
    `datasets` cannot open such a path, so the snapshot could be written but never read or verified)."""
    if not isinstance(value, str | Path) or not str(value):
        raise ConfigError(f"{what} must be a path, got {value!r}")
    try:
        str(value).encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(
            f"{what} {str(value)!r} is not valid UTF-8; pyarrow and datasets cannot open such a path, so "
            "choose a UTF-8 name"
        ) from None
    check_destination(value, what)
    return Path(value)


def _int(spec: Any, name: str, value: Any, minimum: int | None = 1) -> int:
    """`value` as a Python int (numpy integers accepted), `ConfigError` naming ``Spec.name`` otherwise."""
    return require_int(value, f"{type(spec).__name__}.{name}", minimum=minimum, error=ConfigError)


def _set_int(spec: Any, name: str, minimum: int | None = 1) -> None:
    object.__setattr__(spec, name, _int(spec, name, getattr(spec, name), minimum))


def _common_checks(spec: Any, *positive: str) -> None:
    """Check (and normalise) the fields every spec has (output_dir, seed, revision, source) and the
    `positive` int fields."""
    owner = type(spec).__name__
    object.__setattr__(spec, "output_dir", output_path(spec.output_dir, f"{owner}.output_dir"))
    _set_int(spec, "seed", minimum=None)
    if spec.revision is not None and (not isinstance(spec.revision, str) or not spec.revision.strip()):
        raise ConfigError(f"{owner}.revision must be None or a non-empty string, got {spec.revision!r}")
    if not isinstance(spec.source, str) or spec.source.count("/") != 1 or not all(spec.source.split("/")):
        raise ConfigError(f"{owner}.source must be a Hub dataset id 'org/name', got {spec.source!r}")
    for name in positive:
        _set_int(spec, name)


_LIMITS = {"max_turn_bytes": MAX_TURN_BYTES, "max_row_bytes": MAX_ROW_BYTES}


def _identity(spec: Any, adapter: str, revision: str) -> dict[str, Any]:
    if not isinstance(revision, str) or not revision:
        raise ConfigError(
            f"{type(spec).__name__}.identity: revision must be a resolved string, got {revision!r}"
        )
    out: dict[str, Any] = {"adapter": adapter}
    for f in fields(spec):
        # the size bounds only when not the defaults: snapshots made before they existed stay reusable
        if f.name != "output_dir" and _LIMITS.get(f.name) != getattr(spec, f.name):
            out[f.name] = getattr(spec, f.name)
    out["revision"] = revision
    return out


class _HubSpec:
    """What every spec does (a mixin, no fields, so each spec keeps its own field order): check and
    normalise its fields on construction, and give its identity. A spec has ``output_dir``, ``seed``,
    ``revision``, ``source`` and its own fields, and names its adapter and its positive int fields."""

    _ADAPTER: ClassVar[str]
    _POSITIVE: ClassVar[tuple[str, ...]] = ()  # int fields that must be >= 1

    def __post_init__(self) -> None:
        _common_checks(self, *self._POSITIVE)
        limits = check_size_limits(type(self).__name__, self.max_turn_bytes, self.max_row_bytes)  # type: ignore[attr-defined]
        object.__setattr__(self, "max_turn_bytes", limits[0])
        object.__setattr__(self, "max_row_bytes", limits[1])

    def identity(self, *, revision: str) -> dict[str, Any]:
        """The fields minus `output_dir`, plus ``adapter`` and the resolved `revision` (JSON-ready)."""
        return _identity(self, self._ADAPTER, revision)


@dataclass(frozen=True, kw_only=True)
class TextAcquisitionSpec(_HubSpec):
    """A bounded local snapshot of Puzzle-KD's two canonical splits."""

    _ADAPTER: ClassVar[str] = PUZZLE_KD_ADAPTER
    _POSITIVE: ClassVar[tuple[str, ...]] = ("train_samples", "validation_samples")

    output_dir: Path
    train_samples: int = 8192
    validation_samples: int = 1024
    seed: int = 408
    revision: str | None = None
    source: str = PUZZLE_KD_DATASET
    max_turn_bytes: int = MAX_TURN_BYTES  # a row with a longer turn (UTF-8 bytes) is rejected and counted
    max_row_bytes: int = MAX_ROW_BYTES  # ... and with more text in all


@dataclass(frozen=True, kw_only=True)
class VlmAcquisitionSpec(_HubSpec):
    """A bounded local image-conversation snapshot of Nemotron-VLM v2."""

    _ADAPTER: ClassVar[str] = NEMOTRON_VLM_ADAPTER
    _POSITIVE: ClassVar[tuple[str, ...]] = ("num_samples", "max_shards_per_subset")

    output_dir: Path
    subsets: tuple[str, ...] = ("sparsetables", "plotqa_cot", "wiki_en")
    subset_rows: tuple[tuple[str, int], ...] = ()
    num_samples: int = 512
    seed: int = 42
    max_shards_per_subset: int = 1
    revision: str | None = None
    source: str = NEMOTRON_VLM_DATASET
    max_turn_bytes: int = MAX_TURN_BYTES  # a row with a longer text turn (UTF-8 bytes) is rejected
    max_row_bytes: int = MAX_ROW_BYTES  # ... and with more text in all

    def __post_init__(self) -> None:
        super().__post_init__()
        subsets = self._checked_subsets()
        object.__setattr__(self, "subsets", subsets)
        object.__setattr__(self, "subset_rows", self._checked_rows(subsets))

    def _checked_subsets(self) -> tuple[str, ...]:
        owner = type(self).__name__
        if isinstance(self.subsets, str) or not isinstance(self.subsets, Sequence) or not self.subsets:
            raise ConfigError(f"{owner}.subsets must be a non-empty sequence of names, got {self.subsets!r}")
        subsets: list[str] = []
        for name in self.subsets:
            if not isinstance(name, str) or not name.strip():
                raise ConfigError(f"{owner}.subsets: expected non-empty names, got {name!r}")
            if name.strip() in subsets:
                raise ConfigError(f"{owner}.subsets: {name.strip()!r} is listed twice")
            subsets.append(name.strip())
        return tuple(subsets)

    def _checked_rows(self, subsets: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
        """`subset_rows` as ``(name, weight)`` pairs naming exactly `subsets`, in order (default: 1 each)."""
        owner = type(self).__name__
        raw = self.subset_rows
        pairs = list(raw.items()) if isinstance(raw, Mapping) else list(raw)
        if not pairs:
            pairs = [(name, 1) for name in subsets]
        rows = []
        for pair in pairs:
            if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise ConfigError(f"{owner}.subset_rows: expected (name, weight) pairs, got {pair!r}")
            name, weight = pair
            rows.append((str(name).strip(), _int(self, f"subset_rows[{name!r}]", weight)))
        if [name for name, _ in rows] != list(subsets):
            raise ConfigError(
                f"{owner}.subset_rows must name exactly the subsets, in order: expected {list(subsets)}, "
                f"got {[name for name, _ in rows]}"
            )
        return tuple(rows)

    def identity(self, *, revision: str) -> dict[str, Any]:
        """The fields minus `output_dir`, plus ``adapter`` and the resolved `revision` (JSON-ready:
        ``subsets`` as a list, ``subset_rows`` as a mapping)."""
        out = super().identity(revision=revision)
        out["subsets"] = list(self.subsets)
        out["subset_rows"] = dict(self.subset_rows)
        return out

"""A mixture planned: each component's rows, and each epoch's stream of them, computed once and mapped.

`MixturePlan` holds what the order depends on (every component's rows with their real and image tokens,
the weights, the seed, the epoch budget) and gives, per epoch, the stream (`packing.mixture.mixture_epoch`)
and its two queues (`packing.mixture_deal.row_queues`). Both are published through the array cache
(`packing.array_cache`) under ``<cache>/mixture-<key>-e<epoch>/``: the first rank computes them, every other
rank and restart maps the checked arrays. The key is a SHA-256 of the rows' token counts (their xxh3_64),
the weights, the seed, ``shuffle``, the budget and `MIXTURE_VERSION`: content, never a path or a name.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from puzzletron.dataset.formats.binary import ragged_arange
from puzzletron.dataset.packing._plan import PackingPlan
from puzzletron.dataset.packing.array_cache import cached_arrays
from puzzletron.dataset.packing.mixture import MixtureWeights, mixture_epoch
from puzzletron.dataset.packing.mixture_deal import RowQueues, row_queues

__all__ = ["MIXTURE_VERSION", "ComponentReport", "MixtureComponent", "MixturePlan"]

MIXTURE_VERSION = 1  # bump when the stream or the queues of the same inputs change


@dataclass(frozen=True, eq=False)
class MixtureComponent:
    """One component as the mixture plans it.

    Attributes:
        name: its name in the mixture.
        plan: its packing plan (None: one sample a row).
        row_tokens: ``[R]`` real tokens of each row (image tokens included).
        image_tokens: ``[R]`` image tokens of each row.
        samples: the samples it has (before its plan dropped any).
    """

    name: str
    plan: PackingPlan | None
    row_tokens: np.ndarray = field(repr=False)
    image_tokens: np.ndarray = field(repr=False)
    samples: int

    def rows(self, rows: np.ndarray) -> list[tuple[int, ...]]:
        """The sample (or unit) indices of each of ``rows``."""
        if self.plan is None:
            return [(int(r),) for r in rows.tolist()]
        return [self.plan.row(int(r)) for r in rows.tolist()]


@dataclass(frozen=True)
class ComponentReport:
    """What one epoch took of a component: samples available and used (distinct), rows used, passes (real
    tokens used over one pass's), real tokens, the share asked (over the epoch) and achieved, and the
    supervised tokens (None until counted: `MixtureRankBatches.report` reads them)."""

    name: str
    samples: int
    samples_used: int
    rows_used: int
    passes: float
    real_tokens: int
    share_asked: float
    share_achieved: float
    supervised_tokens: int | None = None


def _digest(a: np.ndarray) -> str:
    """xxh3_64 of the counts as int32 (a row's tokens fit), whatever dtype they come in."""
    data = np.ascontiguousarray(a, dtype=np.int32)
    return f"{xxhash.xxh3_64_intdigest(memoryview(data).cast('B')):016x}"


@dataclass(frozen=True, eq=False)
class MixturePlan:
    """Components, weights and the epochs' streams (module docstring). Global row ``offsets[c] + r`` is row
    ``r`` of component ``c``; ``real_tokens`` / ``image_tokens`` ``[all rows]`` are indexed by it."""

    components: tuple[MixtureComponent, ...]
    weights: MixtureWeights
    seed: int
    row_size: int
    shuffle: bool = True
    num_tokens: int | None = None
    cache: Path | None = None
    key: str = field(init=False)
    offsets: np.ndarray = field(init=False, repr=False)
    real_tokens: np.ndarray = field(init=False, repr=False)
    image_tokens: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        sizes = [c.row_tokens.shape[0] for c in self.components]
        set_ = object.__setattr__
        set_(self, "offsets", np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
        for name, field_name in (("real_tokens", "row_tokens"), ("image_tokens", "image_tokens")):
            values = [np.asarray(getattr(c, field_name)) for c in self.components]
            array = np.concatenate(values).astype(np.int32)  # a row's tokens fit
            array.setflags(write=False)
            set_(self, name, array)
        blob = {
            "format": "puzzletron-mixture",
            "version": MIXTURE_VERSION,
            "rows": [[c.name, _digest(c.row_tokens), _digest(c.image_tokens)] for c in self.components],
            "weights": self.weights.identity(),
            "seed": int(self.seed),
            "shuffle": bool(self.shuffle),
            "num_tokens": self.num_tokens,
        }
        set_(self, "key", hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest())

    @property
    def names(self) -> tuple[str, ...]:
        return self.weights.names

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The component and its row of each global row id."""
        component = np.searchsorted(self.offsets, ids, side="right") - 1
        return component, ids - self.offsets[component]

    def _epoch_arrays(self, epoch: int) -> dict[str, np.ndarray]:
        def compute() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
            stream = mixture_epoch(
                [c.row_tokens for c in self.components],
                self.weights,
                seed=self.seed,
                epoch=epoch,
                num_tokens=self.num_tokens,
                shuffle=self.shuffle,
            )
            queues = row_queues(stream.order, self.image_tokens)
            arrays = {
                "order": stream.order,
                "image_positions": queues.image_positions,
                "images": queues.images,
                "texts": queues.texts,
            }
            return arrays, {"epoch": epoch, "num_tokens": stream.num_tokens}

        if self.cache is None:
            return dict(compute()[0])
        folder = Path(self.cache) / f"mixture-{self.key[:16]}-e{int(epoch)}"
        arrays, _ = cached_arrays(folder, f"{self.key}:{int(epoch)}", compute)
        return arrays

    def order(self, epoch: int) -> np.ndarray:
        """``[n]`` global row ids of epoch ``epoch`` in stream order (DP-independent)."""
        return self._epoch_arrays(epoch)["order"]

    def queues(self, epoch: int) -> RowQueues:
        """Epoch ``epoch``'s two queues (`row_queues`), from the cache."""
        a = self._epoch_arrays(epoch)
        return RowQueues(image_positions=a["image_positions"], images=a["images"], texts=a["texts"])

    def rows_used(self, epoch: int, component: int) -> tuple[np.ndarray, np.ndarray]:
        """The distinct rows of ``component`` epoch ``epoch`` takes, and how many times each."""
        c, row = self.locate(np.asarray(self.order(epoch)))
        return np.unique(row[c == component], return_counts=True)

    def report(self, epoch: int = 0) -> tuple[ComponentReport, ...]:
        """Per component, what epoch ``epoch`` takes of it (`ComponentReport`)."""
        order = np.asarray(self.order(epoch))
        component, row = self.locate(order)
        tokens = self.real_tokens[order].astype(np.int64)
        total = int(tokens.sum())
        asked = self.weights.owed(total) / max(total, 1)
        out = []
        for c, comp in enumerate(self.components):
            rows = row[component == c]
            real = int(tokens[component == c].sum())
            used = _samples_of(comp.plan, np.unique(rows))
            out.append(
                ComponentReport(
                    name=comp.name,
                    samples=comp.samples,
                    samples_used=used,
                    rows_used=int(rows.shape[0]),
                    passes=real / max(int(comp.row_tokens.sum()), 1),
                    real_tokens=real,
                    share_asked=float(asked[c]),
                    share_achieved=real / max(total, 1),
                )
            )
        return tuple(out)


def _samples_of(plan: PackingPlan | None, rows: np.ndarray) -> int:
    """Distinct samples in ``rows`` of ``plan`` (a row is a sample without one; a cut sample's units count
    once)."""
    if plan is None:
        return int(rows.shape[0])
    first = np.asarray(plan.row_offsets[rows], dtype=np.int64)
    entries = np.asarray(plan.sample_order)[
        ragged_arange(first, np.asarray(plan.row_offsets[rows + 1]) - first)
    ]
    if plan.units is not None:
        entries = plan.units.sample[entries]
    return int(np.unique(entries).shape[0])

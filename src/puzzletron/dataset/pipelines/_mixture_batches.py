"""`MixtureBatches`: the keyed dataset of a mixture: one `BatchKey` (global row ids) -> one `PuzzletronBatch`.

A key's rows come from several components; each component's rows are resolved to token spans by its own
plan (`Spans.of_rows`, its units when it cut long samples), the spans laid out in the key's row order and
built in one pass over all components' samples (`ConcatSamples`, `build_spans`), exactly as a single store's
rows are. A multimodal mixture then adds the media of every image document (`attach_media`: each VLM
component's images, in document order; text documents hold none), so every batch of it has the same keys
(``pixel_values`` may hold no patch). ``source_metadata["document_components"]`` names the component of
every document, parallel to ``document_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from puzzletron.dataset.batch import PuzzletronBatch
from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.distributed import BatchKey
from puzzletron.dataset.packing import ConcatSamples, PackingPlan, SampleSource, Spans, Units, build_spans
from puzzletron.dataset.pipelines._vlm_media import VlmMedia, attach_media

__all__ = ["MixtureBatches", "supervised_tokens"]


@dataclass(frozen=True, eq=False)
class MixtureBatches(torch.utils.data.Dataset):
    """Map-style dataset of a mixture (module docstring).

    Attributes:
        names: the components' names.
        samples: each component's samples; ``plans`` each one's plan (None: one sample a row).
        row_offsets: ``[K + 1]`` global row id of each component's first row.
        spec, pad_token_id, pad_to_multiple_of: as `PackedBatches`.
        media: per component its `VlmMedia` (None for a text component); None for a text mixture.
        image_token_id, merge_size: the processor's (a multimodal mixture).
    """

    names: tuple[str, ...]
    samples: tuple[SampleSource, ...]
    plans: tuple[PackingPlan | None, ...]
    row_offsets: np.ndarray
    spec: PuzzletronDataSpec
    pad_token_id: int = 0
    pad_to_multiple_of: int = 1
    media: tuple[VlmMedia | None, ...] | None = None
    image_token_id: int = -1
    merge_size: int = 1
    concat: ConcatSamples = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "concat", ConcatSamples(self.samples))

    def __len__(self) -> int:
        return int(self.row_offsets[-1])

    def _units(self, c: int) -> Units | None:
        plan = self.plans[c]
        return plan.units if plan is not None else None

    def _rows(self, c: int, rows: np.ndarray) -> list[Sequence[int]]:
        plan = self.plans[c]
        if plan is None:
            return [(int(r),) for r in rows.tolist()]
        return [plan.row(int(r)) for r in rows.tolist()]

    def spans(self, indices: Sequence[int]) -> tuple[Spans, np.ndarray]:
        """The spans of a key's rows (global row ids, ``-1`` = padding slot) in row order, and the component
        of each span."""
        ids = np.asarray(indices, dtype=np.int64)
        real = ids >= 0
        component = np.where(real, np.searchsorted(self.row_offsets, ids, side="right") - 1, -1)
        parts: dict[int, tuple[Spans, np.ndarray]] = {}
        for c in np.unique(component[real]).tolist():
            rows = ids[component == c] - self.row_offsets[c]
            # a component repeated in passes may give one batch the same row twice
            part = Spans.of_rows(self.samples[c], self._rows(c, rows), self._units(c), unique=False)
            first = np.concatenate([[0], np.cumsum(part.counts)])
            parts[c] = (part, first)
        counts = np.zeros(ids.shape[0], dtype=np.int64)
        picks: list[tuple[int, int, int]] = []  # (component, first span, stop) in row order
        seen = dict.fromkeys(parts, 0)
        for k, c in enumerate(component.tolist()):
            if c < 0:
                continue
            part, first = parts[c]
            j = seen[c]
            seen[c] += 1
            picks.append((c, int(first[j]), int(first[j + 1])))
            counts[k] = first[j + 1] - first[j]
        span_component = np.concatenate(
            [np.full(b - a, c, dtype=np.int64) for c, a, b in picks] or [np.zeros(0, np.int64)]
        )

        def gather(name: str) -> np.ndarray:
            values = [getattr(parts[c][0], name)[a:b] for c, a, b in picks]
            return np.concatenate(values).astype(np.int64) if values else np.zeros(0, np.int64)

        local = gather("sample")
        every = {c: part.names(np.arange(first[-1])) for c, (part, first) in parts.items()}  # one read each
        names = [name for c, a, b in picks for name in every[c][a:b]]
        spans = Spans(
            sample=local + self.concat.offsets[span_component],
            start=gather("start"),
            length=gather("length"),
            counts=counts,
            names=lambda k: [names[i] for i in np.asarray(k).tolist()],
            cut=any(parts[c][0].cut for c in parts),
        )
        return spans, span_component

    def __getitem__(self, key: BatchKey) -> PuzzletronBatch:
        if not isinstance(key, BatchKey):
            raise TypeError(f"MixtureBatches is indexed by BatchKey, got {type(key).__name__}")
        spans, component = self.spans(key.indices)
        meta: dict[str, Any] = {
            "epoch": key.epoch,
            "step": key.step,
            "dp_rank": key.dp_rank,
            "padding": key.is_padding,
            "items": list(key.indices),
            "document_components": [self.names[c] for c in component.tolist()],
        }
        batch = build_spans(
            self.concat,
            spans,
            spec=self.spec,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
            source_metadata=meta,
        )
        if self.media is None:
            return batch
        blocks, doc_block = [], np.full(component.shape[0], -1, dtype=np.int64)
        local = spans.sample - self.concat.offsets[np.maximum(component, 0)]
        for c, media in enumerate(self.media):
            if media is None:
                continue
            at = np.flatnonzero(component == c)
            doc_block[at] = len(blocks)
            blocks.append(media.images_of(local[at]))
        meta = next(m.metadata() for m in self.media if m is not None)  # one processor: one normalisation
        return attach_media(
            batch,
            blocks,
            doc_block,
            image_token_id=self.image_token_id,
            merge_size=self.merge_size,
            source_metadata=meta,
        )


_ROWS_AT_ONCE = 1 << 10


def supervised_tokens(dataset: MixtureBatches, c: int, rows: np.ndarray, times: np.ndarray) -> int:
    """Supervised tokens (labels that are not -100) of ``rows`` of component ``c``, row ``rows[k]`` taken
    ``times[k]`` times, counted as its batches count them (a cut unit's last label too)."""
    samples, units, total = dataset.samples[c], dataset._units(c), 0
    for a in range(0, rows.shape[0], _ROWS_AT_ONCE):
        part = rows[a : a + _ROWS_AT_ONCE]
        spans = Spans.of_rows(samples, dataset._rows(c, part), units, unique=False)
        _, labels = samples.gather(spans.sample, spans.start, spans.length)
        supervised = labels != -100
        if spans.cut:  # a unit is a document: its last label is -100
            supervised[(np.cumsum(spans.length) - 1)[spans.length > 0]] = False
        ends = np.cumsum(spans.counts)  # spans of each row
        per_span = (
            np.add.reduceat(supervised, np.cumsum(spans.length) - spans.length) if supervised.size else []
        )
        per_row = np.add.reduceat(np.asarray(per_span, dtype=np.int64), ends - spans.counts)
        total += int((per_row * times[a : a + _ROWS_AT_ONCE]).sum())
    return total

"""The Hydra `_target_` factory AutoModel instantiates for an offline conversation subset.

    dataset:
      _target_: puzzletron.dataset.load_materialized_conversation_dataset
      path_or_dataset: /data/subsets/intersyn
      num_samples: 16
      max_length: 2048          # AutoModel passes it through; accepted, used by its collator
      pretokenize: false        # AutoModel pops these before calling; accepted when it does not
      truncate: true
      inject_fake_images: false

Order: round-robin over the `(source.dataset, source.revision)` groups (in order of first appearance),
keeping each group's own order; then the first `num_samples`. Items are read lazily through the subset's
offset index, so building a dataset over a large subset parses no samples.

Length hints for AutoModel's neat VLM packing (``_estimate_sample_length`` in
``nemo_automodel/components/datasets/vlm/neat_packing_vlm.py``, which reads exactly these keys): items of a
subset folder carry ``mm_inputs_meta = {"images_meta": [[height, width], ...]}`` (lists, height first; the
subset manifest's sizes), so AutoModel resizes each image with the processor's pixel limits instead of
guessing 500 tokens. Given the subset's VLM store (``vlm_store``, or ``processor_path`` + ``cache_dir``, by
default `puzzletron.dataset.config.default_cache_dir`, to build or reuse it:
`puzzletron.dataset.tokenize.vlm_store`), items also carry ``_text_tokens``: every non-image token of the
sample's templated sequence, exact, so AutoModel's estimate is the true length::

    dataset:
      _target_: puzzletron.dataset.load_materialized_conversation_dataset
      path_or_dataset: /data/subsets/vlm
      vlm_store: /data/stores/vlm        # or processor_path: /models/qwen2_5_vl + cache_dir: /data/stores
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from puzzletron.dataset._checks import refuse_unknown, require_bool, require_int
from puzzletron.dataset.config import default_cache_dir
from puzzletron.dataset.errors import ConfigError, ConversationError, SnapshotError
from puzzletron.dataset.formats.subset import manifest_sha256
from puzzletron.dataset.formats.subset.reader import SubsetReader, subset_manifest
from puzzletron.dataset.formats.vlm_store import VlmStore
from puzzletron.dataset.tokenize import build_vlm_store

__all__ = [
    "ConversationDataset",
    "LengthHints",
    "length_hints",
    "load_materialized_conversation_dataset",
    "round_robin_order",
]


def round_robin_order(groups: Sequence[int]) -> list[int]:
    """Indices of `groups` taken one per group per pass, groups by first appearance, each in its own order.

    >>> round_robin_order([0, 0, 0, 1, 1, 2])
    [0, 3, 5, 1, 4, 2]
    """
    buckets: dict[int, list[int]] = {}
    for index, group in enumerate(groups):
        buckets.setdefault(group, []).append(index)
    lanes = list(buckets.values())
    order = []
    for depth in range(max(map(len, lanes), default=0)):
        order.extend(lane[depth] for lane in lanes if depth < len(lane))
    return order


def _group_ids(samples: Sequence[Mapping[str, Any]]) -> list[int]:
    ids: dict[tuple[Any, Any], int] = {}
    out = []
    for i, sample in enumerate(samples):
        source = sample.get("source") if isinstance(sample, Mapping) else None
        if not isinstance(source, Mapping):
            raise ConversationError(
                f"sample {i}: missing 'source' mapping; cannot group by dataset and revision"
            )
        out.append(ids.setdefault((source.get("dataset"), source.get("revision")), len(ids)))
    return out


@dataclass(frozen=True)
class LengthHints:
    """Per subset sample: its images' ``[height, width]`` (rows ``start[i] .. start[i + 1]`` of ``sizes``)
    and, when a VLM store was given, its exact non-image tokens (``text_tokens``, -1 for a row the store
    skipped)."""

    start: np.ndarray
    sizes: np.ndarray
    text_tokens: np.ndarray | None = None

    def item(self, index: int) -> dict[str, Any]:
        """The hint keys of sample ``index`` as AutoModel reads them."""
        a, b = int(self.start[index]), int(self.start[index + 1])
        out: dict[str, Any] = {"mm_inputs_meta": {"images_meta": self.sizes[a:b].tolist()}}
        if self.text_tokens is not None and self.text_tokens[index] >= 0:
            out["_text_tokens"] = int(self.text_tokens[index])
        return out


def length_hints(reader: SubsetReader, store: VlmStore | None = None) -> LengthHints | None:
    """The `LengthHints` of a subset (its manifest's image sizes; None when the manifest does not record
    them) and, with its VLM ``store``, exact text tokens; `SnapshotError` when the store was built from
    another subset. Reads the manifest only: a damaged sample stays an error of that sample's item."""
    manifest = subset_manifest(reader.root)
    records = sorted(manifest["images"], key=lambda r: (r["sample_index"], r["image_index"]))
    if not all(type(r.get("width")) is int and type(r.get("height")) is int for r in records):
        return None  # an original-layout subset may not record sizes: AutoModel estimates as before
    n = len(reader)
    owner = np.fromiter((r["sample_index"] for r in records), np.int64, len(records))
    start = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=n)[:n])]).astype(np.int64)
    sizes = np.array([[r["height"], r["width"]] for r in records], dtype=np.int64).reshape(-1, 2)
    if store is None:
        return LengthHints(start, sizes)
    if store.manifest["identity"]["subset"]["manifest_sha256"] != manifest_sha256(reader.root):
        raise SnapshotError(f"{store.path} is not the VLM store of the subset {reader.root}")
    rows = np.fromiter((int(i.split(":")[0]) for i in store.sample_ids(np.arange(len(store)))), np.int64)
    text = np.full(n, -1, dtype=np.int64)
    text[rows] = store.lengths.astype(np.int64) - store.image_tokens.astype(np.int64)
    return LengthHints(start, sizes, text)


class ConversationDataset(Dataset):
    """A map-style, `Sized` dataset of `{"conversation": [...], ...}` items; each item is a fresh copy (with
    AutoModel's length hints when ``hints`` are given: `LengthHints`)."""

    def __init__(
        self,
        samples: Sequence[Mapping[str, Any]],
        order: Sequence[int],
        *,
        options: Mapping[str, Any],
        hints: LengthHints | None = None,
    ):
        self._samples = samples
        self._order = list(order)
        self.options = dict(options)  # the AutoModel controls as given (informational)
        self.hints = hints

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if isinstance(index, bool):
            raise TypeError("dataset index must be an integer, got a bool")  # the sequence protocol's error
        position = self._order[operator.index(index)]
        sample = self._samples[position]
        # A SubsetReader already returns a fresh dict per call; an in-memory list must not leak its own.
        item = sample if isinstance(self._samples, SubsetReader) else copy.deepcopy(dict(sample))
        return item if self.hints is None else {**item, **self.hints.item(position)}


def load_materialized_conversation_dataset(
    path_or_dataset: str | Path,
    *,
    num_samples: int | None = None,
    seq_length: int | None = None,
    pretokenize: bool | None = None,
    truncate: bool | None = None,
    inject_fake_images: bool | None = None,
    max_length: int | None = None,
    vlm_store: str | Path | None = None,
    processor_path: str | Path | None = None,
    cache_dir: str | Path | None = None,
    **unknown: Any,
) -> ConversationDataset:
    """Hydra-friendly AutoModel VLM dataset factory for the offline subset.

    AutoModel passes the complete dataset config to its dataset target, including processor/collator controls
    that it consumes after construction. Accept those declared controls explicitly so config composition stays
    transparent, but reject misspelled or otherwise unknown fields (`TypeError` naming them).

    `path_or_dataset` is a subset directory (or an URL: ``s3://bucket/subsets/vlm``, read through the
    node's object cache, as ``vlm_store`` may be) or an in-memory sequence of normalised samples. Items of a
    subset directory carry AutoModel's length hints (module docstring): ``mm_inputs_meta`` always,
    ``_text_tokens`` from ``vlm_store`` (the subset's VLM store) or from the store ``processor_path`` builds
    or reuses in ``cache_dir`` (by default `default_cache_dir`: ``PUZZLETRON_CACHE_DIR``).
    """
    refuse_unknown(load_materialized_conversation_dataset, unknown)  # the seed API: a TypeError
    for name, value in (("num_samples", num_samples), ("seq_length", seq_length), ("max_length", max_length)):
        if value is not None:
            require_int(value, name, minimum=1, error=ConfigError)
    for name, value in (
        ("pretokenize", pretokenize),
        ("truncate", truncate),
        ("inject_fake_images", inject_fake_images),
    ):
        if value is not None:
            require_bool(value, name, error=ConfigError)
    hints = None
    if isinstance(path_or_dataset, str | Path):
        samples: Sequence[Mapping[str, Any]] = SubsetReader(path_or_dataset)
        groups = samples.groups()
        if cache_dir is not None and processor_path is None:
            raise ConfigError("cache_dir goes with processor_path (the VLM store it builds or finds there)")
        if processor_path is not None:
            if vlm_store is not None:
                raise ConfigError("give vlm_store or processor_path (+ cache_dir), not both")
            cache = cache_dir if cache_dir is not None else default_cache_dir()
            vlm_store = build_vlm_store(path_or_dataset, processor=processor_path, cache_dir=cache)
        hints = length_hints(samples, VlmStore(vlm_store) if vlm_store is not None else None)
    elif isinstance(path_or_dataset, Sequence):
        if vlm_store is not None or processor_path is not None:
            raise ConfigError("vlm_store / processor_path need a subset directory as path_or_dataset")
        samples = path_or_dataset
        groups = _group_ids(samples)
    else:
        raise ConfigError(
            "path_or_dataset must be a subset directory or a sequence of samples, "
            f"got {type(path_or_dataset).__name__}"
        )
    order = round_robin_order(groups)
    if num_samples is not None:
        if num_samples > len(order):
            raise ConfigError(
                f"num_samples={num_samples} exceeds the {len(order)} samples available in the subset"
            )
        order = order[:num_samples]
    options = {
        "seq_length": seq_length,
        "pretokenize": pretokenize,
        "truncate": truncate,
        "inject_fake_images": inject_fake_images,
        "max_length": max_length,
    }
    return ConversationDataset(samples, order, options=options, hints=hints)

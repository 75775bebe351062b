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
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from puzzletron.dataset._checks import did_you_mean, require_bool, require_int
from puzzletron.dataset.errors import ConfigError, ConversationError
from puzzletron.dataset.formats.subset.reader import SubsetReader

__all__ = ["ConversationDataset", "load_materialized_conversation_dataset", "round_robin_order"]

_OPTIONS = ("num_samples", "seq_length", "pretokenize", "truncate", "inject_fake_images", "max_length")


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


class ConversationDataset(Dataset):
    """A map-style, `Sized` dataset of `{"conversation": [...], ...}` items; each item is a fresh copy."""

    def __init__(
        self, samples: Sequence[Mapping[str, Any]], order: Sequence[int], *, options: Mapping[str, Any]
    ):
        self._samples = samples
        self._order = list(order)
        self.options = dict(options)  # the AutoModel controls as given (informational)

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if isinstance(index, bool):
            raise TypeError("dataset index must be an integer, got a bool")  # the sequence protocol's error
        sample = self._samples[self._order[operator.index(index)]]
        # A SubsetReader already returns a fresh dict per call; an in-memory list must not leak its own.
        return sample if isinstance(self._samples, SubsetReader) else copy.deepcopy(dict(sample))


def load_materialized_conversation_dataset(
    path_or_dataset: str | Path,
    *,
    num_samples: int | None = None,
    seq_length: int | None = None,
    pretokenize: bool | None = None,
    truncate: bool | None = None,
    inject_fake_images: bool | None = None,
    max_length: int | None = None,
    **unknown: Any,
) -> ConversationDataset:
    """Hydra-friendly AutoModel VLM dataset factory for the offline subset.

    AutoModel passes the complete dataset config to its dataset target, including processor/collator controls
    that it consumes after construction. Accept those declared controls explicitly so config composition stays
    transparent, but reject misspelled or otherwise unknown fields (`TypeError` naming them).

    `path_or_dataset` is a subset directory or an in-memory sequence of normalised samples.
    """
    if unknown:
        hints = [f"{name!r}{did_you_mean(name, (*_OPTIONS, 'path_or_dataset'))}" for name in sorted(unknown)]
        raise TypeError(  # the seed API: an unknown keyword is a TypeError, as for any Python call
            "load_materialized_conversation_dataset() got unknown option(s): "
            + ", ".join(hints)
            + f"; accepted options are {', '.join(_OPTIONS)}"
        )
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
    if isinstance(path_or_dataset, str | Path):
        samples: Sequence[Mapping[str, Any]] = SubsetReader(path_or_dataset)
        groups = samples.groups()
    elif isinstance(path_or_dataset, Sequence):
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
    return ConversationDataset(samples, order, options=options)

"""From a text snapshot to this DP rank's training batches: load a split, tokenise, plan, deal, build.

`build_batches` is the one call: load the split (`load_text_split`), tokenise it with the chat template
(`puzzletron.dataset.tokenize`), plan the packing (``packed_varlen``, `puzzletron.dataset.packing`), deal the
rows to this DP rank (`puzzletron.dataset.sampler`), and build each `PuzzletronBatch` in the layout of a
`PuzzletronDataSpec`::

    batches = build_batches("snapshots/puzzle-kd", tokenizer="tok/", spec=spec, batch_size=4,
                            dp_rank=rank, dp_size=world)
    for batch in batches: ...                      # or batches.loader(num_workers=2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from puzzletron.dataset.batch import Modality, PuzzletronBatch
from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.errors import ConfigError, SubsetError
from puzzletron.dataset.packing import PackingPlan, plan_packing
from puzzletron.dataset.sampler import DistributedPackSampler, PackedBatches
from puzzletron.dataset.tokenize import TokenizedText, tokenize_conversations

__all__ = ["TextBatches", "build_batches", "load_text_split"]


def load_text_split(snapshot: str | Path, *, split: str = "train") -> Any:
    """One split of a text snapshot as a `datasets.Dataset`, offline.

    ``snapshot`` is a Puzzle-KD snapshot folder (one ``save_to_disk`` folder per split, as acquisition
    writes it), a saved `DatasetDict`, or a saved single `Dataset` (then ``split`` is not used).
    """
    import datasets

    root = Path(snapshot)
    if (root / split).is_dir():
        return datasets.load_from_disk(str(root / split))
    if not root.is_dir():
        raise SubsetError(f"text snapshot {root} does not exist")
    loaded = datasets.load_from_disk(str(root))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise SubsetError(f"snapshot {root} has no split {split!r} (splits: {sorted(loaded)})")
        return loaded[split]
    return loaded


@dataclass(frozen=True, eq=False)
class TextBatches:
    """A text split ready to train on: tokenised, planned, and dealt to one DP rank.

    Iterating yields this rank's `PuzzletronBatch`es of the sampler's current epoch, ``[batch_size, T]``
    each (``T`` = ``pack_size``, ``max_sample_length``, or the padded batch max). Call
    ``sampler.set_epoch(e)`` before each epoch; ``sampler.state_dict`` / ``load_state_dict`` resume.

    Attributes:
        tokenized: the tokenised samples, skipped rows and pad id.
        plan: the packing plan (``packed_varlen``), else None (one sample per row).
        dataset: `BatchKey` -> `PuzzletronBatch`, the map-style dataset a DataLoader reads.
        sampler: this rank's `DistributedPackSampler` over packs (or samples).
    """

    tokenized: TokenizedText
    plan: PackingPlan | None
    dataset: PackedBatches
    sampler: DistributedPackSampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[PuzzletronBatch]:
        return (self.dataset[key] for key in self.sampler)

    def for_rank(self, dp_rank: int) -> TextBatches:
        """The same tokens and plan dealt to another DP rank (a fresh sampler at epoch 0, same settings)."""
        s = self.sampler
        sampler = DistributedPackSampler(
            s.num_items,
            batch_size=s.batch_size,
            dp_rank=dp_rank,
            dp_size=s.dp_size,
            seed=s.seed,
            shuffle=s.shuffle,
            drop_last=s.drop_last,
        )
        return dataclasses.replace(self, sampler=sampler)

    def loader(self, *, num_workers: int = 0) -> torch.utils.data.DataLoader:
        """A DataLoader yielding the same batches (``batch_size=None``: one `BatchKey` -> one batch)."""
        return torch.utils.data.DataLoader(
            self.dataset, sampler=self.sampler, batch_size=None, num_workers=num_workers
        )


def build_batches(
    source: str | Path | Any,
    *,
    tokenizer: str | Path | Any,
    spec: PuzzletronDataSpec,
    batch_size: int,
    split: str = "train",
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    pad_to_multiple_of: int = 1,
    num_proc: int = 1,
    messages_field: str = "messages",
    id_field: str | None = "uuid",
) -> TextBatches:
    """Snapshot + tokenizer + `PuzzletronDataSpec` -> this DP rank's batches (see `TextBatches`).

    ``source``: a snapshot folder (read with `load_text_split`), a `datasets.Dataset`, or rows with a
    ``messages`` column. ``batch_size``: rows per batch per rank (packs for ``packed_varlen``, samples
    otherwise). ``seed`` orders the packed rows and the epochs' deals. Layouts, as in `build_batch`:
    ``packed_varlen`` packs samples into rows of ``spec.packing.pack_size`` (samples longer than it are
    dropped and counted in ``plan.dropped``, or raise, per ``drop_long_samples``); ``padded_varlen`` pads
    right to the batch max rounded up to ``pad_to_multiple_of``; ``fixed`` pads or truncates to
    ``spec.max_sample_length``.
    """
    if Modality(spec.modality) is not Modality.TEXT:
        raise ConfigError(
            f"build_batches builds text batches; data.modality is {Modality(spec.modality).value}"
        )
    rows = load_text_split(source, split=split) if isinstance(source, str | Path) else source
    tokenized = tokenize_conversations(
        rows, tokenizer=tokenizer, messages_field=messages_field, id_field=id_field, num_proc=num_proc
    )
    samples = tokenized.samples
    plan = None
    if spec.packing is not None:
        plan = plan_packing(samples.lengths, spec.packing, seed=seed, sample_ids=samples.sample_ids)
    dataset = PackedBatches(
        samples, spec, plan, pad_token_id=tokenized.pad_token_id, pad_to_multiple_of=pad_to_multiple_of
    )
    sampler = DistributedPackSampler(
        len(dataset),
        batch_size=batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=shuffle,
        drop_last=drop_last,
    )
    return TextBatches(tokenized, plan, dataset, sampler)

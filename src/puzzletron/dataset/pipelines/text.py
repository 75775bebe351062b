"""From a text snapshot (or a token store) to this DP rank's training batches: tokenise, plan, deal, build.

`build_batches` is the one call: get the tokenised samples (a token store read from disk, built or reused
in ``cache_dir`` by `puzzletron.dataset.tokenize.store`, or the split tokenised in memory by
`puzzletron.dataset.tokenize`), plan the packing (``packed_varlen``, `puzzletron.dataset.packing`), deal the
rows to this DP rank (`puzzletron.dataset.distributed`), and build each `PuzzletronBatch` in the layout
of a `PuzzletronDataSpec`. Rank 0 logs the build's progress and what the plan dropped
(`puzzletron.dataset.pipelines._report`)::

    batches = build_batches("snapshots/puzzle-kd", tokenizer="tok/", spec=spec, batch_size=4,
                            dp_rank=rank, dp_size=world, cache_dir="token-stores/")
    for batch in batches: ...                      # or batches.loader(num_workers=2)

From a store a rank's memory holds the per-sample index and the plan (a few bytes a sample), never the
tokens; the batches are identical (same fingerprints) to those of the in-memory path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from puzzletron.dataset.batch import Modality
from puzzletron.dataset.config import PuzzletronDataSpec, TokenizeOptions, as_spec
from puzzletron.dataset.distributed import PackedBatches
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.formats.text_snapshot import load_text_split
from puzzletron.dataset.pipelines._batches import RankBatches
from puzzletron.dataset.pipelines._core import (
    DealOptions,
    SourceOptions,
    component_plan,
    deal,
    is_token_store,
    text_component,
)
from puzzletron.dataset.pipelines._report import is_rank_zero, log_plan
from puzzletron.dataset.tokenize import TokenizedText
from puzzletron.dataset.tokenize.matching import UNSAID_SPLIT

__all__ = ["TextBatches", "build_batches", "is_token_store", "load_text_split"]


@dataclass(frozen=True, eq=False)
class TextBatches(RankBatches):
    """A text split ready to train on: tokenised, planned, and dealt to one DP rank (`RankBatches`).

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


def build_batches(
    source: str | Path | Any,
    *,
    tokenizer: str | Path | Any = None,
    spec: PuzzletronDataSpec,
    batch_size: int,
    split: str = UNSAID_SPLIT,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    pad_to_multiple_of: int = 1,
    num_proc: int = 1,
    options: TokenizeOptions = TokenizeOptions(),
    cache_dir: str | Path | None = None,
    plan_cache: str | Path | None = None,
) -> TextBatches:
    """Snapshot + tokenizer + `PuzzletronDataSpec` -> this DP rank's batches (see `TextBatches`).

    ``source``: a token store folder (no tokenizer needed), a snapshot folder, a `datasets.Dataset`, or rows
    with a ``messages`` column. With ``cache_dir`` a snapshot is tokenised once into a content-addressed
    token store there (reused by every later call, rank and restart: `build_token_store`; under an
    initialised `torch.distributed` group the ranks share the work); without it the split is tokenised in
    memory (``num_proc`` processes). ``options``: the messages and id columns (`TokenizeOptions`).
    ``batch_size``: rows per batch per rank (packs for ``packed_varlen``, samples otherwise). ``seed``
    orders the packed rows and the epochs' deals. Layouts, as in `build_batch`: ``packed_varlen`` packs
    samples into rows of ``spec.packing.pack_size`` (samples longer than it follow
    ``spec.packing.long_samples``, counted in ``plan``); ``padded_varlen`` pads right to the batch max
    rounded up to ``pad_to_multiple_of``; ``fixed`` pads or truncates to ``spec.max_sample_length``.

    ``split`` (default ``"train"``) and ``tokenizer``, when the caller gives them with a token store as
    ``source``, must be the store's: else the store of that tokenizer found under ``cache_dir``, else a
    `ConfigError` naming both (`puzzletron.dataset.tokenize.matching`).

    ``source`` and ``cache_dir`` may be URLs (``s3://bucket/stores/puzzle-kd``): the store is read through
    the node's object cache (`puzzletron.dataset.storage.remote`; ``docs/object-storage.md``); a text
    snapshot at an URL from the node's verified copy of it (`puzzletron.dataset.formats.local_copy`).

    From a token store the packing plan is planned once and memory-mapped by every rank and restart
    (`puzzletron.dataset.packing.plan_cache`): in ``plan_cache``, by default ``cache_dir/.plans``, else
    ``.<store name>.plans`` beside the store, for a store at an URL ``plans/`` in the node's object cache
    (planned in memory when that folder cannot be written).
    """
    spec = as_spec(spec, owner="build_batches")
    if Modality(spec.modality) is not Modality.TEXT:
        raise ConfigError(
            f"build_batches builds text batches; data.modality is {Modality(spec.modality).value}"
        )
    report = is_rank_zero(dp_rank)
    how = SourceOptions(tokenizer, split=split, options=options, report=report)
    component = text_component(source, dataclasses.replace(how, cache_dir=cache_dir, num_proc=num_proc))
    plan = component_plan(component, spec, seed=seed, cache=plan_cache, cache_dir=cache_dir)
    if plan is not None and report:
        log_plan(plan)
    dataset = PackedBatches(
        component.samples,
        spec,
        plan,
        pad_token_id=component.pad_token_id,
        pad_to_multiple_of=pad_to_multiple_of,
    )
    sampler = deal(len(dataset), DealOptions(batch_size, dp_rank, dp_size, seed, shuffle, drop_last))
    return TextBatches(plan=plan, dataset=dataset, sampler=sampler, tokenized=component.tokenized)

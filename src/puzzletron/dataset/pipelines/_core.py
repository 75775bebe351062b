"""The pipeline core: small units every pipeline composes (sources -> plan -> deal -> batches).

``text`` (`build_batches`), ``vlm`` (`build_vlm_batches`) and ``mixture`` (`build_mixture_batches`) are
each a few lines over these units::

    component = text_component(...) | vlm_component(...)  # a store found, built or read; checked
    plan = component_plan(component, spec, seed=...)      # packs (plan cache) or one sample a row
    loads = pack_loads(component, plan)                   # [rows, 2] image and real tokens of each row
    sampler = deal(num_items, options, loads=loads)       # this rank's steps

A `Component` is one resolved source: the samples `build_batch` reads, the pad id, the store (None when
tokenised in memory) and, for a VLM store, what its batches' media need. Planning never needs more than a
component's lengths, so it never loads a processor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from puzzletron.dataset.config import CACHE_DIR_ENV, PuzzletronDataSpec, TokenizeOptions, default_cache_dir
from puzzletron.dataset.distributed import DistributedPackSampler
from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.formats import MANIFEST, detect
from puzzletron.dataset.formats.local_copy import local_text_snapshot
from puzzletron.dataset.formats.subset import SUBSET_FORMAT
from puzzletron.dataset.formats.text_snapshot import TEXT_SNAPSHOT_FORMAT, load_text_split
from puzzletron.dataset.formats.token_store import LENGTHS, TOKEN_STORE_FORMAT, TokenStore
from puzzletron.dataset.formats.vlm_store import MEDIA_END, TOKENS_MANIFEST, VLM_STORE_FORMAT, VlmStore
from puzzletron.dataset.packing import PackingPlan, StoreNames, StoreSamples, plan_packing, plan_vlm, row_sums
from puzzletron.dataset.packing.media import check_vlm_packing
from puzzletron.dataset.packing.plan_cache import store_plan
from puzzletron.dataset.packing.sources import SampleSource, TokenizedSamples
from puzzletron.dataset.pipelines._report import LOG, BuildProgress
from puzzletron.dataset.pipelines._vlm_media import VlmMedia, check_processor, check_subset, subset_location
from puzzletron.dataset.storage.objects import is_url
from puzzletron.dataset.tokenize import (
    TokenizedText,
    build_token_store,
    build_vlm_store,
    tokenize_conversations,
    vlm_processor,
)
from puzzletron.dataset.tokenize.matching import UNSAID_SPLIT, store_for_call
from puzzletron.dataset.tokenize.vlm_store import DEFAULT_ROWS_PER_SHARD

__all__ = [
    "Component",
    "DealOptions",
    "SourceOptions",
    "check_device_resize",
    "component_plan",
    "deal",
    "is_token_store",
    "pack_loads",
    "store_format",
    "text_component",
    "vlm_component",
]


@dataclass(frozen=True, eq=False)
class Component:
    """One resolved source, ready to plan and to build batches from.

    Attributes:
        samples: what `build_batch` reads (a token store's samples, or samples tokenised in memory).
        pad_token_id: the id padding rows hold.
        store: the `TokenStore` or `VlmStore` (None: tokenised in memory).
        tokenized: the text tokenisation's result (skipped rows), None for a VLM store.
        media: what a VLM store's batches add at batch time (None: text, or planning only).
    """

    samples: SampleSource
    pad_token_id: int
    store: TokenStore | VlmStore | None = None
    tokenized: TokenizedText | None = None
    media: VlmMedia | None = None

    @property
    def is_vlm(self) -> bool:
        return isinstance(self.store, VlmStore)

    @property
    def image_tokens(self) -> np.ndarray | None:
        """``[N]`` image tokens of each sample (None for text)."""
        return self.store.image_tokens if isinstance(self.store, VlmStore) else None


@dataclass(frozen=True)
class SourceOptions:
    """How a source becomes a `Component`: what tokenises a text snapshot (``tokenizer``, its ``split``,
    ``options``) or a subset (``processor``, ``rows_per_shard``), where stores are found or built
    (``cache_dir``, with ``num_proc`` processes), where a VLM store's images are read (``subset``), the
    pixels' dtype, and whether this rank logs the build (``report``)."""

    tokenizer: Any = None
    processor: Any = None
    subset: str | Path | None = None
    split: str = UNSAID_SPLIT  # "train", told apart from a caller's explicit "train"
    cache_dir: str | Path | None = None
    options: TokenizeOptions = TokenizeOptions()
    num_proc: int = 1
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD
    pixel_dtype: Any = None  # None: float32
    draft: bool = False  # decode at reduced size where the processor's target allows (not bit-exact)
    device_resize: bool = False  # uint8: ship decoded images, resized and normalised on the device
    report: bool = False


@dataclass(frozen=True)
class DealOptions:
    """How rows are dealt to DP ranks: ``batch_size`` rows a rank a step, this rank of ``dp_size``, the
    seeded order (``shuffle``) and whether the incomplete last step is dropped."""

    batch_size: int
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False


def deal(num_items: int, options: DealOptions, *, loads: np.ndarray | None = None) -> DistributedPackSampler:
    """This rank's `DistributedPackSampler` over ``num_items`` rows (media-balanced with ``loads``)."""
    return DistributedPackSampler(
        num_items,
        batch_size=options.batch_size,
        dp_rank=options.dp_rank,
        dp_size=options.dp_size,
        seed=options.seed,
        shuffle=options.shuffle,
        drop_last=options.drop_last,
        loads=loads,
    )


def check_device_resize(device_resize: bool, pixel_dtype: Any) -> None:
    """`ConfigError` unless ``device_resize`` is a bool, and True only with ``pixel_dtype=torch.uint8`` (the
    decoded images are the unnormalised values the device resizes)."""
    if not isinstance(device_resize, bool):
        raise ConfigError(f"device_resize must be True or False; got {device_resize!r}")
    if device_resize and pixel_dtype != torch.uint8:
        raise ConfigError(
            "device_resize=True ships uint8 decoded images; it needs pixel_dtype=torch.uint8, got "
            f"{pixel_dtype!r}"
        )


def store_format(source: Any) -> str | None:
    """The format a folder's (or an URL's) manifest names, None when it has none this code reads (the
    snapshot's own reader then says what is wrong with it)."""
    if not isinstance(source, str | Path):
        return None
    if not is_url(source) and not (Path(source) / MANIFEST).is_file():
        return None
    try:
        return detect(source)
    except SnapshotError:
        return None


def is_token_store(source: Any) -> bool:
    """Whether ``source`` is a folder (or URL) whose manifest names the token-store format (the reader then
    checks the rest)."""
    return store_format(source) == TOKEN_STORE_FORMAT


def _from_store(store: TokenStore) -> Component:
    tokenized = TokenizedText(
        samples=StoreSamples(store),
        skipped=store.skipped,
        skipped_ids=tuple(store.skipped_ids()),
        pad_token_id=store.pad_token_id,
    )
    return Component(tokenized.samples, store.pad_token_id, store=store, tokenized=tokenized)


def text_component(source: str | Path | Any, how: SourceOptions) -> Component:
    """The tokenised samples of ``source``: a token store (given, or built/reused in ``how.cache_dir``),
    else tokenised in memory; with ``how.report``, logged (`puzzletron.dataset.pipelines._report`). A text
    snapshot at an URL is read from its verified local copy (`formats.local_copy`)."""
    tokenizer, split, cache_dir, options = how.tokenizer, how.split, how.cache_dir, how.options
    asked = {"split": split, "tokenizer": tokenizer, "cache_dir": cache_dir}  # a store must be the call's
    if is_url(source):
        fmt = store_format(source)
        if fmt == TOKEN_STORE_FORMAT:
            return _from_store(store_for_call(TokenStore(source), **asked))
        if fmt in (SUBSET_FORMAT, VLM_STORE_FORMAT):
            raise ConfigError(f"build_batches: {source} is a {fmt}: build_vlm_batches reads it")
        if fmt != TEXT_SNAPSHOT_FORMAT:
            raise SnapshotError(
                f"{source}: not a token store or a text snapshot; build_batches reads those at URLs (build a "
                "store with `puzzletron-data tokenize SNAPSHOT --output URL` or cache_dir=URL)"
            )
        source = local_text_snapshot(source)  # the verified copy of the node; then as a local folder
    path = Path(source) if isinstance(source, str | Path) else None
    if path is not None and is_token_store(path):
        return _from_store(store_for_call(TokenStore(path), **asked))
    if store_format(path) in (SUBSET_FORMAT, VLM_STORE_FORMAT):
        raise ConfigError(f"build_batches: {source} is a {store_format(path)}: build_vlm_batches reads it")
    split = str(split)  # UNSAID_SPLIT is "train"
    if tokenizer is None:
        raise ConfigError(f"build_batches: tokenizer is required to tokenise {source!r} (not a token store)")
    if cache_dir is not None:
        if path is None:
            raise ConfigError(
                "build_batches: cache_dir needs a snapshot folder as source, not rows in memory"
            )
        progress = BuildProgress(path, split) if how.report else None
        built = build_token_store(
            path, **{**asked, "split": split}, options=options, num_proc=how.num_proc, progress=progress
        )
        if progress is not None:
            progress.finished(built)
        return _from_store(TokenStore(built))
    rows = load_text_split(path, split=split) if path is not None else source
    started = time.perf_counter()
    tokenized = tokenize_conversations(rows, tokenizer=tokenizer, options=options, num_proc=how.num_proc)
    if how.report:
        LOG.info(
            "tokenised %s rows in memory in %.1f s (with cache_dir a token store keeps them for every rank "
            "and restart)",
            f"{len(tokenized.samples) + tokenized.skipped:,}",
            time.perf_counter() - started,
        )
    return Component(tokenized.samples, tokenized.pad_token_id, tokenized=tokenized)


def vlm_component(source: str | Path, how: SourceOptions) -> Component:
    """The VLM store of ``source`` (a VLM store, or a subset built or reused in ``how.cache_dir``), checked
    against ``how.processor`` (when given) and ``how.subset`` (the subset its images are read from; a
    subset source is its own). Without a processor or a subset the component plans but builds no batch."""
    processor, subset, cache_dir = how.processor, how.subset, how.cache_dir
    root = subset_location(source)  # a folder or an URL (a store's or a subset's)
    images_from = subset_location(subset) if subset is not None else None
    fmt = store_format(root)
    if fmt == VLM_STORE_FORMAT:
        store = VlmStore(root)  # no subset=: the one it was built from, if still there unchanged
        images_from = images_from if images_from is not None else store.recorded_subset()
    elif fmt != SUBSET_FORMAT:
        what = f"a {fmt}: build_batches reads it" if fmt else "not a snapshot or store of a known format"
        raise ConfigError(f"build_vlm_batches: {root} is {what}; it reads a conversation subset or VLM store")
    elif processor is None:
        raise ConfigError(
            f"build_vlm_batches: {root} is a subset: give processor= (its VLM store is built once in "
            "cache_dir, by default default_cache_dir()), or pass a VLM store folder"
        )
    else:
        if cache_dir is None:
            cache_dir = default_cache_dir()
            LOG.info(
                "no cache_dir: the VLM store of %s is found or built under %s (%s)",
                root,
                cache_dir,
                CACHE_DIR_ENV,
            )
        built = build_vlm_store(
            root,
            processor=processor,
            cache_dir=cache_dir,
            num_proc=how.num_proc,
            rows_per_shard=how.rows_per_shard,
        )
        store, images_from = VlmStore(built), root
    if processor is not None:
        check_processor(store, vlm_processor(processor))
    if images_from is not None and images_from != root:
        check_subset(store, images_from)
    media = None
    if processor is not None and images_from is not None:
        proc = str(processor) if isinstance(processor, str | Path) else processor
        if how.device_resize:
            vlm_processor(processor).check_device_resize()
        media = VlmMedia(
            store, images_from, proc, how.pixel_dtype or torch.float32, draft=how.draft,
            device_resize=how.device_resize,
        )  # fmt: skip
    return Component(StoreSamples(store), store.pad_token_id, store=store, media=media)


def component_plan(
    component: Component,
    spec: PuzzletronDataSpec,
    *,
    seed: int,
    cache: str | Path | None,
    cache_dir: str | Path | None,
) -> PackingPlan | None:
    """The rows of a component's samples: packs for ``packed_varlen`` (a store's from the plan cache,
    `puzzletron.dataset.packing.plan_cache`: planned once, mapped by every rank), else None for text (one
    sample a row) and one sample a row for a VLM store (never cutting an image)."""
    store = component.store
    if isinstance(store, VlmStore):
        if spec.packing is None:
            return plan_vlm(store.lengths, store.media_end, spec, seed=seed, sample_ids=StoreNames(store))
        check_vlm_packing(spec)
        return store_plan(
            store,
            spec.packing,
            seed=seed,
            cache=cache,
            cache_dir=cache_dir,
            files=(TOKENS_MANIFEST, MEDIA_END),
            estimated=True,  # packing_ratio caps the fill (its seed meaning), though the lengths are exact
            keep_at_least=store.media_end,
        )
    if spec.packing is None:
        return None
    samples = component.samples
    if isinstance(samples, TokenizedSamples):
        return plan_packing(samples.lengths, spec.packing, seed=seed, sample_ids=samples.sample_ids)
    return store_plan(store, spec.packing, seed=seed, cache=cache, cache_dir=cache_dir, files=(LENGTHS,))


def pack_loads(component: Component, plan: PackingPlan | None) -> np.ndarray:
    """``[rows, 2]`` int32: the image tokens and real tokens of each row of ``plan`` (one sample a row
    without a plan); a row's tokens fit int32."""
    if plan is None:
        lengths = np.asarray(component.samples.lengths, dtype=np.int64)
        return np.stack([np.zeros_like(lengths), lengths], axis=1).astype(np.int32)
    images = component.image_tokens
    image_rows = row_sums(plan, images) if images is not None else np.zeros(plan.num_rows, dtype=np.int64)
    return np.stack([image_rows, plan.row_lengths], axis=1).astype(np.int32)

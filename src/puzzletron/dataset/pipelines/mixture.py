"""Several stores, one exact token-weighted stream: a DP rank's batches of a mixture (``docs/mixtures.md``).

`build_mixture_batches` composes the pipeline core (`puzzletron.dataset.pipelines._core`) over every
component::

    batches = build_mixture_batches({"vlm": "subsets/vlm", "text": "snapshots/puzzle-kd"},
                                    weights={"vlm": 0.7, "text": 0.3}, spec=spec, batch_size=1,
                                    processor="qwen2_5_vl/", cache_dir="stores", dp_rank=r, dp_size=w)

1. Each component is resolved as its own pipeline resolves it: a token store or a text snapshot (tokenised
   into a store in ``cache_dir`` with ``tokenizer``; in a multimodal mixture with the processor's tokenizer
   and chat template), a VLM store or a conversation subset (with ``processor``). All components must share
   one tokenizer (vocabulary, special tokens, chat template).
2. Each is planned as its pipeline plans it (packs from the plan cache, never cutting an image).
3. The components' rows become one stream whose every prefix holds each component's share of the real
   tokens (`puzzletron.dataset.packing.mixture`), per epoch, computed once and mapped by every rank
   (`puzzletron.dataset.packing.mixture_plan`).
4. The stream is dealt to steps and ranks by `MixtureSampler`: every rank of a step holds an image or none
   does, ranks even, resumable at any DP size.
5. A batch is built when its key is read (`MixtureBatches`), with its media in a multimodal mixture.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from puzzletron.dataset._checks import require_positive
from puzzletron.dataset.batch import Modality
from puzzletron.dataset.config import PuzzletronDataSpec, TokenizeOptions, as_spec
from puzzletron.dataset.distributed.mixture_sampler import MixtureSampler
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.formats.subset import SUBSET_FORMAT
from puzzletron.dataset.formats.vlm_store import VLM_STORE_FORMAT
from puzzletron.dataset.packing.mixture import MixtureWeights
from puzzletron.dataset.packing.mixture_plan import ComponentReport, MixtureComponent, MixturePlan
from puzzletron.dataset.pipelines._batches import RankBatches
from puzzletron.dataset.pipelines._core import (
    Component,
    SourceOptions,
    check_device_resize,
    component_plan,
    is_token_store,
    pack_loads,
    store_format,
    text_component,
    vlm_component,
)
from puzzletron.dataset.pipelines._mixture_batches import MixtureBatches, supervised_tokens
from puzzletron.dataset.pipelines._mixture_checks import check_tokenizers, plan_folder
from puzzletron.dataset.pipelines._report import is_rank_zero, log_mixture
from puzzletron.dataset.tokenize.matching import UNSAID_SPLIT

__all__ = ["MixtureRankBatches", "build_mixture_batches"]

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class MixtureRankBatches(RankBatches):
    """A mixture ready to train on (`RankBatches`): ``plan`` is the `MixturePlan` (``plan.report()``: per
    component samples available and used, passes, tokens, share asked and achieved), ``sampler`` a
    `MixtureSampler`, ``components`` the resolved sources by name."""

    components: Mapping[str, Component]

    def report(self, epoch: int = 0) -> tuple[ComponentReport, ...]:
        """`MixturePlan.report` with each component's supervised tokens counted (reads the labels of every
        row the epoch takes: O(its tokens))."""
        out = []
        for c, entry in enumerate(self.plan.report(epoch)):
            rows, times = self.plan.rows_used(epoch, c)
            supervised = supervised_tokens(self.dataset, c, rows, times)
            out.append(dataclasses.replace(entry, supervised_tokens=supervised))
        return tuple(out)


def _resolve(name: str, source: Any, how: SourceOptions, *, multimodal: bool) -> Component:
    """Component ``name``: a VLM store or subset (multimodal mixtures only), else a text source (in a
    multimodal mixture tokenised with the processor's tokenizer and chat template)."""
    if not isinstance(source, str | Path):
        raise ConfigError(
            f"component {name!r}: give a store, snapshot or subset path, got {type(source).__name__}"
        )
    fmt = store_format(source)
    if fmt in (VLM_STORE_FORMAT, SUBSET_FORMAT):
        if not multimodal:
            kind = "a VLM store" if fmt == VLM_STORE_FORMAT else "a conversation subset"
            raise ConfigError(
                f"component {name!r} ({source}) is {kind}: its batches hold images, but data.modality is "
                "text; use data.modality: multimodal (and a processor) for a mixture with images"
            )
        return vlm_component(source, how)
    processor = how.processor
    # a snapshot is tokenised with the processor's tokenizer; a store is checked against the others
    if how.tokenizer is None and multimodal and processor is not None and not is_token_store(source):
        how = dataclasses.replace(
            how, tokenizer=processor if isinstance(processor, str | Path) else processor.tokenizer
        )
    return text_component(source, how)


def _rows(name: str, component: Component, plan: Any, spec: PuzzletronDataSpec) -> MixtureComponent:
    """Component ``name`` as the mixture plans it: its rows' real and image tokens."""
    loads = pack_loads(component, plan)  # [rows, 2] int32
    real = loads[:, 1]
    if plan is None:  # one sample a row: the unpacked layouts truncate at max_sample_length
        real = np.minimum(real, int(spec.max_sample_length)).astype(np.int32)
    if real.shape[0] == 0:
        raise ConfigError(
            f"component {name!r} has no usable sample (every sample was dropped or skipped); check its "
            "source, data.packing.pack_size and data.packing.long_samples"
        )
    return MixtureComponent(
        name=name,
        plan=plan,
        row_tokens=real,
        image_tokens=loads[:, 0],
        samples=len(component.samples),
    )


def _check_media(components: Mapping[str, Component]) -> None:
    """A multimodal mixture holds a VLM component, and each one's images can be read."""
    if not any(c.is_vlm for c in components.values()):
        raise ConfigError(
            "data.modality is multimodal but no component holds images; use data.modality: text for a "
            "mixture of text stores"
        )
    for name, c in components.items():
        if c.is_vlm and c.media is None:
            raise ConfigError(
                f"component {name!r} is a VLM store: give subsets={{{name!r}: SUBSET}}, the subset its "
                "images are read from (or give the subset itself as the source)"
            )


def build_mixture_batches(
    sources: Mapping[str, str | Path],
    *,
    weights: Any,
    spec: PuzzletronDataSpec,
    batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    num_tokens: int | None = None,
    tokenizer: str | Path | Any = None,
    processor: str | Path | Any = None,
    cache_dir: str | Path | None = None,
    split: str = UNSAID_SPLIT,
    subsets: Mapping[str, str | Path] | None = None,
    num_proc: int = 1,
    options: TokenizeOptions = TokenizeOptions(),
    pad_to_multiple_of: int = 1,
    pixel_dtype: torch.dtype = torch.float32,
    plan_cache: str | Path | None = None,
    device_resize: bool = False,
) -> MixtureRankBatches:
    """Components + weights + `PuzzletronDataSpec` -> this DP rank's batches of one token-weighted stream.

    ``sources``: component name -> a token store, a VLM store, a text snapshot (``split`` of it, tokenised
    with ``tokenizer``) or a conversation subset (with ``processor``); stores are found or built once in
    ``cache_dir``. ``subsets``: component name -> the subset a VLM store's images are read from (a subset
    source is its own). ``weights``: name -> share of real tokens (image tokens included), normalised; or a
    schedule ``[(from_token, {name: weight}), ...]`` whose shares change once that many real tokens of the
    epoch were delivered. ``num_tokens``: the epoch's real tokens (components repeated as needed, each pass
    reshuffled); None: the epoch ends where the first component's pass is used up at its share. Layouts,
    ``batch_size``, ``seed``, ``drop_last``, ``pad_to_multiple_of``, ``pixel_dtype`` and ``device_resize``
    as in `build_batches` / `build_vlm_batches`; ``spec.modality`` multimodal for a mixture with images.
    """
    spec = as_spec(spec, owner="build_mixture_batches")
    multimodal = Modality(spec.modality) is Modality.MULTIMODAL
    if not isinstance(sources, Mapping) or not sources:
        raise ConfigError("sources must map each component name to its store, snapshot or subset")
    names = tuple(str(n) for n in sources)
    mix = MixtureWeights.parse(names, weights)
    require_positive(pad_to_multiple_of, "pad_to_multiple_of", error=ConfigError)
    check_device_resize(device_resize, pixel_dtype)
    if multimodal and processor is None:
        raise ConfigError("a multimodal mixture needs processor= (its images' and texts' tokenizer)")
    unknown = sorted(set(subsets or {}) - set(names))
    if unknown:
        raise ConfigError(f"subsets names unknown component(s) {unknown}; the components are {list(names)}")
    report = is_rank_zero(dp_rank)
    how = SourceOptions(
        tokenizer, processor, split=split, options=options, pixel_dtype=pixel_dtype, report=report
    )
    how = dataclasses.replace(how, cache_dir=cache_dir, num_proc=num_proc, device_resize=device_resize)
    components = {
        name: _resolve(
            name, source, dataclasses.replace(how, subset=(subsets or {}).get(name)), multimodal=multimodal
        )
        for name, source in sources.items()
    }
    check_tokenizers(components, tokenizer=tokenizer)
    plans = {
        name: component_plan(c, spec, seed=seed, cache=plan_cache, cache_dir=cache_dir)
        for name, c in components.items()
    }
    rows = tuple(_rows(name, components[name], plans[name], spec) for name in names)
    row_size = int(spec.packing.pack_size) if spec.packing is not None else int(spec.max_sample_length)
    plan = MixturePlan(
        rows,
        mix,
        seed=seed,
        row_size=row_size,
        shuffle=shuffle,
        num_tokens=num_tokens,
        cache=plan_folder(plan_cache, cache_dir, [c.store for c in components.values()]),
    )
    vlm = [c for c in components.values() if c.is_vlm]
    if multimodal:
        _check_media(components)
    dataset = MixtureBatches(
        names,
        tuple(components[n].samples for n in names),
        tuple(plans[n] for n in names),
        plan.offsets,
        spec,
        pad_token_id=next(iter(components.values())).pad_token_id,
        pad_to_multiple_of=pad_to_multiple_of,
        media=tuple(components[n].media for n in names) if multimodal else None,
        image_token_id=vlm[0].store.image_token_id if vlm else -1,
        merge_size=vlm[0].store.merge_size if vlm else 1,
    )
    sampler = MixtureSampler(
        plan, batch_size=batch_size, dp_rank=dp_rank, dp_size=dp_size, drop_last=drop_last
    )
    if report:
        log_mixture(plan, sampler)
    return MixtureRankBatches(plan=plan, dataset=dataset, sampler=sampler, components=components)

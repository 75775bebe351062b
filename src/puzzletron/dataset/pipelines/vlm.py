"""From a conversation subset (or its VLM store) to this DP rank's multimodal batches: planned once, exact.

`build_vlm_batches` is the one call::

    batches = build_vlm_batches("subsets/vlm", processor="qwen2_5_vl/", spec=spec, batch_size=1,
                                dp_rank=rank, dp_size=world, cache_dir="stores/")
    for batch in batches.loader(num_workers=2): ...      # PuzzletronBatch, modality multimodal

1. The subset is tokenised once into a content-addressed VLM store in ``cache_dir``
   (`puzzletron.dataset.tokenize.vlm_store`; shared by every rank and restart; under an initialised
   `torch.distributed` group the ranks share the work). A VLM store folder is used as it is.
2. The plan comes from the store's exact lengths (`puzzletron.dataset.packing.media.plan_vlm`): no estimate,
   no pack over ``pack_size``, no empty pack, long samples per ``long_samples`` (never cut through an
   image), counted in ``.plan``. Planning needs no processor and reads only the store's index.
3. The packs are dealt to steps and ranks by `DistributedPackSampler`: with ``balance=True`` a media-balanced
   deal (`puzzletron.dataset.packing.balance`) that evens image and real tokens across the ranks of a step
   and over the epoch, from a seeded shuffle.
4. A batch is built when its key is read (in DataLoader workers): tokens from the store, then pixels, grids
   and multi-axis position ids (`puzzletron.dataset.pipelines._vlm_media`).

Layouts: ``packed_varlen`` (the point), ``padded_varlen`` and ``fixed`` (one sample a row).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from puzzletron.dataset._checks import require_positive
from puzzletron.dataset.batch import Modality
from puzzletron.dataset.config import PuzzletronDataSpec, as_spec
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.formats.vlm_store import VlmStore
from puzzletron.dataset.pipelines._batches import RankBatches
from puzzletron.dataset.pipelines._core import (
    DealOptions,
    SourceOptions,
    check_device_resize,
    component_plan,
    deal,
    pack_loads,
    vlm_component,
)
from puzzletron.dataset.pipelines._vlm_media import VlmPackedBatches
from puzzletron.dataset.tokenize.vlm_store import DEFAULT_ROWS_PER_SHARD

__all__ = ["VlmBatches", "build_vlm_batches"]


@dataclass(frozen=True, eq=False)
class VlmBatches(RankBatches):
    """A subset ready to train a VLM on: tokenised (``store``), planned (``plan``: packs, or one sample a
    row), dealt to one DP rank (``sampler``), batches built by ``dataset`` (`RankBatches`)."""

    store: VlmStore


def build_vlm_batches(
    source: str | Path,
    *,
    processor: Any,
    spec: PuzzletronDataSpec,
    batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    num_proc: int = 1,
    cache_dir: str | Path | None = None,
    subset: str | Path | None = None,
    pad_to_multiple_of: int = 1,
    pixel_dtype: torch.dtype = torch.float32,
    balance: bool = True,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    plan_cache: str | Path | None = None,
    draft: bool = False,
    device_resize: bool = False,
) -> VlmBatches:
    """Subset (or VLM store) + processor + `PuzzletronDataSpec` -> this DP rank's multimodal batches.

    ``source``: a conversation subset folder (then ``processor`` builds or reuses its VLM store in
    ``cache_dir``, by default `default_cache_dir` (``PUZZLETRON_CACHE_DIR``, logged); ``num_proc``
    processes, ``rows_per_shard`` part of its identity) or a VLM store folder (planning then needs no
    processor; building batches needs ``processor`` and the subset the store was built from, whose images it
    reads: by default where it was then, recorded in the store and checked by its manifest's SHA-256;
    ``subset=`` for one that moved). ``spec``: a `PuzzletronDataSpec` or its ``data:`` mapping.
    ``processor``: an HF processor object or a local
    directory (Qwen2-VL, Qwen2.5-VL, Qwen3-VL); it must be the store's. ``spec.modality`` is multimodal;
    layouts as in `build_batches` (``pad_to_multiple_of`` for ``padded_varlen``). ``batch_size`` rows per
    batch per rank; ``seed`` orders the packs and the epochs' deals; ``balance`` evens image and real tokens
    across the ranks of a step (``shuffle=False`` keeps the plan's order). ``pixel_dtype``: the dtype of
    ``pixel_values`` (the processor gives float32; ``torch.bfloat16`` halves the bytes; ``torch.uint8``, a
    quarter, the resized values: `clients.attention.model_inputs` rescales and normalises them on the
    device, exactly). ``draft``: decode a JPEG at a reduced size where the processor's target side is at
    most half the source (`conversation.images.decode_rgb`; not bit-exact, opt-in). ``device_resize``
    (with ``pixel_dtype=torch.uint8``): workers only decode; ``pixel_values`` is then a list of the decoded
    images (uint8 ``[H, W, 3]``, one an image, none with more bytes than its uint8 patches) that
    `clients.attention.model_inputs` resizes, patchifies and normalises after ``.to(device)``, bit for bit
    the processor's output (a plain ``Qwen2VLImageProcessorPil`` only; for batches bound to an accelerator:
    on a CPU that resize costs about 10x Pillow's). A packed plan is
    planned once and memory-mapped by every rank and restart (`puzzletron.dataset.packing.plan_cache`): in
    ``plan_cache``, by default ``cache_dir/.plans``, else ``.<store name>.plans`` beside the store (planned
    in memory when that folder cannot be written).
    """
    spec = as_spec(spec, owner="build_vlm_batches")
    if Modality(spec.modality) is not Modality.MULTIMODAL:
        raise ConfigError(
            f"build_vlm_batches builds multimodal batches; data.modality is {Modality(spec.modality).value}"
        )
    if not isinstance(pixel_dtype, torch.dtype) or not (
        pixel_dtype.is_floating_point or pixel_dtype == torch.uint8
    ):
        raise ConfigError(f"pixel_dtype must be a floating torch.dtype or torch.uint8; got {pixel_dtype!r}")
    check_device_resize(device_resize, pixel_dtype)
    require_positive(pad_to_multiple_of, "pad_to_multiple_of", error=ConfigError)
    how = SourceOptions(processor=processor, subset=subset, rows_per_shard=rows_per_shard, draft=draft)
    how = replace(how, pixel_dtype=pixel_dtype, device_resize=device_resize)
    component = vlm_component(source, replace(how, cache_dir=cache_dir, num_proc=num_proc))
    plan = component_plan(component, spec, seed=seed, cache=plan_cache, cache_dir=cache_dir)
    dataset = VlmPackedBatches(
        component.samples,
        spec,
        plan,
        pad_token_id=component.pad_token_id,
        pad_to_multiple_of=pad_to_multiple_of,
        media=component.media,
    )
    loads = pack_loads(component, plan) if balance else None
    options = DealOptions(batch_size, dp_rank, dp_size, seed, shuffle, drop_last)
    sampler = deal(plan.num_rows, options, loads=loads)
    return VlmBatches(plan=plan, dataset=dataset, sampler=sampler, store=component.store)

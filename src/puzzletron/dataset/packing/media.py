"""Planning multimodal samples from their exact lengths: packs (``packed_varlen``) or one sample a row
(``padded_varlen``, ``fixed``), never cutting through an image's tokens. Pure functions of integers.

A VLM sample's length is exact (the VLM store expands every image placeholder as the processor does), so
the planner packs with no estimate and no headroom beyond ``packing_ratio``, whose seed meaning holds: rows
are filled to at most ``floor(pack_size * packing_ratio)`` tokens (a single sample longer than that but not
than ``pack_size`` still gets a row of its own). No row exceeds ``pack_size``, no row is empty.

Samples longer than the row (``pack_size``; ``max_sample_length`` for the unpacked layouts) follow
``long_samples`` at plan time, counted in the plan (``dropped``, ``cut_samples``, ``cut_tokens``):

- ``drop`` / ``raise``: as for text;
- ``truncate``: the first ``pack_size`` tokens, only when every image token is among them (``media_end <=
  pack_size``): the cut falls in the text after the last image. A sample whose images reach past the row
  is dropped and counted instead;
- ``split``: refused (a piece after the first would hold image tokens whose image, and the text before it,
  are in another document).

The unpacked layouts truncate the same way (text after the last image only), dropping what they cannot.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from puzzletron.dataset._checks import require_seed
from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.errors import ConfigError, PackingError
from puzzletron.dataset.packing._plan import IndexSequence, PackingPlan, plan_packing
from puzzletron.dataset.packing._sort import chunks
from puzzletron.dataset.packing._units import cut_long_samples

__all__ = ["check_vlm_packing", "plan_vlm", "row_sums"]


def row_sums(plan: PackingPlan, per_sample: np.ndarray) -> np.ndarray:
    """``[num_rows]`` int64: the sum of ``per_sample`` ``[N]`` (image tokens, say) over each row's samples
    (a cut unit counts its whole sample: truncation keeps every image)."""
    per_sample = np.asarray(per_sample)
    out = np.zeros(plan.num_rows, dtype=np.int64)
    for rows in chunks(plan.num_rows):  # a share of the samples at a time: bounded temporaries
        a, b = int(plan.row_offsets[rows.start]), int(plan.row_offsets[rows.stop])
        order = plan.sample_order[a:b]
        values = per_sample[order if plan.units is None else plan.units.sample[order]]
        starts = np.asarray(plan.row_offsets[rows.start : rows.stop]) - a
        out[rows] = np.add.reduceat(values, starts, dtype=np.int64)  # rows are never empty
    return out


def _single_rows(
    lengths: np.ndarray, media_end: np.ndarray, width: int, seed: int, sample_ids: Sequence[str] | None
) -> PackingPlan:
    """One sample (or its truncated unit) a row, in sample order: the unpacked layouts' plan."""
    units = cut_long_samples(lengths, width, "truncate", keep_at_least=media_end)
    planned = lengths.astype(np.int64) if units is None else units.length
    keep = np.flatnonzero(planned <= width)
    dropped = np.flatnonzero(planned > width)
    cut = (units.length < lengths) if units is not None else np.zeros(0, dtype=bool)
    rows = {  # one sample a row, in sample order
        "sample_order": keep.astype(np.int64),
        "row_offsets": np.arange(keep.size + 1, dtype=np.int64),
        "row_lengths": planned[keep],
    }
    for a in rows.values():
        a.setflags(write=False)
    return PackingPlan(
        pack_size=width,
        capacity=width,
        **rows,
        num_samples=int(lengths.shape[0]),
        total_tokens=int(rows["row_lengths"].sum()),
        dropped=IndexSequence(dropped),  # an array, not a Python int a dropped sample
        dropped_tokens=int(planned[dropped].sum()),
        seed=seed,
        policy="truncate",
        units=units,
        cut_samples=int(cut.sum()),
        cut_tokens=int((lengths[cut].astype(np.int64) - width).sum()),
    )


def check_vlm_packing(spec: PuzzletronDataSpec) -> None:
    """`ConfigError` for a packing the VLM path refuses: ``long_samples='split'`` (module docstring)."""
    if spec.packing is not None and spec.packing.long_samples == "split":
        raise ConfigError(
            "data.packing.long_samples='split' is not supported for multimodal samples: a piece after the "
            "first would hold image tokens without their image or the text before it; use 'truncate' (cuts "
            "only text after the last image), 'drop' or 'raise'"
        )


def plan_vlm(
    lengths: np.ndarray,
    media_end: np.ndarray,
    spec: PuzzletronDataSpec,
    *,
    seed: int = 0,
    sample_ids: Sequence[str] | None = None,
) -> PackingPlan:
    """The plan of multimodal samples of exact ``lengths`` ``[N]`` whose last image token ends at
    ``media_end`` ``[N]`` (0: no image), for ``spec``'s layout (see the module docstring): packs of
    ``spec.packing`` for ``packed_varlen`` (rows in a seeded order), else one sample a row in sample order
    (the sampler shuffles), ``pack_size`` = ``max_sample_length``."""
    seed = require_seed(seed, error=PackingError)
    lengths = np.asarray(lengths)
    media_end = np.asarray(media_end)
    if lengths.shape != media_end.shape:
        raise PackingError(f"{lengths.shape[0]} lengths but {media_end.shape[0]} media ends")
    if spec.packing is None:
        return _single_rows(lengths, media_end, int(spec.max_sample_length), seed, sample_ids)
    check_vlm_packing(spec)
    return plan_packing(
        lengths, spec.packing, estimated=True, seed=seed, sample_ids=sample_ids, keep_at_least=media_end
    )  # estimated=True: packing_ratio caps the fill (its seed meaning), though the lengths are exact

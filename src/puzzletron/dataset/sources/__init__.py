"""Bounded, pinned, offline snapshots of the Hub datasets the data stage trains on.

Three materialisers, one protocol (``docs/acquisition.md``; the Hub layouts they read: ``docs/sources.md``):

1. If the output directory already holds a snapshot, compare identities (the spec's fields minus
   ``output_dir``, the adapter name and the pinned revision): identical -> return it as is; different ->
   `SnapshotError` (a ``ValueError``: "... does not match requested acquisition ..."). With
   ``revision=None`` the snapshot's pinned revision is reused without any network call.
2. Otherwise resolve the revision to a commit sha (``None``/``"main"``/``"latest"`` -> current ``main``),
   then stream rows from the pinned revision, one whole shard at a time in a seeded order (mirrors ignore
   HTTP Range), stopping as soon as there are enough rows.
3. Write into a transaction directory and publish it with one rename: a failed or killed run leaves
   nothing at ``output_dir``.

Modules: `specs` (what to acquire), `quotas` (Nemotron-VLM's row split), `puzzle_kd`, `nemotron_vlm`,
`intersyn` (one per source), `published` (reuse of a snapshot at an URL), `_sources` (what they share),
`_hub` (the only module that talks to the Hub).
The snapshots are `puzzletron.dataset.formats`: a text snapshot (Puzzle-KD) and conversation subsets.

Quotas (Nemotron-VLM) are a pure largest-remainder split of the sample count over the subset weights:

>>> largest_remainder_quotas({"a": 10, "b": 30}, 7)
{'a': 2, 'b': 5}
"""

from __future__ import annotations

from puzzletron.dataset.conversation import INTERSYN_MULTI_DATASET as INTERSYN_MULTI_SOURCE
from puzzletron.dataset.conversation import INTERSYN_MULTI_REVISION, INTERSYN_SINGLE_REVISION
from puzzletron.dataset.conversation import INTERSYN_SINGLE_DATASET as INTERSYN_SINGLE_SOURCE
from puzzletron.dataset.formats.manifest import MANIFEST as MANIFEST_NAME
from puzzletron.dataset.formats.text_snapshot import verify_text_snapshot
from puzzletron.dataset.sources._common import PROGRESS_LOGGER, RejectedRow
from puzzletron.dataset.sources.intersyn import (
    INTERSYN_ADAPTER,
    intersyn_acquisition,
    materialize_intersyn_subset,
)
from puzzletron.dataset.sources.nemotron_vlm import hub_vlm_rows, materialize_nemotron_vlm_dataset
from puzzletron.dataset.sources.puzzle_kd import materialize_puzzle_kd_dataset
from puzzletron.dataset.sources.quotas import largest_remainder_quotas, redistribute_deficit
from puzzletron.dataset.sources.specs import (
    NEMOTRON_VLM_ADAPTER,
    PUZZLE_KD_ADAPTER,
    PUZZLE_KD_DATASET,
    TextAcquisitionSpec,
    VlmAcquisitionSpec,
)

__all__ = [
    "INTERSYN_ADAPTER",
    "INTERSYN_MULTI_REVISION",
    "INTERSYN_MULTI_SOURCE",
    "INTERSYN_SINGLE_REVISION",
    "INTERSYN_SINGLE_SOURCE",
    "MANIFEST_NAME",
    "NEMOTRON_VLM_ADAPTER",
    "PROGRESS_LOGGER",
    "PUZZLE_KD_ADAPTER",
    "PUZZLE_KD_DATASET",
    "RejectedRow",
    "TextAcquisitionSpec",
    "VlmAcquisitionSpec",
    "hub_vlm_rows",
    "intersyn_acquisition",
    "largest_remainder_quotas",
    "materialize_intersyn_subset",
    "materialize_nemotron_vlm_dataset",
    "materialize_puzzle_kd_dataset",
    "redistribute_deficit",
    "verify_text_snapshot",
]

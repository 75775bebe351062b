"""The offline conversation subset (``docs/subset-format.md``): normalised conversations in a JSONL file
with a binary offset index, every image a file, a manifest with every image's SHA-256.

Write with `materialize_normalized_conversation_samples`, read with `load_materialized_conversation_subset`
or `SubsetReader` (random access), check with `verify_subset`, summarise with `describe_subset`.
"""

from __future__ import annotations

from puzzletron.dataset.formats.manifest import MANIFEST, VerifyReport
from puzzletron.dataset.formats.subset._layout import (
    LEGACY_SAMPLES,
    SUBSET_FORMAT,
    SUBSET_FORMAT_VERSION,
    image_items,
    is_original_layout,
    is_sharded,
)
from puzzletron.dataset.formats.subset._manifest import manifest_sha256
from puzzletron.dataset.formats.subset.reader import (
    SubsetReader,
    load_materialized_conversation_subset,
    load_materialized_intersyn_subset,
    read_manifest,
    subset_manifest,
)
from puzzletron.dataset.formats.subset.verify import describe_subset, render_subset, verify_subset
from puzzletron.dataset.formats.subset.writer import (
    materialize_normalized_conversation_samples,
    materialize_normalized_intersyn_samples,
)

FORMAT = SUBSET_FORMAT  # the names under the subset's first import path
FORMAT_VERSION = SUBSET_FORMAT_VERSION

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "LEGACY_SAMPLES",
    "MANIFEST",
    "SUBSET_FORMAT",
    "SUBSET_FORMAT_VERSION",
    "SubsetReader",
    "VerifyReport",
    "describe_subset",
    "image_items",
    "is_original_layout",
    "is_sharded",
    "load_materialized_conversation_subset",
    "load_materialized_intersyn_subset",
    "manifest_sha256",
    "materialize_normalized_conversation_samples",
    "materialize_normalized_intersyn_samples",
    "read_manifest",
    "render_subset",
    "subset_manifest",
    "verify_subset",
]

"""The offline conversation subset (``docs/subset-format.md``): a thin re-export of `formats`' subset
modules, kept as the documented import path.

Write with `materialize_normalized_conversation_samples`, read with `load_materialized_conversation_subset`
or `SubsetReader`, check with `verify_subset`, summarise with `describe_subset`. The code lives in
`puzzletron.dataset.formats` (`subset_writer`, `subset_reader`, `subset_verify`).
"""

from __future__ import annotations

from puzzletron.dataset.formats._manifest import MANIFEST, VerifyReport
from puzzletron.dataset.formats._subset_layout import SUBSET_FORMAT as FORMAT
from puzzletron.dataset.formats._subset_layout import SUBSET_FORMAT_VERSION as FORMAT_VERSION
from puzzletron.dataset.formats.subset_reader import (
    SubsetReader,
    load_materialized_conversation_subset,
    load_materialized_intersyn_subset,
    read_manifest,
)
from puzzletron.dataset.formats.subset_verify import describe_subset, verify_subset
from puzzletron.dataset.formats.subset_writer import (
    materialize_normalized_conversation_samples,
    materialize_normalized_intersyn_samples,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "SubsetReader",
    "VerifyReport",
    "describe_subset",
    "load_materialized_conversation_subset",
    "load_materialized_intersyn_subset",
    "materialize_normalized_conversation_samples",
    "materialize_normalized_intersyn_samples",
    "read_manifest",
    "verify_subset",
]

"""`DataLayout` and `Modality`: the two enums of the batch vocabulary, in a module that imports nothing heavy
(a config or a packing plan needs them without loading torch). Re-exported by `puzzletron.dataset.batch`."""

from __future__ import annotations

from enum import Enum

__all__ = ["DataLayout", "Modality"]


class DataLayout(str, Enum):
    """How the tokens of a batch are laid out: ``[B, T]`` rows of one sample each, or packed samples."""

    FIXED = "fixed"
    PADDED_VARLEN = "padded_varlen"
    PACKED_VARLEN = "packed_varlen"


class Modality(str, Enum):
    TEXT = "text"
    MULTIMODAL = "multimodal"

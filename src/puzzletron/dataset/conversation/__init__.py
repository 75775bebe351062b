"""Conversations in AutoModel's normalised form: the source normalisers (InterSyn, Nemotron-VLM), the
checks every stored conversation passes (`normalize`), and image decoding (`images`, the only Pillow
importer: pixel and frame limits, bytes kept as they came when they decode cleanly)."""

from __future__ import annotations

from puzzletron.dataset.conversation import normalize as _normalize
from puzzletron.dataset.conversation.normalize import *  # noqa: F403 (the names in normalize.__all__)

__all__ = list(_normalize.__all__)

"""The VLM store: conversations of a subset tokenised with a processor's chat template, image placeholders
expanded as the processor expands them, read by positional reads. No pixels: images are referenced.

The format, with an example manifest: ``docs/vlm-store-format.md``. Built by
`puzzletron.dataset.tokenize.vlm_store`, verified by `verify` (``puzzletron-data verify`` / ``inspect``)::

    store = VlmStore("stores/vlm")
    store.lengths, store.image_tokens           # [n] uint32, memory-mapped: all a planner needs
    ids, mask = store.read(store.offsets[[3]], store.offsets[[4]])          # sample 3's tokens
    first, stop = store.image_offsets[3], store.image_offsets[4]            # its images
    store.grid[first:stop], store.image_refs(np.arange(first, stop))        # grids, (path, sha256)

A `VlmStore` is a `TokenStore` (the same shards and token index, read the same way) with the image table;
opening checks the manifest's format and version and every file's presence and size, and reads no token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.formats.binary import memmap_array, read_strings
from puzzletron.dataset.formats.token_store import TokenStore
from puzzletron.dataset.formats.vlm_store._layout import (
    GRID,
    IMAGE_OFFSETS,
    IMAGE_TOKENS,
    MEDIA_END,
    PATHS_BIN,
    PATHS_OFFSETS,
    SHA256,
    SKIP_REASONS,
    SKIPPED_REASONS,
    VLM_STORE_FORMAT,
    VLM_STORE_VERSION,
    read_complete_manifest,
)

__all__ = ["VLM_STORE_FORMAT", "VLM_STORE_VERSION", "VlmStore"]


class VlmStore(TokenStore):
    """A read-only view of the VLM store at `path`: a `TokenStore` plus the image table.

    Attributes beyond `TokenStore`'s: ``num_images``; ``processor`` (the manifest's processor facts: image
    token and id, patch and merge sizes, pixel limits); ``image_token_id``; ``merge_size``.
    """

    _complete_manifest = staticmethod(read_complete_manifest)

    def __init__(self, path: Any) -> None:
        super().__init__(path)
        self.num_images: int = self.manifest["counts"]["images"]
        self.processor: dict[str, Any] = dict(self.manifest["processor"])
        self.image_token_id: int = int(self.processor["image_token_id"])
        self.merge_size: int = int(self.processor["merge_size"])

    @property
    def image_offsets(self) -> np.ndarray:
        """``[n + 1]`` int64, read-only: sample ``i``'s images are ``image_offsets[i]`` up to
        ``image_offsets[i + 1]``."""
        return self._array(IMAGE_OFFSETS, "<i8", len(self) + 1)

    @property
    def image_tokens(self) -> np.ndarray:
        """``[n]`` uint32, read-only: image tokens of each sample."""
        return self._array(IMAGE_TOKENS, "<u4", len(self))

    @property
    def media_end(self) -> np.ndarray:
        """``[n]`` uint32, read-only: tokens of each sample through its last image token (0 without one);
        a truncation may cut only at or after it."""
        return self._array(MEDIA_END, "<u4", len(self))

    @property
    def grid(self) -> np.ndarray:
        """``[m, 3]`` uint32, read-only: ``(t, h, w)`` patches of every image (``image_grid_thw``)."""
        return self._array(GRID, "<u4", 3 * self.num_images).reshape(-1, 3)

    def image_refs(self, images: np.ndarray) -> list[tuple[str, str]]:
        """``(path inside the subset, SHA-256 hex)`` of the images ``images`` (indices into the table)."""
        idx = np.asarray(images, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_images):
            raise ConfigError(
                f"image indices must be in [0, {self.num_images}); got {idx.min()}..{idx.max()}"
            )
        offsets = self._array(PATHS_OFFSETS, "<i8", self.num_images + 1)
        paths = read_strings(self.path / PATHS_BIN, offsets, idx)
        digests = self._array(SHA256, "u1", 32 * self.num_images).reshape(-1, 32)[idx]
        return [(p, bytes(d).hex()) for p, d in zip(paths, digests, strict=True)]

    def skipped_reasons(self) -> list[str]:
        """Why each skipped row was not kept (``SKIP_REASONS``), in row order with `skipped_ids`."""
        codes = memmap_array(self.path / SKIPPED_REASONS, "u1", self.skipped)
        return [SKIP_REASONS[int(c)] for c in codes]

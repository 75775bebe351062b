"""The VLM store: conversations of a subset tokenised with a processor's chat template, image placeholders
expanded as the processor expands them, read by positional reads, every byte checked before it is served.
No pixels: images are referenced.

The format, with an example manifest: ``docs/vlm-store-format.md``. Built by
`puzzletron.dataset.tokenize.vlm_store`, verified by `verify` (``puzzletron-data verify`` / ``inspect``)::

    store = VlmStore("stores/vlm")
    store.lengths, store.image_tokens           # [n] uint32: all a planner needs
    ids, mask = store.read(store.offsets[[3]], store.offsets[[4]])          # sample 3's tokens
    first, stop = store.image_offsets[3], store.image_offsets[4]            # its images
    store.grid[first:stop], store.image_refs(np.arange(first, stop))        # grids, (path, sha256)

Trust (``docs/trust-model.md``): opening checks every field of the manifest, that the files are this
layout's with the sizes the counts imply, that ``tokens/manifest.json`` has its recorded SHA-256 and the
token store's identity follows from this one; the tokens are a `TokenStore` (its own checks, pins and block
checksums); the media files are pinned (`storage.local.LocalFiles`) and each is verified against its block
checksums (whose SHA-256 the manifest records) the first time it is used.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.formats import blocks as _blocks
from puzzletron.dataset.formats.subset import manifest_sha256
from puzzletron.dataset.formats.token_store import TokenStore, read_strings
from puzzletron.dataset.formats.vlm_store import _layout as layout
from puzzletron.dataset.formats.vlm_store._layout import VLM_STORE_FORMAT, VLM_STORE_VERSION
from puzzletron.dataset.storage.objects import is_url
from puzzletron.dataset.storage.sources import open_source

__all__ = ["VLM_STORE_FORMAT", "VLM_STORE_VERSION", "VlmStore"]


class VlmStore:
    """A read-only view of the VLM store at `path` (a folder, or an URL prefix read through the node's
    object cache, every object pinned by its ETag: ``docs/object-storage.md``): its tokens (``tokens``, a
    `TokenStore`, whose ``lengths``, ``offsets``, ``read``, ``sample``, ``sample_ids`` and ``skipped_ids``
    this store serves) plus the image table.

    Attributes: ``path`` (absolute), ``manifest`` (the VLM manifest, every field checked), ``num_tokens``,
    ``pad_token_id``, ``skipped``, ``num_images``, ``processor`` (the manifest's processor facts: image
    token and id, patch and merge sizes, pixel limits), ``image_token_id``, ``merge_size``. Picklable
    (DataLoader workers): a copy carries the pins and checksums and reopens files lazily.
    """

    def __init__(self, path: str | Path) -> None:
        self.path: Any = layout.local_root(path)
        self._files = open_source(self.path)
        self.manifest = layout.read_complete_manifest(self.path, self._files)
        self.tokens = TokenStore(layout.at(self.path, layout.TOKENS))
        counts, recorded = self.manifest["counts"], self.tokens.manifest
        if recorded["identity"] != layout.token_identity(self.manifest["identity"]) or any(
            recorded["counts"][k] != counts[k] for k in ("rows", "samples", "skipped")
        ):
            raise SnapshotError(f"{self.path}: {layout.TOKENS}/ is not this VLM store's token store")
        self.num_tokens: int = self.tokens.num_tokens
        self.pad_token_id: int = self.tokens.pad_token_id
        self.skipped: int = counts["skipped"]
        self.num_images: int = counts["images"]
        self.processor: dict[str, Any] = dict(self.manifest["processor"])
        self.image_token_id: int = self.processor["image_token_id"]
        self.merge_size: int = self.processor["merge_size"]
        for record in self.manifest["files"]:  # pinned before a byte is read
            if record["path"] != layout.TOKENS_MANIFEST:
                self._files.pin(record["path"])
        raw = self._files.read_bytes(layout.BLOCKS)
        if hashlib.sha256(raw).hexdigest() != next(
            r["sha256"] for r in self.manifest["files"] if r["path"] == layout.BLOCKS
        ):
            raise SnapshotError(f"{self.path}: {layout.BLOCKS} differs from the SHA-256 the manifest records")
        self._checks = _blocks.BlockChecks(
            self._files, layout.block_files(self.manifest), np.frombuffer(raw, "<u8"), where=str(self.path)
        )
        self._arrays: dict[str, np.ndarray] = {}

    def recorded_subset(self) -> Path | str | None:
        """The subset the store was built from where it was then (the manifest's ``subset_path``: a folder
        or an URL), if it is still that subset there (its ``manifest.json`` has the SHA-256 the identity
        records); else None."""
        recorded = self.manifest.get(layout.SUBSET_PATH)
        if not recorded:
            return None
        location: Path | str = recorded if is_url(recorded) else Path(recorded)
        wanted = self.manifest["identity"]["subset"]["manifest_sha256"]
        return location if manifest_sha256(location) == wanted else None  # moved or changed: None

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"VlmStore({str(self.path)!r}, samples={len(self)}, images={self.num_images})"

    def _array(self, rel: str, dtype: str, count: int) -> np.ndarray:
        """Media file `rel` as a read-only ``[count]`` map, every block verified on first use."""
        array = self._arrays.get(rel)
        if array is None:
            self._checks.ensure_file(rel)
            array = self._arrays[rel] = self._files.map(rel, dtype, count)
        return array

    # the tokens: the token store's
    @property
    def lengths(self) -> np.ndarray:
        """``[n]`` uint32, read-only (verified): tokens of each sample, image tokens included."""
        return self.tokens.lengths

    @property
    def offsets(self) -> np.ndarray:
        """``[n + 1]`` int64, read-only (verified): the global token offset of each sample."""
        return self.tokens.offsets

    def read(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Token ranges concatenated: ``(ids int64 [sum], mask bool [sum])`` (`TokenStore.read`)."""
        return self.tokens.read(starts, stops)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.tokens.sample(index)

    def sample_ids(self, indices: Any) -> list[str]:
        """The ids (``"<subset index>:<row id>"``) of samples `indices`."""
        return self.tokens.sample_ids(indices)

    def skipped_ids(self) -> list[str]:
        """The ids of the subset rows not kept, in row order (their reasons: `skipped_reasons`)."""
        return self.tokens.skipped_ids()

    # the image table
    @property
    def image_offsets(self) -> np.ndarray:
        """``[n + 1]`` int64, read-only: sample ``i``'s images are ``image_offsets[i]`` up to
        ``image_offsets[i + 1]``."""
        offsets = self._array(layout.IMAGE_OFFSETS, "<i8", len(self) + 1)
        if offsets[0] != 0 or offsets[-1] != self.num_images:
            raise SnapshotError(
                f"{self.path}: {layout.IMAGE_OFFSETS} does not run from 0 to the {self.num_images} images"
            )
        return offsets

    @property
    def image_tokens(self) -> np.ndarray:
        """``[n]`` uint32, read-only: image tokens of each sample."""
        return self._array(layout.IMAGE_TOKENS, "<u4", len(self))

    @property
    def media_end(self) -> np.ndarray:
        """``[n]`` uint32, read-only: tokens of each sample through its last image token (0 without one);
        a truncation may cut only at or after it."""
        return self._array(layout.MEDIA_END, "<u4", len(self))

    @property
    def grid(self) -> np.ndarray:
        """``[m, 3]`` uint32, read-only: ``(t, h, w)`` patches of every image (``image_grid_thw``)."""
        return self._array(layout.GRID, "<u4", 3 * self.num_images).reshape(-1, 3)

    def image_refs(self, images: Any) -> list[tuple[str, str]]:
        """``(path inside the subset, SHA-256 hex)`` of the images ``images`` (indices into the table)."""
        idx = np.asarray(images, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_images):
            raise ConfigError(
                f"image indices must be in [0, {self.num_images}); got {idx.min()}..{idx.max()}"
            )
        paths = read_strings(self._files, self._checks, (layout.PATHS_OFFSETS, layout.PATHS_BIN), idx)
        digests = self._array(layout.SHA256, "u1", 32 * self.num_images).reshape(-1, 32)[idx]
        return [(p, bytes(d).hex()) for p, d in zip(paths, digests, strict=True)]

    def skipped_reasons(self) -> list[str]:
        """Why each skipped row was not kept (``SKIP_REASONS``), in row order with `skipped_ids`."""
        codes = self._array(layout.SKIPPED_REASONS, "u1", self.skipped)
        if codes.size and int(codes.max()) >= len(layout.SKIP_REASONS):
            raise SnapshotError(f"{self.path}: {layout.SKIPPED_REASONS} holds an unknown reason")
        return [layout.SKIP_REASONS[c] for c in codes.tolist()]

    def close(self) -> None:
        """Close the open files and drop the maps (the store stays usable: they reopen, pinned)."""
        self._arrays = {}
        self._files.close()
        self.tokens.close()

    def __enter__(self) -> VlmStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_arrays": {}}

"""The media of a multimodal batch, added at batch time (in DataLoader workers): pixels, grids, mRoPE ids.

`VlmPackedBatches` is the keyed dataset of the VLM pipeline: `PackedBatches` builds the token part from the
VLM store (ids, shifted labels, masks, packing metadata, in the layout of the spec), then `VlmMedia.attach`
adds, for the images of the batch's samples in token order:

- the image files, read from the subset, each checked against the SHA-256 the store recorded, decoded as
  transformers' ``load_image`` decodes them (`conversation.images.decode_rgb`: EXIF orientation, RGB) and run
  through the image processor in one call: ``pixel_values`` ``[patches, 3 * temporal_patch * patch**2]`` in
  ``pixel_dtype`` and ``image_grid_thw`` ``[images, 3]`` (which must be the grids the store holds); with
  ``pixel_dtype=torch.uint8`` the resized values before rescale and normalise, and ``source_metadata``
  gains ``pixel_normalization`` (`tokenize._pixels.normalize_pixels` applies it after ``.to(device)``);
  with ``device_resize`` the decoded images themselves (a list of uint8 ``[H, W, 3]``, each at its own or
  its target size: `VlmProcessor.decoded`), resized there too (``pixel_resize``: the grid facts);
- ``position_ids`` ``[3, B, T]``: the model's multi-axis positions, every document from 0 (`mrope_ids`),
  0 on padding; ``mm_token_type_ids`` ``[B, T]`` (1 on image tokens);
- ``sequence.media_counts`` / ``media_offsets``: images per row, so every split keeps an image with its
  sample; ``modality`` multimodal.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from puzzletron.dataset.batch import Modality, PuzzletronBatch
from puzzletron.dataset.batch.segments import media_offsets_from_counts
from puzzletron.dataset.conversation.images import decode_rgb, shown_size
from puzzletron.dataset.distributed import BatchKey, PackedBatches
from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.formats.binary import ragged_arange
from puzzletron.dataset.formats.manifest import inside
from puzzletron.dataset.formats.media_shards import MediaShards
from puzzletron.dataset.formats.subset import is_sharded, manifest_sha256, subset_manifest
from puzzletron.dataset.formats.vlm_store import VlmStore
from puzzletron.dataset.packing import Units, mrope_ids
from puzzletron.dataset.storage.local import LocalFiles
from puzzletron.dataset.storage.objects import is_url
from puzzletron.dataset.storage.sources import open_source
from puzzletron.dataset.tokenize import VlmProcessor, pixel_normalization, vlm_processor

__all__ = [
    "MEDIA_CHUNK",
    "VlmMedia",
    "VlmPackedBatches",
    "check_processor",
    "check_subset",
    "subset_location",
]

MEDIA_CHUNK = 256 << 10  # bytes an URL subset's images are fetched and cached in (an image is ~0.1-1 MiB)


def subset_location(path: str | Path) -> Path | str:
    """A subset's location as the pixel path keeps it: an absolute folder or an URL."""
    return str(path).rstrip("/") if is_url(path) else Path(os.path.abspath(path))


def check_subset(store: VlmStore, subset: Path | str) -> None:
    """`SnapshotError` unless `subset` (a folder or an URL) is the subset the store was built from (its
    manifest's SHA-256)."""
    if manifest_sha256(subset) != store.manifest["identity"]["subset"]["manifest_sha256"]:
        raise SnapshotError(f"{subset} is not the subset the VLM store {store.path} was built from")


def check_processor(store: VlmStore, parts: VlmProcessor) -> None:
    """`ConfigError` unless `parts` is the processor the store's tokens, grids and pixels were built with
    (image token, patch and merge sizes, pixel limits, every pixel setting: `VlmProcessor.differences`)."""
    differing = parts.differences(store.processor)
    if differing:
        raise ConfigError(
            f"the processor does not match the VLM store {store.path} ({'; '.join(differing)}); pass the "
            "processor the store was built with"
        )


@dataclass(frozen=True)
class VlmMedia:
    """What adding media needs: the store, the subset holding the images, the processor (a directory
    path is loaded once per process), the dtype of ``pixel_values`` (``torch.uint8``: the resized values,
    normalised later by `clients.attention.model_inputs`), ``draft`` (decode a JPEG at a reduced size
    where the processor's target side is at most half the source: not bit-exact, opt-in) and
    ``device_resize`` (uint8 only: ship the decoded images, resized on the device, bit for bit)."""

    store: VlmStore
    subset: Path | str  # a folder, or an URL prefix (its objects read through the node's cache)
    processor: Any
    pixel_dtype: torch.dtype = torch.float32
    draft: bool = False
    device_resize: bool = False

    @functools.cached_property
    def parts(self) -> VlmProcessor:
        """The processor's parts, resolved once per process (a directory is hashed to find its cache entry:
        milliseconds for a real tokenizer, so not once a batch)."""
        return vlm_processor(self.processor)

    @functools.cached_property
    def shards(self) -> MediaShards | None:
        """The subset's media shards (a version-3 subset), None when its images are files."""
        manifest = subset_manifest(self.subset, records=False, source=self.files)
        if not is_sharded(manifest):
            return None
        return MediaShards(self.files, manifest["media"], where=str(self.subset))

    @functools.cached_property
    def files(self) -> Any:
        """The subset's `storage.sources.ByteSource`: an URL's reads images in `MEDIA_CHUNK` ranges through
        the node's cache (a rank fetches its images, not the shards around them)."""
        if isinstance(self.subset, str):
            return open_source(self.subset, chunk_size=MEDIA_CHUNK)
        return LocalFiles(self.subset)

    def _ordinals(self, images: np.ndarray) -> np.ndarray:
        """The subset image order of the store's images ``images``: image ``k`` of store sample ``s`` is
        image ``k`` of the subset row its id names (``"<subset index>:<row id>"``)."""
        offsets = self.store.image_offsets
        owner = np.searchsorted(offsets, images, side="right") - 1
        unique, back = np.unique(owner, return_inverse=True)
        rows = np.asarray([int(name.split(":", 1)[0]) for name in self.store.sample_ids(unique)], np.int64)
        first = np.asarray(self.shards.sample_images(), np.int64)[rows]  # type: ignore[union-attr]
        return first[back] + (images - np.asarray(offsets[owner], np.int64))

    def blobs(self, images: np.ndarray) -> list[bytes]:
        """The encoded bytes of the images ``images`` (indices into the store's image table), each checked
        against the SHA-256 the store recorded (from a file, or its range of a media shard)."""
        refs = self.store.image_refs(images)
        if self.shards is not None:
            data = self.shards.read(self._ordinals(np.asarray(images, np.int64)))
        else:
            data = [
                self._file(rel, int(index)) for index, (rel, _) in zip(images.tolist(), refs, strict=True)
            ]
        for index, (rel, digest), blob in zip(images.tolist(), refs, data, strict=True):
            if hashlib.sha256(blob).hexdigest() != digest:
                raise SnapshotError(f"{self.subset}: image {rel!r} (image {index} of the VLM store): SHA-256 "
                                    "differs from the one the store recorded (changed?)")  # fmt: skip
        return data

    def _file(self, rel: str, index: int) -> bytes:
        where = f"{self.subset}: image {rel!r} (image {index} of the VLM store)"
        if isinstance(self.subset, str):  # an object of the subset: a relative name, no '..'
            inside(Path("/"), rel, where, noun="image path")
            return self.files.read_bytes(rel)
        path = inside(self.subset, rel, where, noun="image path")
        try:
            return path.read_bytes()
        except OSError as exc:
            raise SnapshotError(f"{where}: cannot read it: {exc}") from exc

    def _images(self, images: np.ndarray, grid: np.ndarray) -> tuple[list[Any], list[Any]]:
        """The decoded images ``images`` (RGB, SHA-256 checked; ``draft``: toward their target sizes) and
        what has each one's size as displayed (the images themselves; with ``draft``, their headers')."""
        config = self.parts.grid
        sizes: list[Any] = (
            (grid[:, [2, 1]] * config.patch_size).tolist() if self.draft else [None] * len(images)
        )
        if self.draft and self.device_resize:  # a grid its target does not give back: decoded in full
            own = config.is_own_target(grid).tolist()
            sizes = [size if ok else None for size, ok in zip(sizes, own, strict=True)]
        blobs, where = self.blobs(images), f"the VLM store {self.store.path}"
        decoded = [
            decode_rgb(data, where=f"image {index} of {where}", draft=size)
            for index, data, size in zip(images.tolist(), blobs, sizes, strict=True)
        ]
        if not self.draft:
            return decoded, decoded
        return decoded, [types.SimpleNamespace(size=shown_size(data, where=where)) for data in blobs]

    def _pixels(self, images: np.ndarray, grid: np.ndarray) -> tuple[Any, torch.Tensor]:
        parts = self.parts
        if self.device_resize and not images.size:
            return [], torch.zeros(0, 3, dtype=torch.long)
        if not images.size:
            g = parts.grid
            width = 3 * g.temporal_patch_size * g.patch_size**2
            return torch.zeros(0, width, dtype=self.pixel_dtype), torch.zeros(0, 3, dtype=torch.long)
        decoded, shown = self._images(images, grid)
        if (bad := parts.grid.first_other(shown, grid)) >= 0:
            raise SnapshotError(
                f"image {int(images[bad])} of the VLM store {self.store.path} is {shown[bad].size[0]}x"
                f"{shown[bad].size[1]}, whose grid is not the stored {grid[bad].tolist()} (the subset's "
                "manifest records another size?)"
            )
        want = torch.from_numpy(grid)
        if self.device_resize:
            return parts.decoded(decoded, grid), want
        pixels, got, computed = parts.pixels(decoded, grid, dtype=self.pixel_dtype)
        if not computed and not torch.equal(got.long(), want):
            bad = int(torch.nonzero((got.long() != want).any(dim=1))[0])
            raise SnapshotError(
                f"image {int(images[bad])} of the VLM store {self.store.path}: the image processor gives "
                f"grid {got[bad].tolist()}, the store holds {want[bad].tolist()} (another processor?)"
            )
        return pixels, want

    def metadata(self) -> dict[str, Any]:
        """What the batch's ``source_metadata`` gains: with uint8 pixels, ``pixel_normalization`` (the
        processor's rescale factor, mean and std: `clients.attention.model_inputs` applies them); with
        ``device_resize``, ``pixel_resize`` too (the grid facts that give each image's target size)."""
        if self.pixel_dtype != torch.uint8:
            return {}
        out: dict[str, Any] = {"pixel_normalization": pixel_normalization(self.parts.image_processor)}
        if self.device_resize:
            out["pixel_resize"] = self.parts.grid.facts()
        return out

    def images_of(self, samples: np.ndarray) -> ImageBlock:
        """The images of documents of ``samples`` (store sample indices, in document order)."""
        store = self.store
        first = np.asarray(store.image_offsets[samples], dtype=np.int64)
        count = np.asarray(store.image_offsets[samples + 1], dtype=np.int64) - first
        images = ragged_arange(first, count)
        grid = np.asarray(store.grid[images], dtype=np.int64).reshape(-1, 3)
        pixel_values, _ = self._pixels(images, grid)
        return ImageBlock(pixel_values=pixel_values, grid=grid, counts=count)

    def attach(
        self, batch: PuzzletronBatch, rows: Sequence[Sequence[int]], units: Units | None
    ) -> PuzzletronBatch:
        """`batch` (built from the store's tokens for `rows` of units) with its media (module docstring)."""
        order = np.fromiter((i for row in rows for i in row), dtype=np.int64)
        samples = order if units is None else units.sample[order].astype(np.int64)
        block = self.images_of(samples)
        return attach_media(
            batch,
            [block],
            np.zeros(samples.shape[0], dtype=np.int64),
            image_token_id=self.store.image_token_id,
            merge_size=self.store.merge_size,
            source_metadata=self.metadata(),
        )


@dataclass(frozen=True, eq=False)
class ImageBlock:
    """The images of some documents: ``pixel_values`` ``[patches, D]`` (or one decoded image an entry:
    ``device_resize``), ``grid`` ``[images, 3]`` (t, h, w) and ``counts`` ``[documents]`` images of each
    document, in document order."""

    pixel_values: torch.Tensor | list[torch.Tensor]
    grid: np.ndarray
    counts: np.ndarray


def attach_media(
    batch: PuzzletronBatch,
    blocks: Sequence[ImageBlock],
    doc_block: np.ndarray,
    *,
    image_token_id: int,
    merge_size: int,
    source_metadata: Mapping[str, Any] | None = None,
) -> PuzzletronBatch:
    """`batch` with the media of its documents (module docstring): document ``k`` (in ``seq_ids`` order; one
    a row unpacked) takes its images from ``blocks[doc_block[k]]`` (the block's documents in batch order),
    ``doc_block[k] = -1`` for a text document (none of its tokens is an image token). ``source_metadata``
    is added to the batch's (`VlmMedia.metadata`: uint8 pixels' normalisation)."""
    doc_block = np.asarray(doc_block, dtype=np.int64)
    n_docs = doc_block.shape[0]
    # each document's images, and where they sit among the blocks' images laid end to end
    count = np.zeros(n_docs, dtype=np.int64)
    first = np.zeros(n_docs, dtype=np.int64)
    image_base = np.cumsum([0] + [b.grid.shape[0] for b in blocks])
    for k, block in enumerate(blocks):
        at = np.flatnonzero(doc_block == k)
        count[at] = block.counts
        first[at] = image_base[k] + np.cumsum(block.counts) - block.counts
    images = ragged_arange(first, count)  # blocks' images in document order
    grid_all = np.concatenate([b.grid for b in blocks]) if blocks else np.zeros((0, 3), np.int64)
    grid = grid_all[images]
    pixels = [b.pixel_values for b in blocks]
    patches = np.prod(grid_all, axis=1)
    patch_start = np.cumsum(patches) - patches
    if len(pixels) == 1 and np.array_equal(images, np.arange(images.shape[0])):
        pixel_values = pixels[0]
    elif any(isinstance(p, list) for p in pixels):  # one decoded image an entry
        every = [image for part in pixels for image in part]
        pixel_values = [every[i] for i in images.tolist()]
    else:
        pick = ragged_arange(patch_start[images], patches[images])
        pixel_values = torch.cat(pixels)[torch.from_numpy(pick)]
    ids, valid = batch.input_ids.numpy(), batch.hidden_mask.numpy()
    b, t = ids.shape
    if batch.sequence.seq_ids is not None:  # packed: documents are numbered row-major
        doc = batch.sequence.seq_ids.numpy()
    else:  # one document a row, padding rows hold none
        doc = np.broadcast_to((np.cumsum(valid.any(axis=1)) - 1)[:, None], (b, t))
    doc_row = np.zeros(n_docs, dtype=np.int64)
    doc_row[doc[valid]] = np.broadcast_to(np.arange(b)[:, None], (b, t))[valid]
    has_images = np.append(doc_block >= 0, False)  # [documents + 1]: the last for padding tokens
    image = (ids == image_token_id) & has_images[np.where(valid, doc, n_docs)]
    doc = np.where(valid, doc, -1 - np.arange(b)[:, None])  # a padding run is a document of its own
    positions = mrope_ids(image.reshape(-1), doc.reshape(-1), grid, merge_size).reshape(3, b, t)
    positions = np.where(valid[None], positions, 0)
    counts = torch.from_numpy(np.bincount(doc_row, weights=count, minlength=b).astype(np.int64))
    kwargs = {
        **batch.model_kwargs,
        "position_ids": torch.from_numpy(positions),
        "mm_token_type_ids": torch.from_numpy(image.astype(np.int64)),
        "pixel_values": pixel_values,
        "image_grid_thw": torch.from_numpy(grid),
    }
    sequence = dataclasses.replace(
        batch.sequence, media_counts=counts, media_offsets=media_offsets_from_counts(counts)
    )
    meta = {**batch.source_metadata, **(source_metadata or {})}
    return dataclasses.replace(
        batch, model_kwargs=kwargs, sequence=sequence, modality=Modality.MULTIMODAL, source_metadata=meta
    )


@dataclass(frozen=True)
class VlmPackedBatches(PackedBatches):
    """`PackedBatches` over a VLM store whose batches carry their media (`VlmMedia`)."""

    media: VlmMedia | None = None

    def __getitem__(self, key: BatchKey) -> PuzzletronBatch:
        batch = super().__getitem__(key)
        if self.media is None:
            raise ConfigError(
                "building VLM batches needs the processor and the subset the store was built from: pass "
                "processor= and subset= to build_vlm_batches (planning alone needs neither)"
            )
        return self.media.attach(batch, self.rows(key), self.plan.units if self.plan is not None else None)

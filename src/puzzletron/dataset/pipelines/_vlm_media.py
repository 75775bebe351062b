"""The media of a multimodal batch, added at batch time (in DataLoader workers): pixels, grids, mRoPE ids.

`VlmPackedBatches` is the keyed dataset of the VLM pipeline: `PackedBatches` builds the token part from the
VLM store (ids, shifted labels, masks, packing metadata, in the layout of the spec), then `VlmMedia.attach`
adds, for the images of the batch's samples in token order:

- the image files, read from the subset, each checked against the SHA-256 the store recorded, decoded as
  ``Image.open(bytes).convert("RGB")`` (no EXIF rotation) and run through the image processor in one call:
  ``pixel_values`` ``[patches, 3 * temporal_patch * patch**2]`` in ``pixel_dtype`` and ``image_grid_thw``
  ``[images, 3]`` (which must be the grids the store holds);
- ``position_ids`` ``[3, B, T]``: the model's multi-axis positions, every document from 0 (`mrope_ids`),
  0 on padding; ``mm_token_type_ids`` ``[B, T]`` (1 on image tokens);
- ``sequence.media_counts`` / ``media_offsets``: images per row, so every split keeps an image with its
  sample; ``modality`` multimodal.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from puzzletron.dataset.batch import Modality, PuzzletronBatch
from puzzletron.dataset.batch.segments import media_offsets_from_counts
from puzzletron.dataset.conversation.images import decode_rgb
from puzzletron.dataset.distributed import BatchKey, PackedBatches
from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.formats.binary import ragged_arange
from puzzletron.dataset.formats.manifest import inside
from puzzletron.dataset.formats.vlm_store import VlmStore
from puzzletron.dataset.packing import Units, mrope_ids
from puzzletron.dataset.tokenize import VlmProcessor, vlm_processor

__all__ = ["VlmMedia", "VlmPackedBatches", "check_processor"]


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
    path is loaded once per process) and the dtype of ``pixel_values``."""

    store: VlmStore
    subset: Path
    processor: Any
    pixel_dtype: torch.dtype = torch.float32

    def _images(self, images: np.ndarray) -> list[Any]:
        """The decoded images ``images`` (indices into the store's image table), SHA-256 checked."""
        out = []
        for index, (rel, digest) in zip(images.tolist(), self.store.image_refs(images), strict=True):
            where = f"{self.subset}: image {rel!r} (image {index} of the VLM store)"
            path = inside(self.subset, rel, where, noun="image path")
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise SnapshotError(f"{where}: cannot read it: {exc}") from exc
            if hashlib.sha256(data).hexdigest() != digest:
                raise SnapshotError(f"{where}: SHA-256 differs from the one the store recorded (changed?)")
            out.append(decode_rgb(data, where=where))
        return out

    def _pixels(self, images: np.ndarray, grid: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        parts = vlm_processor(self.processor)
        if not images.size:
            g = parts.grid
            width = 3 * g.temporal_patch_size * g.patch_size**2
            return torch.zeros(0, width, dtype=self.pixel_dtype), torch.zeros(0, 3, dtype=torch.long)
        decoded = self._images(images)
        if (bad := parts.grid.first_other(decoded, grid)) >= 0:
            raise SnapshotError(
                f"image {int(images[bad])} of the VLM store {self.store.path} is {decoded[bad].size[0]}x"
                f"{decoded[bad].size[1]}, whose grid is not the stored {grid[bad].tolist()} (the subset's "
                "manifest records another size?)"
            )
        pixels, got, computed = parts.pixels(decoded, grid, dtype=self.pixel_dtype)
        want = torch.from_numpy(grid)
        if not computed and not torch.equal(got.long(), want):
            bad = int(torch.nonzero((got.long() != want).any(dim=1))[0])
            raise SnapshotError(
                f"image {int(images[bad])} of the VLM store {self.store.path}: the image processor gives "
                f"grid {got[bad].tolist()}, the store holds {want[bad].tolist()} (another processor?)"
            )
        return pixels, want

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
        )


@dataclass(frozen=True, eq=False)
class ImageBlock:
    """The images of some documents: ``pixel_values`` ``[patches, D]``, ``grid`` ``[images, 3]`` (t, h, w)
    and ``counts`` ``[documents]`` images of each document, in document order."""

    pixel_values: torch.Tensor
    grid: np.ndarray
    counts: np.ndarray


def attach_media(
    batch: PuzzletronBatch,
    blocks: Sequence[ImageBlock],
    doc_block: np.ndarray,
    *,
    image_token_id: int,
    merge_size: int,
) -> PuzzletronBatch:
    """`batch` with the media of its documents (module docstring): document ``k`` (in ``seq_ids`` order; one
    a row unpacked) takes its images from ``blocks[doc_block[k]]`` (the block's documents in batch order),
    ``doc_block[k] = -1`` for a text document (none of its tokens is an image token)."""
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
    return dataclasses.replace(batch, model_kwargs=kwargs, sequence=sequence, modality=Modality.MULTIMODAL)


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

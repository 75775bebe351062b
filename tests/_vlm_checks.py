"""Per-document checks of multimodal batches against the model's own code on each sample alone.

`Reference` caches, per sample id of a VLM store, the processor's output on that sample alone
(`_vlm_reference.processor_output`), its labels (written here from the assistant mask: ``labels[t] =
ids[t + 1]`` where ``mask[t + 1]``, else -100, the last one -100) and the model's ``get_rope_index`` positions
(`_vlm_reference.rope_index`). `check_documents` walks every document of a batch (any layout, after any row
split) and compares its tokens, labels, positions, pixels and grids with that reference; a document cut by
``truncate`` is compared with the reference's prefix. `check_forward` runs the batch through a model as
`model_inputs` gives it and every document alone through the same model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from _vlm_reference import LOADERS, processor_output, rope_index, sample_of
from puzzletron.dataset.batch import PuzzletronBatch
from puzzletron.dataset.clients.attention import model_inputs
from puzzletron.dataset.formats.subset import SubsetReader

__all__ = ["Reference", "check_documents", "check_forward", "documents"]


class Reference:
    """The processor's view of each sample alone, and the model's positions (cached per sample id)."""

    def __init__(self, kind: str, processor_dir: Path, subset: Path) -> None:
        self.kind = kind
        self.processor = LOADERS[kind](processor_dir)
        self.reader = SubsetReader(subset)
        self._cache: dict[str, dict[str, torch.Tensor]] = {}

    def __call__(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._cache:
            out = processor_output(self.processor, sample_of(self.reader, name))
            ids, mask = out["input_ids"], out["assistant_mask"]
            labels = torch.full_like(ids, -100)
            labels[:-1] = torch.where(mask[1:], ids[1:], torch.full_like(ids[1:], -100))
            out["labels"] = labels
            out["positions"] = rope_index(self.kind, out["mm_token_type_ids"], out.get("image_grid_thw"))
            self._cache[name] = out
        return self._cache[name]


def documents(batch: PuzzletronBatch) -> Iterator[tuple[str, int, torch.Tensor]]:
    """``(sample id, row, columns)`` of every document of `batch`, in row-major token order."""
    seq_ids = batch.sequence.seq_ids
    for row, joined in enumerate(batch.sample_ids):
        if joined.startswith("__"):
            continue
        names = joined.split("|")
        if seq_ids is None:
            cols = torch.nonzero(batch.hidden_mask[row]).reshape(-1)
            yield names[0], row, cols
            continue
        ids = seq_ids[row]
        for k, doc in enumerate(ids[ids >= 0].unique_consecutive().tolist()):
            yield names[k], row, torch.nonzero(ids == doc).reshape(-1)


def _patches(grid: torch.Tensor) -> int:
    return int(grid.prod(dim=-1).sum()) if grid.numel() else 0


def check_documents(batch: PuzzletronBatch, reference: Reference) -> int:
    """Assert that every document of `batch` equals `reference` on its sample alone; the documents seen."""
    kwargs = batch.model_kwargs
    grid_all, pixels_all = kwargs["image_grid_thw"], kwargs["pixel_values"]
    image, patch, seen = 0, 0, 0
    for name, row, cols in documents(batch):
        want = reference(name)
        length = cols.numel()
        assert length <= want["input_ids"].numel(), name
        assert torch.equal(batch.input_ids[row, cols], want["input_ids"][:length]), name
        labels = want["labels"][:length].clone()
        labels[-1] = -100  # a truncated document ends its own targets
        assert torch.equal(batch.labels[row, cols], labels), name
        assert torch.equal(kwargs["position_ids"][:, row, cols], want["positions"][:, :length]), name
        grid = want.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))
        n, p = grid.shape[0], _patches(grid)
        assert torch.equal(grid_all[image : image + n], grid), name
        if n:
            assert torch.equal(pixels_all[patch : patch + p], want["pixel_values"].to(pixels_all.dtype)), name
        image, patch, seen = image + n, patch + p, seen + 1
    assert image == grid_all.shape[0] and patch == pixels_all.shape[0]  # no image left over
    assert torch.equal(batch.sequence.media_counts.sum(), torch.tensor(image))
    return seen


def check_forward(
    model: torch.nn.Module, batch: PuzzletronBatch, reference: Reference, *, backend: str = "sdpa", tol: float
) -> float:
    """The batch's logits (``model(**model_inputs(batch))``) equal each document's alone, within `tol`;
    the largest difference."""
    dtype = model.dtype if backend == "eager" else None
    with torch.no_grad():
        packed = model(**model_inputs(batch, backend=backend, dtype=dtype)).logits
    worst = 0.0
    for name, row, cols in documents(batch):
        want = reference(name)
        length = cols.numel()
        alone: dict[str, Any] = {
            "input_ids": want["input_ids"][None, :length],
            "position_ids": want["positions"][:, None, :length],
            "attention_mask": torch.ones(1, length, dtype=torch.long),
            "use_cache": False,
        }
        if "pixel_values" in want:
            alone |= {"pixel_values": want["pixel_values"], "image_grid_thw": want["image_grid_thw"]}
        with torch.no_grad():
            logits = model(**alone).logits[0]
        worst = max(worst, float((packed[row, cols] - logits).abs().max()))
    assert worst <= tol, worst
    return worst

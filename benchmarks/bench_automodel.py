"""Benchmark `batch_from_automodel`: a 64 MiB-pixel VLM batch and an 8 x 16k neat-packed text batch.

Prints the median conversion time (ms) over repeats, the bytes the conversion allocates (CPU allocator,
measured with `torch.profiler(profile_memory=True)`), and which input tensors the batch shares by
``data_ptr`` (pass-through tensors must not be copied: only masks and metadata are new).

    .venv/bin/python benchmarks/bench_automodel.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from puzzletron.dataset import batch_from_automodel
from puzzletron.dataset.clients.automodel.adapter import forward_kwargs

PATCH_DIM = 3 * 2 * 14 * 14  # Qwen2-VL flat patch row


def vlm_batch(*, pixel_mib: int = 64, rows: int = 8, length: int = 4096, seed: int = 0) -> dict[str, Any]:
    """A ``default_collate_fn``-shaped batch whose bf16 ``pixel_values`` take ``pixel_mib`` MiB."""
    g = torch.Generator().manual_seed(seed)
    patches = pixel_mib * 2**20 // (PATCH_DIM * 2)
    counts = torch.tensor([2, 0, 1, 3, 1, 2, 0, 1][:rows])
    n_images = int(counts.sum())
    per_image = patches // n_images // 4 * 4  # h*w with h=2
    grid = torch.tensor([[1, 2, per_image // 2]] * n_images)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    labels = torch.randint(0, 1000, (rows, length), generator=g).masked_fill(mask == 0, -100)
    return {
        "input_ids": torch.randint(0, 1000, (rows, length), generator=g),
        "attention_mask": mask,
        "mm_token_type_ids": torch.zeros(rows, length, dtype=torch.long),
        "labels": labels,
        "pixel_values": torch.randn(int(grid.prod(dim=1).sum()), PATCH_DIM, generator=g).to(torch.bfloat16),
        "image_grid_thw": grid,
        "n_images_per_sample": counts,
    }


def neat_text_batch(*, rows: int = 8, length: int = 16384, seed: int = 0) -> dict[str, Any]:
    """A ``neat_packed_collater`` (document_ids) batch: ~600-token documents, a little trailing padding."""
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.zeros(rows, length, dtype=torch.long)
    positions = torch.zeros(rows, length, dtype=torch.long)
    for row in range(rows):  # building the input, not the code under test
        lengths = torch.randint(64, 1200, (length // 64,), generator=g)
        ends = lengths.cumsum(0)
        lengths = lengths[ends <= length - 100]
        ends = lengths.cumsum(0)
        filled = int(ends[-1])
        doc_ids[row, :filled] = torch.repeat_interleave(torch.arange(1, lengths.numel() + 1), lengths)
        starts = ends - lengths
        positions[row, :filled] = torch.arange(filled) - torch.repeat_interleave(starts, lengths)
    labels = torch.randint(0, 1000, (rows, length), generator=g).masked_fill(doc_ids == 0, -100)
    return {
        "input_ids": torch.randint(0, 1000, (rows, length), generator=g),
        "labels": labels,
        "position_ids": positions,
        "attention_mask": doc_ids,
        "_packed_seq_ids": doc_ids,
    }


def allocated_bytes(fn: Callable[[], Any]) -> int:
    """Bytes the CPU allocator hands out while ``fn`` runs (sum of positive self allocations)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(event.self_cpu_memory_usage, 0) for event in prof.events())


def shared_inputs(collated: dict[str, Any], batch: Any) -> list[str]:
    """Input keys whose tensor the batch passes on with the same storage (labels included)."""
    out = dict(batch.model_kwargs)
    if batch.labels is not None:
        out["labels"] = batch.labels
    return sorted(
        k
        for k, v in collated.items()
        if isinstance(v, torch.Tensor)
        and isinstance(out.get(k), torch.Tensor)
        and out[k].data_ptr() == v.data_ptr()
    )


def bench(name: str, collated: dict[str, Any], *, layout: str, repeats: int) -> None:
    rows = collated["input_ids"].shape[0]
    sample_ids = [f"row-{i}" for i in range(rows)]

    def convert() -> Any:
        return batch_from_automodel(collated, sample_ids=sample_ids, source_metadata={}, layout=layout)

    convert()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        batch = convert()
        times.append((time.perf_counter() - start) * 1e3)
    input_bytes = sum(v.numel() * v.element_size() for v in collated.values() if isinstance(v, torch.Tensor))
    new_bytes = allocated_bytes(convert)
    print(f"{name}: median {statistics.median(times):.2f} ms over {repeats} (min {min(times):.2f} ms)")
    print(
        f"  input tensors {input_bytes / 2**20:.1f} MiB; "
        f"allocated by the conversion {new_bytes / 2**20:.2f} MiB"
    )
    print(f"  shared with the input (no copy): {', '.join(shared_inputs(collated, batch))}")
    if batch.sequence.global_cu_seqlens is not None:
        print(
            f"  samples {batch.sequence.global_cu_seqlens.numel() - 1}, "
            f"max_seqlen {batch.sequence.max_seqlen}"
        )
        for backend in ("flash", "te_thd"):
            kw_times = []
            for _ in range(repeats):
                start = time.perf_counter()
                forward_kwargs(batch, backend=backend)
                kw_times.append((time.perf_counter() - start) * 1e3)
            kw_bytes = allocated_bytes(lambda backend=backend: forward_kwargs(batch, backend=backend))
            print(
                f"  forward_kwargs({backend}): median {statistics.median(kw_times):.2f} ms, "
                f"allocated {kw_bytes / 2**20:.2f} MiB"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    bench("VLM 8 x 4096, 64 MiB bf16 pixel_values", vlm_batch(), layout="padded_varlen", repeats=args.repeats)
    bench("neat-packed text 8 x 16384", neat_text_batch(), layout="packed_varlen", repeats=args.repeats)


if __name__ == "__main__":
    main()

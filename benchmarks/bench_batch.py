"""Median timings of the batch hot paths (CPU). Run: ``.venv/bin/python benchmarks/bench_batch.py``.

Add ``--threads 1`` on a shared machine. Targets (laptop-class CPU): canonical ids of 8x16,384 packed
tokens <= 3 ms; ``pp_microbatches(4)`` <= 10 ms;
constructing a batch with 64 MB of ``pixel_values`` <= 5 ms; fingerprint hashing >= 500 MB/s;
``cp_partition`` at cp=4 <= 5 ms; ``dp_slice`` of one 131,072-token packed row over 8 ranks <= 10 ms in total.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from puzzletron.dataset import DataLayout, PackedSequenceMetadata, PuzzletronBatch
from puzzletron.dataset.batch import _validation
from puzzletron.dataset.batch import segments as _segments
from puzzletron.dataset.batch._fingerprint import fingerprint_of
from puzzletron.dataset.batch.cp import load_balanced_cp_indices
from puzzletron.dataset.batch.segments import canonical_packed_ids

__all__ = ["main"]


def timings_ms(fn: Callable[[], object], *, repeats: int = 21, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def median_ms(fn: Callable[[], object], *, repeats: int = 21, warmup: int = 3) -> float:
    return statistics.median(timings_ms(fn, repeats=repeats, warmup=warmup))


def packed_raw_ids(rows: int, length: int, samples_per_row: int, *, seed: int = 0) -> torch.Tensor:
    """``[rows, length]`` per-row ids (restarting at 0 each row), ``samples_per_row`` runs, then padding."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((rows, length), -1, dtype=torch.long)
    for r in range(rows):
        cuts = torch.randperm(length - 64, generator=gen)[: samples_per_row - 1].sort().values + 1
        bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([length - 64])])
        out[r, : length - 64] = torch.repeat_interleave(torch.arange(samples_per_row), bounds.diff())
    return out


def packed_batch(raw: torch.Tensor) -> PuzzletronBatch:
    seq_ids, cu, max_seqlen = canonical_packed_ids(raw)
    hidden = seq_ids >= 0
    return PuzzletronBatch(
        model_kwargs={
            "input_ids": torch.randint(0, 32000, raw.shape),
            "attention_mask": hidden.long(),
            "position_ids": torch.arange(raw.shape[1]).repeat(raw.shape[0], 1),
            "cu_seqlens": cu.clone(),
        },
        labels=torch.randint(0, 32000, raw.shape).masked_fill(~hidden, -100),
        ce_mask=hidden.clone(),
        kd_mask=hidden.clone(),
        hidden_mask=hidden,
        sequence=PackedSequenceMetadata(global_cu_seqlens=cu, seq_ids=seq_ids, max_seqlen=max_seqlen),
        layout=DataLayout.PACKED_VARLEN,
    )


def with_automodel_kwargs(batch: PuzzletronBatch) -> PuzzletronBatch:
    """``batch`` plus AutoModel's per-row packing kwargs: ``cu_seqlens [B, D+1]``, ``packed_token_indices``,
    THD ``seq_lens``/``seq_lens_padded`` (every split slices or rebuilds them)."""
    ids = batch.sequence.seq_ids
    T = ids.shape[1]
    width = int(_segments.row_document_lengths(ids, T)[0].ge(0).sum(dim=1).max())  # most documents in a row
    lengths, spans = _segments.row_document_lengths(ids, width)
    kwargs = {k: v for k, v in batch.model_kwargs.items() if k != "cu_seqlens"}
    kwargs.update(
        cu_seqlens=_segments.row_cu_from_seq_ids(ids, width + 1).int(),
        packed_token_indices=torch.where(ids >= 0, torch.arange(T).expand_as(ids), -1),
        seq_lens=torch.where(lengths >= 0, lengths, -1000),
        seq_lens_padded=torch.where(spans >= 0, spans, -1000),
    )
    return batch.replace_model_kwargs(**kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        # On a shared, oversubscribed machine multi-threaded kernels mostly measure the other tenants.
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    torch.manual_seed(0)
    raw = packed_raw_ids(8, 16_384, 16)  # 8 x 16 = 128 samples
    print(
        f"canonical ids 8x16384 ({canonical_packed_ids(raw).num_samples} samples): "
        f"{median_ms(lambda: canonical_packed_ids(raw)):.2f} ms (target <= 3)"
    )

    batch = packed_batch(raw)
    print(f"construct (validate) that packed batch: {median_ms(lambda: dataclasses.replace(batch)):.2f} ms")
    print(f"pp_microbatches(4) of it: {median_ms(lambda: batch.pp_microbatches(4)):.2f} ms (target <= 10)")

    indices = load_balanced_cp_indices(None, cp_rank=1, cp_size=4, sequence_length=raw.shape[1])
    print(
        f"cp_partition cp=4 of it: "
        f"{median_ms(lambda: batch.cp_partition(indices, cp_rank=1, cp_size=4)):.2f} ms (target <= 5)"
    )

    neat = with_automodel_kwargs(batch)
    print(
        f"  with AutoModel per-row cu, token indices, THD lengths: pp_microbatches(4) "
        f"{median_ms(lambda: neat.pp_microbatches(4)):.2f} ms, cp_partition cp=4 "
        f"{median_ms(lambda: neat.cp_partition(indices, cp_rank=1, cp_size=4)):.2f} ms"
    )

    pixels = torch.randn(16 * 1024 * 1024 // 1, dtype=torch.float32).reshape(-1, 1024)  # 64 MiB
    grid = torch.tensor([[1, 32, 64]] * 8)  # 8 images of 2,048 patches: the 16,384 rows of pixels
    mb = pixels.numel() * pixels.element_size() / 2**20

    def build() -> PuzzletronBatch:
        return PuzzletronBatch(
            model_kwargs={
                "input_ids": torch.zeros(8, 4096, dtype=torch.long),
                "attention_mask": torch.ones(8, 4096, dtype=torch.long),
                "pixel_values": pixels,
                "image_grid_thw": grid,
            },
            labels=torch.zeros(8, 4096, dtype=torch.long),
            hidden_mask=torch.ones(8, 4096, dtype=torch.bool),
            sequence=PackedSequenceMetadata(media_counts=torch.ones(8, dtype=torch.long)),
            modality="multimodal",
        )

    print(f"construct a batch holding {mb:.0f} MB of pixel_values: {median_ms(build):.2f} ms (target <= 5)")

    def build_packed() -> PuzzletronBatch:
        """The issue-17 figure: a packed 8x16,384 batch with 64 MB of pixels, every construction rule on."""
        return batch.replace_model_kwargs(pixel_values=pixels, image_grid_thw=grid)

    batch = dataclasses.replace(
        batch, sequence=dataclasses.replace(batch.sequence, media_counts=torch.ones(8, dtype=torch.long))
    )
    packed_pixels = build_packed()

    def one_by_one() -> None:
        """The same rules evaluated one by one (what validation did before issue 17's fast pass)."""
        checks = _validation._Checks()
        _validation._token_value_rules(packed_pixels, checks)
        _validation._check_cu_values(packed_pixels, 8, 16_384, checks, packed=True)
        _validation._check_grids(packed_pixels.model_kwargs, checks)
        assert checks.first_failure() is None

    for name, fn in (("construct", build_packed), ("  the value rules one by one (before)", one_by_one)):
        times = timings_ms(fn, repeats=51, warmup=5)
        print(
            f"{name} a packed 8x16384 batch with {mb:.0f} MB of pixels: "
            f"median {statistics.median(times):.3f} ms, min {min(times):.3f} ms (target <= 1, median and min)"
        )
    hash_ms = median_ms(lambda: fingerprint_of(pixels), repeats=7, warmup=1)
    print(f"fingerprint throughput: {mb / (hash_ms / 1e3):.0f} MB/s (target >= 500)")
    whole_ms = median_ms(lambda: build().fingerprint, repeats=7, warmup=1)
    print(f"fingerprint of that whole fresh batch: {whole_ms:.1f} ms")

    row = packed_raw_ids(1, 131_072, 64)
    big = packed_batch(row)
    print(
        f"dp_slice of one 131072-token packed row over 8 ranks: "
        f"{median_ms(lambda: [big.dp_slice(dp_rank=r, dp_size=8) for r in range(8)]):.2f} ms total "
        f"(target <= 10)"
    )


if __name__ == "__main__":
    main()

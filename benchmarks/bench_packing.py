"""Benchmark the packing planner: time to plan 1,000,000 lengths, efficiency, rows vs the lower bound.

Lengths are log-normal chat lengths (median 600 tokens, sigma 1.0, capped at pack_size), the shape of
Puzzle-KD's chat split. Target: < 2 s for 1M lengths, efficiency >= 99.5%, within one row of the lower
bound per 10,000 samples. Prints medians over repeats.

    .venv/bin/python benchmarks/bench_packing.py [--samples 1000000] [--pack-size 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from puzzletron.dataset.config import PackingSpec
from puzzletron.dataset.packing import plan_packing


def chat_lengths(
    n: int, *, pack_size: int, seed: int, median: float = 600.0, sigma: float = 1.0
) -> np.ndarray:
    """``[n]`` int64 log-normal lengths in ``[1, pack_size]``."""
    raw = np.random.default_rng(seed).lognormal(np.log(median), sigma, size=n)
    return np.clip(np.rint(raw), 1, pack_size).astype(np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--pack-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    spec = PackingSpec(pack_size=args.pack_size)
    times, effs, excess = [], [], []
    for rep in range(args.repeats):
        lengths = chat_lengths(args.samples, pack_size=args.pack_size, seed=rep)
        start = time.perf_counter()
        plan = plan_packing(lengths, spec, seed=rep)
        times.append(time.perf_counter() - start)
        effs.append(plan.efficiency)
        excess.append(plan.num_rows - plan.lower_bound_rows)
    per_10k = statistics.median(excess) / (args.samples / 10_000)
    print(f"samples            {args.samples:,}  pack_size {args.pack_size}  repeats {args.repeats}")
    med, lo, hi = statistics.median(times), min(times), max(times)
    print(f"plan time (median) {med:.3f} s   (min {lo:.3f}, max {hi:.3f})")
    print(f"efficiency (median){statistics.median(effs) * 100:9.4f} %")
    print(f"rows - lower bound {statistics.median(excess):.0f} (median)  = {per_10k:.3f} per 10,000 samples")
    # Also a 10,000-sample batch, the unit of the efficiency target.
    small = [plan_packing(chat_lengths(10_000, pack_size=args.pack_size, seed=s), spec) for s in range(20)]
    print(
        "10k samples: efficiency median "
        f"{statistics.median(p.efficiency for p in small) * 100:.4f} %, rows - bound max "
        f"{max(p.num_rows - p.lower_bound_rows for p in small)}"
    )


if __name__ == "__main__":
    main()

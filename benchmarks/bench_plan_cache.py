"""Time to first batch and private memory of one rank at the 45B-token scale: re-planning vs the plan cache.

    .venv/bin/python benchmarks/bench_plan_cache.py                    # 75M samples, every policy (~5 min)
    .venv/bin/python benchmarks/bench_plan_cache.py --samples 2e7 --policies drop

Each figure is one fresh process doing what a training rank does before its first step (import torch, open
the lengths, get the plan, build the rank's sampler, build its first batch), for every long-sample policy:

- ``replan``: `plan_packing` on the rank (today's path without a cache: every rank plans the same plan);
- ``cold``: `cached_plan` into an empty cache (the one rank that plans and publishes);
- ``warm``: `cached_plan` from the published plan (every other rank and every restart).

Lengths are 75M log-normal chat lengths (median 450, sigma 0.8: 46.5B tokens) in a memory-mapped ``.npy``,
as a token store's index holds them. The first batch reads its tokens from a synthetic sample source (the
tokens of a 46.5B-token store do not fit this machine's disk; the plan, the deal and the index do). Private
memory is the process's USS (pages no other process maps: a single process also counts the plan's
file-backed pages it touched, which the ranks of a node share) and its anonymous memory (what no other
process can share), read right after the first batch; peak is VmHWM. Medians of ``--repeats`` fresh
processes for ``warm``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PACK, BATCH, RANKS = 4096, 8, 64

_RANK = """
import json, time
t0 = time.perf_counter()
import numpy as np, psutil, torch
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
from puzzletron.dataset.distributed import DistributedPackSampler, PackedBatches
from puzzletron.dataset.packing import plan_packing
from puzzletron.dataset.packing.plan_cache import cached_plan

class Synthetic:  # a SampleSource: real lengths, token ids made up (no disk)
    def __init__(self, lengths): self.lengths = lengths
    def __len__(self): return int(self.lengths.shape[0])
    def names(self, indices): return [str(i) for i in indices.tolist()]
    def gather(self, indices, starts, takes):
        n = int(takes.sum()); ids = np.arange(n, dtype=np.int64) % 30000
        return ids, np.where(np.arange(n) % 7 == 0, -100, ids)

t_import = time.perf_counter() - t0
lengths = np.load({lengths!r}, mmap_mode="r")
spec = PackingSpec({pack}, long_samples={policy!r})
t = time.perf_counter()
if {mode!r} == "replan":
    plan = plan_packing(lengths, spec, seed=0)
else:
    plan = cached_plan(lengths, spec, lengths_identity="bench", cache={cache!r}, seed=0)
t_plan = time.perf_counter() - t
data = PuzzletronDataSpec("text", "packed_varlen", {pack}, packing=spec)
dataset = PackedBatches(Synthetic(lengths), data, plan)
sampler = DistributedPackSampler(len(dataset), batch_size={batch}, dp_rank=0, dp_size={ranks}, seed=0)
batch = dataset[next(iter(sampler))]
t_first = time.perf_counter() - t0
info = psutil.Process().memory_full_info()
peak = next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
rollup = {{l.split(":")[0]: int(l.split()[1]) / 1024
          for l in open("/proc/self/smaps_rollup") if l.endswith("kB\\n")}}
print(json.dumps({{"anon_mib": rollup["Anonymous"], "import_s": t_import, "plan_s": t_plan,
    "first_batch_s": t_first, "after_import_s": t_first - t_import,
    "uss_mib": info.uss / 2**20, "rss_mib": info.rss / 2**20, "peak_rss_mib": peak, "rows": plan.num_rows,
    "tokens": int(batch.hidden_mask.sum())}}))
"""


def _fresh(code: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(work: Path, n: int, policies: list[str], repeats: int, modes: list[str]) -> list[dict[str, Any]]:
    from bench_store import synthetic_lengths

    lengths = synthetic_lengths(work, n)
    rows = []
    for policy in policies:
        cache = work / f"plans-{policy}"
        args = {"lengths": str(lengths), "pack": PACK, "policy": policy, "cache": str(cache), "batch": BATCH}
        args["ranks"] = RANKS
        results = {}
        if "replan" in modes:
            results["replan"] = _fresh(_RANK.format(mode="replan", **args))
        if "cold" in modes or not cache.is_dir():
            shutil.rmtree(cache, ignore_errors=True)
            results["cold"] = _fresh(_RANK.format(mode="cold", **args))
        if "warm" in modes:
            warm = [_fresh(_RANK.format(mode="warm", **args)) for _ in range(repeats)]
            results["warm"] = {k: statistics.median(w[k] for w in warm) for k in warm[0]}
        for mode, r in results.items():
            rows.append({"policy": policy, "mode": mode, **r})
            print(
                f"{policy:9s} {mode:7s} first batch {r['first_batch_s']:6.2f} s (after import "
                f"{r['after_import_s']:6.2f} s, plan {r['plan_s']:6.2f} s)  private {r['uss_mib']:5.0f} MiB "
                f"(anonymous {r['anon_mib']:5.0f} MiB)  "
                f"peak RSS {r['peak_rss_mib']:7.0f} MiB  rows {r['rows']:,}",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=float, default=75e6)
    parser.add_argument("--policies", default="drop,truncate,split")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="replan,cold,warm", help="warm alone reuses a --workdir's plans")
    parser.add_argument("--workdir", type=Path, default=None, help="kept between runs (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print(f"{int(args.samples):,} samples, pack {PACK}, {RANKS} DP ranks, batch {BATCH}; rank 0's view")
        run(work, int(args.samples), args.policies.split(","), args.repeats, args.modes.split(","))


if __name__ == "__main__":
    main()

"""What the token store's integrity checks cost a reader (issue 17: at most 10% of the read throughput).

    .venv/bin/python benchmarks/bench_integrity.py                  # a 2e8-token store, 5 repeats
    .venv/bin/python benchmarks/bench_integrity.py --tokens 1e9 --workdir /tmp/bench-integrity

A synthetic store (``bench_store.synthetic_store``: uint16 ids, lognormal lengths) is read with the page
cache warm. Each measurement runs in a fresh process, so every block is verified on its first read (the
worst case: a reader process verifies each 64 KiB block once, later reads of it cost nothing), once with
the checks as shipped and once with `TokenStore._ensure_verified` and `BlockChecks.ensure_file` replaced
by no-ops (the same reader without integrity). CPU seconds (``time.process_time``) of the reads alone,
medians of ``--repeats``:

- ``open``: `TokenStore(path)` (manifest checks, pins, checksum file) and the first use of the index (its
  blocks and consistency);
- ``epoch``: the whole store in order, one read of a pack-sized range (4,096 tokens) per call;
- ``random``: 20,000 single samples in a random order, one read per sample;
- ``hash``: xxh3_64 of every block alone (GB/s), for scale.

Overhead = checked / unchecked - 1. Run with nothing else on the machine: timings of a shared 2-core machine
move by 10-20% between runs, so compare the two columns of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["main"]

_READ = """
import json, time
import numpy as np
from puzzletron.dataset.formats import blocks
from puzzletron.dataset.formats.token_store import TokenStore
if {off}:
    TokenStore._ensure_verified = lambda self, *pieces: None
    blocks.BlockChecks.ensure_file = lambda self, rel: None
cpu = time.process_time
t = cpu()
store = TokenStore({path!r})
offsets = np.asarray(store.offsets)
open_s = cpu() - t
if {scenario!r} == "epoch":
    t = cpu()
    tokens = 0
    for a in range(0, store.num_tokens, 4096):
        ids, mask = store.read([a], [min(a + 4096, store.num_tokens)])
        tokens += ids.size
    read_s = cpu() - t
    count = tokens
else:
    order = np.random.default_rng(0).permutation(len(store))[:20_000]
    t = cpu()
    for i in order.tolist():
        store.read(offsets[i : i + 1], offsets[i + 1 : i + 2])
    read_s = cpu() - t
    count = order.size
print(json.dumps({{"open_s": open_s, "read_s": read_s, "count": int(count)}}))
"""


def _fresh(code: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _hash_rate(path: Path) -> float:
    """GB/s of xxh3_64 over every block of the store's shard files (read into memory first)."""
    import time

    from puzzletron.dataset.formats.blocks import block_sums

    data = b"".join(p.read_bytes() for p in sorted((path / "shards").iterdir()))
    start = time.perf_counter()
    block_sums(data)
    return len(data) / (time.perf_counter() - start) / 1e9


def bench(path: Path, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scenario in ("epoch", "random"):
        runs: dict[str, list[dict[str, Any]]] = {"checked": [], "unchecked": []}
        for _ in range(repeats):  # interleaved, so drift on a shared machine hits both alike
            for name, off in (("checked", False), ("unchecked", True)):
                runs[name].append(_fresh(_READ.format(path=str(path), off=off, scenario=scenario)))
        row = {}
        for name, results in runs.items():
            read_s = statistics.median(r["read_s"] for r in results)
            row[name] = {
                "open_s": statistics.median(r["open_s"] for r in results),
                "read_cpu_s": read_s,
                "per_cpu_s": results[0]["count"] / read_s,
            }
        row["overhead"] = row["checked"]["read_cpu_s"] / row["unchecked"]["read_cpu_s"] - 1
        row["unit"] = "tokens" if scenario == "epoch" else "samples"
        out[scenario] = row
    out["hash_gb_per_s"] = _hash_rate(path)
    return out


def main() -> None:
    from bench_store import synthetic_store

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=float, default=2e8, help="tokens in the synthetic store")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the store here (default: temp)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-integrity-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        path = synthetic_store(work / f"synthetic-{args.tokens:.0e}", int(args.tokens))
        result = {"store_tokens": int(args.tokens), **bench(path, args.repeats)}
    print(json.dumps(result, indent=2))
    for scenario in ("epoch", "random"):
        row = result[scenario]
        print(
            f"{scenario:>6}: {row['checked']['per_cpu_s']:,.0f} {row['unit']}/CPU s checked vs "
            f"{row['unchecked']['per_cpu_s']:,.0f} unchecked: overhead {row['overhead']:+.1%} (<= +10%); "
            f"open + index {row['checked']['open_s'] * 1e3:.0f} ms vs "
            f"{row['unchecked']['open_s'] * 1e3:.0f} ms"
        )
    print(f"  hash: xxh3_64 {result['hash_gb_per_s']:.1f} GB/s")


if __name__ == "__main__":
    main()

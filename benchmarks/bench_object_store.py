"""Reading a token store from an S3-compatible server on loopback against reading it from local disk, in
one run: the node's cache cold (every chunk fetched by ranged GETs) and warm (every chunk a local file).

    .venv/bin/python benchmarks/bench_object_store.py                 # a 2e7-token store, 3 repeats
    .venv/bin/python benchmarks/bench_object_store.py --tokens 1e8

The server is moto's (`puzzletron.fixtures.object_store`, a separate process: its CPU time is not ours);
the synthetic store (``bench_store.synthetic_store``) is uploaded once, objects first and the manifest
last. Each figure opens a fresh `TokenStore` (integrity checks as in a new process) and reads:

- ``epoch``: the whole store in order, 4,096-token windows (`read` of one range), tokens per second;
- ``random``: 5,000 single samples in a random order (`sample`), samples per second.

``cold`` starts from an empty cache (`PUZZLETRON_OBJECT_CACHE`), ``warm`` from the cache a cold run
filled. Wall-clock seconds (the network is part of it) and this process's CPU seconds, medians of
``--repeats``; ratios are local / object storage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["main"]


def _upload(local: Path, url: str) -> None:
    from puzzletron.dataset.formats.manifest import MANIFEST
    from puzzletron.dataset.storage.objects import Objects

    objects = Objects(url)
    objects.upload(local, last=MANIFEST)
    if not objects.create_once(MANIFEST, (local / MANIFEST).read_bytes()):
        raise RuntimeError(f"{url} holds a manifest already")


def _run(location: str, scenario: str) -> tuple[float, float, int]:
    """Wall and CPU seconds of one scenario on a fresh reader, and what it counted."""
    from puzzletron.dataset.formats.token_store import TokenStore

    wall, cpu = time.perf_counter(), time.process_time()
    store = TokenStore(location)
    if scenario == "epoch":
        count = 0
        for a in range(0, store.num_tokens, 4096):
            count += store.read([a], [min(a + 4096, store.num_tokens)])[0].size
    else:
        picks = np.random.default_rng(0).permutation(len(store))[:5000].tolist()
        for i in picks:
            store.sample(i)
        count = len(picks)
    store.close()
    return time.perf_counter() - wall, time.process_time() - cpu, count


def bench(local: Path, url: str, cache: Path, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scenario in ("epoch", "random"):
        runs: dict[str, list[tuple[float, float, int]]] = {"local": [], "cold": [], "warm": []}
        for _ in range(repeats):
            runs["local"].append(_run(str(local), scenario))
            shutil.rmtree(cache, ignore_errors=True)
            runs["cold"].append(_run(url, scenario))
            runs["warm"].append(_run(url, scenario))
        row: dict[str, Any] = {"unit": "tokens" if scenario == "epoch" else "samples"}
        for name, results in runs.items():
            wall = statistics.median(r[0] for r in results)
            row[name] = {
                "wall_s": wall,
                "cpu_s": statistics.median(r[1] for r in results),
                "per_s": results[0][2] / wall,
            }
        for name in ("cold", "warm"):
            row[f"local_over_{name}"] = row[name]["wall_s"] / row["local"]["wall_s"]
        out[scenario] = row
    return out


def main() -> None:
    from bench_store import synthetic_store
    from puzzletron.fixtures.object_store import client_environment, create_bucket, serve_object_store

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=float, default=2e7, help="tokens in the synthetic store")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep the local store here (default: temp)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-object-store-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        local = synthetic_store(work / f"synthetic-{args.tokens:.0e}", int(args.tokens))
        cache = Path(tmp) / "object-cache"
        with serve_object_store() as endpoint:
            os.environ.update(client_environment(endpoint))
            os.environ["PUZZLETRON_OBJECT_CACHE"] = str(cache)
            create_bucket(endpoint, "bench")
            url = "s3://bench/stores/synthetic"
            _upload(local, url)
            result = {"store_tokens": int(args.tokens), **bench(local, url, cache, args.repeats)}
    print(json.dumps(result, indent=2))
    for scenario in ("epoch", "random"):
        row = result[scenario]
        print(
            f"{scenario:>6}: local {row['local']['per_s']:,.0f} {row['unit']}/s; S3 cold "
            f"{row['cold']['per_s']:,.0f} ({row['local_over_cold']:.1f}x slower), warm "
            f"{row['warm']['per_s']:,.0f} ({row['local_over_warm']:.1f}x)"
        )


if __name__ == "__main__":
    main()

"""The token store's local read path side by side with Megatron-Core's `IndexedDataset` on the same tokens.

    .venv/bin/python benchmarks/bench_read_path.py                    # a 1e8-token store, 5 repeats
    .venv/bin/python benchmarks/bench_read_path.py --tokens 3e7 --repeats 3

Megatron-Core is not a dependency: install it beside the project to compare (``pip install --no-deps
megatron-core==0.16.1``; 0.16.1 is the last release for Python 3.11, and its `indexed_dataset` imports on a
CPU machine). The synthetic store (``bench_store.synthetic_store``: uint16 ids, lognormal lengths around 600
tokens) is written once; its shard token files, concatenated, are Megatron's ``.bin`` and its lengths its
``.idx`` (`_IndexWriter`), so both read the same tokens. Page cache warm; CPU seconds
(``time.process_time``) of the reads alone, the median of ``--repeats``, the two readers interleaved. Every
repeat opens a fresh `TokenStore`, so its integrity checks run as in a new process: each 64 KiB block is
hashed the first time a read touches it, and each id is checked against the vocabulary. Megatron's reader
memory-maps the ``.bin`` with no check. Each read returns the sample's ids as int64, what a batch needs
(Megatron: ``dataset[i].astype(np.int64)``, as its `GPTDataset` does):

- ``random``: 20,000 single samples in a random order, one call each (ours: `tokens(i)`, and `sample(i)`
  with the supervision mask Megatron's format does not have);
- ``random_again``: the same reads on a reader that has made them once before (untimed): the steady state
  of a long run, every block already verified (ours) and mapped (both); ``random`` includes the one-time
  verification of every block the 20,000 reads touch (about all of them);
- ``random_batch``: the same samples 32 at a time (ours: one `read` of 32 ranges, the call batches make;
  Megatron: 32 calls);
- ``epoch``: every sample in order, one call each (ours: `tokens`, `sample`), and ours in 4,096-token
  windows (`read` of one range);
- ``rss``: the growth of the resident size through one epoch in order (MiB: the peak over the start).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["main"]


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def megatron_files(store_path: Path, prefix: Path) -> Any:
    """Megatron's ``.bin`` / ``.idx`` of the store's tokens, and its `IndexedDataset` over them."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, _IndexWriter

    from puzzletron.dataset.formats.token_store import TokenStore

    if not prefix.with_suffix(".idx").is_file():
        store = TokenStore(store_path)
        with open(prefix.with_suffix(".bin"), "wb") as out:
            for k in range(len(store.manifest["shards"])):
                out.write((store_path / "shards" / f"{k:06d}.tokens").read_bytes())
        with _IndexWriter(str(prefix.with_suffix(".idx")), np.uint16) as writer:
            writer.write(np.asarray(store.lengths, np.int32), None, np.arange(len(store) + 1))
    return IndexedDataset(str(prefix), mmap=True)


def _cpu(run: Callable[[], Any]) -> float:
    start = time.process_time()
    run()
    return time.process_time() - start


def bench(store_path: Path, prefix: Path, repeats: int) -> dict[str, Any]:
    from puzzletron.dataset.formats.token_store import TokenStore

    mega = megatron_files(store_path, prefix)
    probe = TokenStore(store_path)
    n, tokens = len(probe), probe.num_tokens
    offsets = np.asarray(probe.offsets)
    order = np.random.default_rng(0).permutation(n)[:20_000]
    picks = order.tolist()
    batches = [order[a : a + 32] for a in range(0, order.size, 32)]
    assert all(np.array_equal(probe.tokens(i), mega[i]) for i in picks[:200])  # the same tokens

    def fresh() -> Any:
        store = TokenStore(store_path)
        store.offsets  # noqa: B018 (open + the index's first use: not what a read costs)
        return store

    def mega_fresh() -> Any:
        return megatron_files(store_path, prefix)

    def each(open_reader: Callable[[], Any], read: Callable[[Any, int], Any], items: Any) -> Any:
        """A maker of one timed run: a fresh reader, then ``read(reader, item)`` for every item."""
        return lambda: (lambda r: lambda: [read(r, i) for i in items])(open_reader())

    def again(open_reader: Callable[[], Any], read: Callable[[Any, int], Any], items: Any) -> Any:
        """`each`, on a reader that read the items once before the timed run (untimed): the steady state
        of a long run, where every block a read touches was verified before (ours) or mapped (both)."""

        def warmed() -> Any:
            reader = open_reader()
            for i in items:
                read(reader, i)
            return reader

        return each(warmed, read, items)

    def mega_ids(m: Any, i: int) -> np.ndarray:
        return m[i].astype(np.int64)

    windows = range(0, tokens, 4096)
    scenarios: dict[str, dict[str, Callable[[], Callable[[], Any]]]] = {
        "random": {
            "megatron": each(mega_fresh, mega_ids, picks),
            "ours_tokens": each(fresh, lambda s, i: s.tokens(i), picks),
            "ours_sample": each(fresh, lambda s, i: s.sample(i), picks),
        },
        "random_again": {
            "megatron": again(mega_fresh, mega_ids, picks),
            "ours_tokens": again(fresh, lambda s, i: s.tokens(i), picks),
            "ours_sample": again(fresh, lambda s, i: s.sample(i), picks),
        },
        "random_batch": {
            "megatron": each(mega_fresh, lambda m, b: [mega_ids(m, i) for i in b.tolist()], batches),
            "ours_read": each(fresh, lambda s, b: s.read(offsets[b], offsets[b + 1]), batches),
        },
        "epoch": {
            "megatron": each(mega_fresh, mega_ids, range(n)),
            "ours_tokens": each(fresh, lambda s, i: s.tokens(i), range(n)),
            "ours_sample": each(fresh, lambda s, i: s.sample(i), range(n)),
            "ours_4096": each(fresh, lambda s, a: s.read([a], [min(a + 4096, tokens)]), windows),
        },
    }
    out: dict[str, Any] = {"samples": n, "tokens": tokens}
    for name, readers in scenarios.items():
        times: dict[str, list[float]] = {reader: [] for reader in readers}
        for _ in range(repeats):
            for reader, make in readers.items():
                run = make()
                times[reader].append(_cpu(lambda run=run: _drain(run)))
        count = tokens if name == "epoch" else len(picks)
        out[name] = {
            reader: {"cpu_s": statistics.median(t), "per_cpu_s": count / statistics.median(t)}
            for reader, t in times.items()
        }
        out[name]["unit"] = "tokens" if name == "epoch" else "samples"
    out["rss_growth_mib"] = {
        reader: _rss_in_fresh_process(reader, store_path, prefix) for reader in ("megatron", "ours_sample")
    }
    return out


def _drain(run: Callable[[], Any]) -> None:
    run()  # results are built (lists) and dropped: what a consumer's loop costs


_RSS_CODE = """
import sys, numpy as np
sys.path.insert(0, {bench!r})
from pathlib import Path
from bench_read_path import _rss_mib, megatron_files
from puzzletron.dataset.formats.token_store import TokenStore
if {reader!r} == "megatron":
    mega = megatron_files(Path({store!r}), Path({prefix!r}))
    n, read = len(mega), lambda i: mega[i].astype(np.int64)
else:
    store = TokenStore({store!r}); n = len(store); store.offsets; read = store.sample
start, peak = _rss_mib(), 0.0
for i in range(n):
    read(i)
    if i % 4096 == 0:
        peak = max(peak, _rss_mib())
print(max(peak, _rss_mib()) - start)
"""


def _rss_in_fresh_process(reader: str, store: Path, prefix: Path) -> float:
    """MiB the resident size grows through one epoch in order, in a process that does nothing else."""
    import subprocess

    code = _RSS_CODE.format(
        bench=str(Path(__file__).resolve().parent), reader=reader, store=str(store), prefix=str(prefix)
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from bench_store import synthetic_store

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=float, default=1e8, help="tokens in the synthetic store")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the store here (default: temp)")
    args = parser.parse_args()
    try:
        import megatron.core.datasets.indexed_dataset  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"install megatron-core to compare (pip install --no-deps megatron-core==0.16.1): {exc}"
        ) from None
    with tempfile.TemporaryDirectory(prefix="bench-read-path-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        path = synthetic_store(work / f"synthetic-{args.tokens:.0e}", int(args.tokens))
        result = bench(path, work / f"megatron-{args.tokens:.0e}", args.repeats)
    print(json.dumps(result, indent=2))
    for name in ("random", "random_again", "random_batch", "epoch"):
        row = result[name]
        base = row["megatron"]["per_cpu_s"]
        ours = ", ".join(
            f"{reader} {row[reader]['per_cpu_s']:,.0f} ({row[reader]['per_cpu_s'] / base:.2f}x)"
            for reader in row
            if reader.startswith("ours")
        )
        print(f"{name:>12}: Megatron {base:,.0f} {row['unit']}/CPU s; {ours}")
    rss = result["rss_growth_mib"]
    print(
        f"         rss: an epoch in order grows Megatron {rss['megatron']:.0f} MiB, "
        f"ours {rss['ours_sample']:.0f} MiB"
    )


if __name__ == "__main__":
    main()

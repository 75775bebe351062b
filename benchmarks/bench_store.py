"""Token-store benchmarks (issue 10): building a store, reading one, planning at scale, long-sample policies.

    .venv/bin/python benchmarks/bench_store.py                        # every part (~15 min, ~5 GB of disk)
    .venv/bin/python benchmarks/bench_store.py --parts build,policies # some parts
    .venv/bin/python benchmarks/bench_store.py --read-tokens 1e8,1e9 --workdir /tmp/bench-store

Parts (medians of ``--repeats`` where a figure is timed):

- ``build``: tokens per CPU second of `build_token_store` (1 process) and of a raw batch encode
  ``tokenizer(texts)`` of the same rendered conversations, in the same run; wall time with 1 and 2 processes.
  A 32k byte-level BPE and Puzzle-KD-like conversations (``benchmarks/_synthetic.py``).
- ``read``: one rank iterating a full epoch of a store written from synthetic ids (``--read-tokens``, 1e9 and
  more): peak RSS and RSS along the epoch, time to the first batch on the reused store, batches per second.
  Each size runs in a fresh process.
- ``plan``: planning 75 million sample lengths (45B tokens) in a fresh process that never imports torch.
- ``policies``: tokens kept and packing efficiency of drop / truncate / split on heavy-tailed chat lengths.
- ``extrapolate``: the figures above scaled to 45B tokens on 64 ranks (labelled as extrapolation).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["main", "synthetic_lengths"]

PACK = 4096
BATCH = 8  # packs per batch
TOKENS_45B = 45e9
RANKS = 64


def _fresh(code: str, *, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``code`` (which prints one JSON line last) in a fresh interpreter; its result."""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------------
# build


def _snapshot(work: Path, rows: list[dict[str, Any]]) -> Path:
    """A Puzzle-KD text snapshot of ``rows`` (train) written by the real materialiser, offline."""
    from puzzletron.dataset.sources import TextAcquisitionSpec, materialize_puzzle_kd_dataset

    out = work / f"snapshot-{len(rows)}"
    if not (out / "manifest.json").is_file():
        spec = TextAcquisitionSpec(
            output_dir=out, train_samples=len(rows), validation_samples=1, revision="0" * 40
        )

        def loader(source: str, *, split: str, revision: str, seed: int) -> Any:
            return iter(rows if split == "train" else rows[:1])

        materialize_puzzle_kd_dataset(spec, dataset_loader=loader, revision_resolver=lambda s, r: "0" * 40)
    return out


_BUILD = """
import json, shutil, statistics, time
from pathlib import Path
from puzzletron.dataset.formats.text_snapshot import load_text_split
from puzzletron.dataset.tokenize import build_token_store, load_tokenizer, tokenize_rows
tok = load_tokenizer(Path({tok!r}))
rows = load_text_split(Path({snapshot!r}))
texts = [tok.apply_chat_template(m, tokenize=False) for m in rows["messages"]]
def cpu(fn):
    t = time.process_time(); out = fn(); return time.process_time() - t, out
# Paired and interleaved: this machine's speed drifts by 30% within a minute, a pair a second apart shares it.
pairs = []
for repeat in range({repeats}):
    for a in range(0, len(texts), 1024):
        b = min(a + 1024, len(texts))
        first_raw = (repeat + a // 1024) % 2 == 0
        for which in ("raw", "ours") if first_raw else ("ours", "raw"):
            if which == "raw":
                c, enc = cpu(lambda: tok(texts[a:b]))
                raw = sum(map(len, enc["input_ids"])) / c
            else:
                c, parts = cpu(lambda: list(tokenize_rows(rows, a, b, tokenizer=tok)))
                ours = sum(int(p.offsets[-1]) for p in parts) / c
        pairs.append((raw, ours))
builds = []
for repeat in range({repeats} + 1):  # the first build pays one-off imports: a warm-up, not counted
    out = Path({work!r}) / "store-measured"
    shutil.rmtree(out, ignore_errors=True)
    c_before, enc = cpu(lambda: tok(texts))
    tokens = sum(map(len, enc["input_ids"]))
    c_build, _ = cpu(lambda: build_token_store(Path({snapshot!r}), tokenizer=Path({tok!r}), output=out))
    c_after, _ = cpu(lambda: tok(texts))
    if repeat:
        builds.append((c_before + c_after) / 2 / c_build)  # raw measured on both sides of the build
med = statistics.median
print(json.dumps({{"raw_tokens_per_cpu_s": med(r for r, _ in pairs),
    "tokenize_tokens_per_cpu_s": med(o for _, o in pairs), "tokenize_ratio": med(o / r for r, o in pairs),
    "pairs": len(pairs), "build_ratio": med(builds), "tokens": tokens}}))
"""

_WALL = """
import json, shutil, time
from pathlib import Path
from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.tokenize import build_token_store
out = Path({work!r}) / "store-wall-{procs}"
shutil.rmtree(out, ignore_errors=True)
t = time.perf_counter()
snapshot, tokenizer = Path({snapshot!r}), Path({tok!r})
options = TokenizeOptions(rows_per_shard=2048)
build_token_store(snapshot, tokenizer=tokenizer, output=out, num_proc={procs}, options=options)
print(json.dumps({{"wall_s": time.perf_counter() - t}}))
"""


def bench_build(work: Path, n_rows: int, repeats: int) -> dict[str, Any]:
    """Every figure from fresh processes with one tokenizer thread each (``TOKENIZERS_PARALLELISM=false``),
    so "per process" means one core. Tokenisation: raw ``tokenizer(texts)`` of the rendered conversations
    against `tokenize_rows` (reading the rows, rendering, encoding, assistant masks) on the same 1,024 rows,
    the two interleaved, the median of the pairs' ratios. Build: a whole store build (also writing and
    hashing) against raw on the whole split. Then the build's wall time with 1 and 2 processes (shards of
    2,048 rows, so both processes have work)."""
    from _synthetic import build_tokenizer_32k, conversations

    tok_dir = build_tokenizer_32k(work / "tokenizer-32k")
    snapshot = _snapshot(work, conversations(n_rows, seed=7))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    fields = {"tok": str(tok_dir), "snapshot": str(snapshot)}
    result = _fresh(_BUILD.format(repeats=repeats, work=str(work), **fields), env=env)
    walls = {
        procs: statistics.median(
            _fresh(_WALL.format(procs=procs, work=str(work), **fields), env=env)["wall_s"]
            for _ in range(repeats)
        )
        for procs in (1, 2)
    }
    return {
        "rows": n_rows,
        **result,
        "wall_1_proc_s": walls[1],
        "wall_2_proc_s": walls[2],
        "speedup_2_proc": walls[1] / walls[2],
        "build_tokens_per_s_per_process": result["tokens"] / walls[1],
    }


# ---------------------------------------------------------------------------------------------------------
# a synthetic store for the read side


def synthetic_store(path: Path, tokens: int, *, seed: int = 0, rows_per_shard: int = 65_536) -> Path:
    """A token store of about ``tokens`` tokens from synthetic ids (uint16, vocab 32,000), written through the
    format's own shard writer and assembler; reused when ``path`` already holds one."""
    from puzzletron.dataset.formats.manifest import canonical_sha256
    from puzzletron.dataset.formats.token_store import TOKEN_STORE_FORMAT, TOKEN_STORE_VERSION
    from puzzletron.dataset.formats.token_store.writer import ShardWriter, assemble_store
    from puzzletron.dataset.storage.atomic import staging_dir

    if (path / "manifest.json").is_file():
        return path
    rng = np.random.default_rng(seed)
    mean = 600
    n = int(tokens // mean)
    lengths = np.clip(np.rint(rng.lognormal(np.log(450), 0.8, size=n)), 16, 16_384).astype(np.int64)
    build = Path(tempfile.mkdtemp(prefix="synthetic-shards-", dir=path.parent))
    dirs, records = [], []
    for k, a in enumerate(range(0, n, rows_per_shard)):
        b = min(a + rows_per_shard, n)
        shard = build / f"shard-{k:05d}"
        shard.mkdir()
        writer = ShardWriter(shard, "uint16")
        part = lengths[a:b]
        ids = rng.integers(0, 32_000, size=int(part.sum()), dtype=np.uint16)
        mask = rng.random(ids.shape[0]) < 0.7
        writer.add(ids, mask, part, [f"synthetic-{i:09d}" for i in range(a, b)], supervised=part)
        records.append(writer.finish(rows=(a, b)))
        dirs.append(shard)
    identity = {
        "format": TOKEN_STORE_FORMAT,
        "version": TOKEN_STORE_VERSION,
        "snapshot": {"synthetic": True, "seed": seed, "tokens": tokens, "rows": n},
        "options": {"rows_per_shard": rows_per_shard},
    }
    fields = {
        "identity": identity,
        "identity_sha256": canonical_sha256(identity),
        "token_dtype": "uint16",
        "vocab_size": 32_000,
        "pad_token_id": 0,
        "rows_per_shard": rows_per_shard,
        "built_with": {"benchmark": "benchmarks/bench_store.py synthetic ids"},
    }
    with staging_dir(path) as tmp:
        assemble_store(tmp, dirs, records, fields=fields)
    shutil.rmtree(build)
    return path


_READ = """
import json, sys, time
t0 = time.perf_counter()
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
from puzzletron.dataset.pipelines.text import build_batches
spec = PuzzletronDataSpec("text", "packed_varlen", {pack}, PackingSpec({pack}))
batches = build_batches({path!r}, spec=spec, batch_size={batch}, seed=0)
it = iter(batches)
first = next(it)
first_s = time.perf_counter() - t0
def rss():
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) / 1024 for l in fh if l.startswith("VmRSS:"))
samples, n, tokens = [rss()], 1, int(first.hidden_mask.sum())
t1 = time.perf_counter()
for b in it:
    n += 1
    tokens += int(b.hidden_mask.sum())
    if n % max(len(batches) // 8, 1) == 0:
        samples.append(rss())
epoch_s = time.perf_counter() - t1
peak = next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({{"first_batch_s": first_s, "batches": n, "batches_per_s": (n - 1) / epoch_s,
    "tokens": tokens, "rss_along_epoch_mib": [round(x) for x in samples], "peak_rss_mib": peak,
    "rows": batches.plan.num_rows, "efficiency": batches.plan.efficiency}}))
"""


def bench_read(work: Path, sizes: list[int]) -> list[dict[str, Any]]:
    out = []
    for tokens in sizes:
        path = synthetic_store(work / f"synthetic-{tokens:.0e}", tokens)
        _fresh(_READ.format(pack=PACK, batch=BATCH, path=str(path)))  # warm the page cache once
        result = _fresh(_READ.format(pack=PACK, batch=BATCH, path=str(path)))
        out.append({"store_tokens": tokens, **result})
    return out


# ---------------------------------------------------------------------------------------------------------
# planning at scale, policies


_PLAN = """
import json, resource, sys, time
import numpy as np
from puzzletron.dataset.config import PackingSpec
from puzzletron.dataset.packing import plan_packing
lengths = np.load({path!r}, mmap_mode="r")
t = time.perf_counter()
plan = plan_packing(lengths, PackingSpec({pack}), seed=0)
plan_s = time.perf_counter() - t
peak = next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({{"samples": int(lengths.shape[0]), "tokens": int(lengths.sum(dtype=np.int64)),
    "plan_s": plan_s, "peak_rss_mib": peak, "rows": plan.num_rows, "efficiency": plan.efficiency,
    "torch_imported": "torch" in sys.modules}}))
"""


def synthetic_lengths(work: Path, n: int) -> Path:
    """``<work>/lengths-<n>.npy``: `n` log-normal chat lengths (median 450, sigma 0.8, seed 0) as uint32,
    written once in chunks (a 75M-sample file never sits in memory whole)."""
    path = work / f"lengths-{n}.npy"
    if not path.is_file():
        rng = np.random.default_rng(0)
        out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint32, shape=(n,))
        for a in range(0, n, 1 << 22):
            m = min(1 << 22, n - a)
            out[a : a + m] = np.clip(np.rint(rng.lognormal(np.log(450), 0.8, size=m)), 1, 60_000)
        out.flush()
        del out
    return path


def bench_plan(work: Path, n: int) -> dict[str, Any]:
    return _fresh(_PLAN.format(path=str(synthetic_lengths(work, n)), pack=PACK))


def bench_policies(n: int = 200_000) -> list[dict[str, Any]]:
    """Log-normal chat lengths (median 600 tokens, sigma 1.0): about 17% of the tokens sit in samples longer
    than 4096, the share dropping loses on Puzzle-KD-like chat data."""
    from puzzletron.dataset.config import PackingSpec
    from puzzletron.dataset.packing import plan_packing

    lengths = np.clip(np.rint(np.random.default_rng(3).lognormal(np.log(600), 1.0, size=n)), 1, None)
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    out = []
    for policy in ("drop", "truncate", "split"):
        t = time.perf_counter()
        plan = plan_packing(lengths, PackingSpec(PACK, long_samples=policy), seed=0)
        out.append(
            {
                "policy": policy,
                "tokens_kept_pct": 100 * plan.total_tokens / total,
                "efficiency_pct": 100 * plan.efficiency,
                "rows": plan.num_rows,
                "dropped_samples": len(plan.dropped),
                "cut_samples": plan.cut_samples,
                "plan_s": time.perf_counter() - t,
            }
        )
    return out


def extrapolate(
    build: dict[str, Any] | None, read: list[dict[str, Any]], plan: dict[str, Any] | None
) -> list[str]:
    lines = ["EXTRAPOLATION to 45B tokens on 64 ranks (from the measured figures above, not a measurement):"]
    if build:
        per_proc = build["build_tokens_per_s_per_process"]
        procs = RANKS * 8  # 8 tokenising processes per rank's node share
        lines.append(
            f"  build once: {TOKENS_45B / per_proc / 3600:.0f} process-hours at {per_proc:,.0f} tokens/s "
            f"per process; {TOKENS_45B / (per_proc * procs) / 60:.0f} min with {RANKS} ranks x 8 processes "
            f"(shards spread over ranks; 1 -> 2 processes measured {build['speedup_2_proc']:.2f}x on 2 "
            "cores); every restart and every later rank reuses it"
        )
    lines.append(
        f"  disk: {TOKENS_45B * 2 / 1e9:.0f} GB of uint16 ids (vocab <= 65,536; x2 for uint32) + "
        f"{TOKENS_45B / 8 / 1e9:.1f} GB of mask bits + {75e6 * 12 / 1e9:.1f} GB of index"
    )
    if plan:
        lines.append(
            f"  time to first step per rank: open + plan {plan['samples'] / 1e6:.0f}M lengths "
            f"{plan['plan_s']:.0f} s (every rank plans the same plan; no communication) + first batch"
        )
        lines.append(
            f"  memory per rank: {plan['peak_rss_mib']:,.0f} MiB peak while planning 75M samples, then the "
            "plan (sample order 8 B/sample + rows) and the index memory maps; tokens never held"
        )
    if read:
        biggest = max(read, key=lambda r: r["store_tokens"])
        lines.append(
            f"  reading: {biggest['batches_per_s']:,.0f} batches/s of {BATCH}x{PACK} tokens on one core "
            f"= {biggest['batches_per_s'] * BATCH * PACK / 1e6:.1f}M tokens/s per rank, far above a GPU step"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="build,read,plan,policies,extrapolate")
    parser.add_argument("--workdir", type=Path, default=None, help="kept between runs (default: a temp dir)")
    parser.add_argument("--build-rows", type=int, default=20_000)
    parser.add_argument("--read-tokens", default="1e8,1e9")
    parser.add_argument("--plan-samples", type=float, default=75e6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-store-"))
    work.mkdir(parents=True, exist_ok=True)
    build = read = plan = None
    if "build" in parts:
        build = bench_build(work, args.build_rows, args.repeats)
        print(f"build   {json.dumps(build)}", flush=True)
    if "read" in parts:
        read = bench_read(work, [int(float(x)) for x in args.read_tokens.split(",")])
        for r in read:
            print(f"read    {json.dumps(r)}", flush=True)
    if "plan" in parts:
        plan = bench_plan(work, int(args.plan_samples))
        print(f"plan    {json.dumps(plan)}", flush=True)
    if "policies" in parts:
        for p in bench_policies():
            print(f"policy  {json.dumps(p)}", flush=True)
    if "extrapolate" in parts:
        print("\n".join(extrapolate(build, read or [], plan)))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Mixtures (`build_mixture_batches`, docs/mixtures.md): exact shares, images on every rank, balance, the
cost of mixing, and a second rank's first batch at 75M samples over three components.

    .venv/bin/python benchmarks/bench_mixture.py                        # every part (~15 min here)
    .venv/bin/python benchmarks/bench_mixture.py --parts quality,cost   # the rest skips the 75M plan

- ``quality``: the 3,000-sample VLM benchmark subset (`_vlm_synthetic`, its VLM store under the 32k
  processor) mixed with a synthetic 2e7-token text store, 35 % / 65 % of the real tokens, packs of 4096 and
  8192, dealt to 8 DP ranks with 1 and 2 rows a rank (and the text store with a second one, 8 ranks): the
  largest gap between a component's tokens and its share of everything delivered after any global step (in
  packs), the fill, the image tokens' share, steps with images on some ranks only, and per step the ranks'
  image and real tokens (max over mean, weighted by the step: `packing.balance.balance_report`).
- ``cost``: CPU per delivered real token (this process, no workers, medians of ``--repeats``) of a mixture
  of two text stores against `build_batches` on one; and of the VLM + text mixture against the token-weighted
  cost of `build_vlm_batches` and `build_batches` alone (same stores, same packs).
- ``scale``: 75M log-normal lengths (46.5B tokens) cut in three components (one with image tokens), each
  planned once into the plan cache, the mixture's epoch computed once (``cold``: the one rank that plans),
  then fresh processes as a second rank of 64 (``warm``): import, map the plans and the epoch, deal, build
  the first batch of 8 packs from a synthetic sample source (the tokens do not fit this disk). Time from
  process start, anonymous and private (USS) memory after the first batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

RANKS = 8
SHARES = {"vlm": 0.35, "text": 0.65}


def _spec(pack: int, modality: str) -> Any:
    from puzzletron.dataset.config import PuzzletronDataSpec

    raw = {"modality": modality, "layout": "packed_varlen", "max_sample_length": pack}
    return PuzzletronDataSpec.from_mapping(
        {**raw, "packing": {"pack_size": pack, "long_samples": "truncate"}}
    )


def _inputs(work: Path) -> dict[str, Path]:
    """The VLM subset and store, a text snapshot tokenised with the processor's tokenizer, and two synthetic
    token stores (built once in ``work``)."""
    from _synthetic import conversations
    from _vlm_synthetic import build_processor, make_subset
    from bench_store import _snapshot, synthetic_store
    from puzzletron.dataset.tokenize import build_token_store, build_vlm_store

    processor = build_processor(work)
    subset = make_subset(work, 3000)
    vlm = build_vlm_store(subset, processor=processor, cache_dir=work / "stores")
    small = make_subset(work, 600, seed=5)  # the cost part's whole epochs
    small_vlm = build_vlm_store(small, processor=processor, cache_dir=work / "stores")
    snapshot = _snapshot(work, conversations(6000, seed=1))
    text = build_token_store(snapshot, tokenizer=processor, cache_dir=work / "stores")
    a = synthetic_store(work / "synthetic-a", 20_000_000, seed=1)
    b = synthetic_store(work / "synthetic-b", 20_000_000, seed=2)
    return {
        "processor": processor,
        "subset": subset,
        "vlm": vlm,
        "text": text,
        "a": a,
        "b": b,
        "small_subset": small,
        "small_vlm": small_vlm,
    }


def _step_tokens(batches: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(cumulative [steps, K] real tokens per component, the whole deal [steps, dp, bs])``."""
    plan, deal = batches.plan, batches.sampler.deal()
    ids = deal.reshape(deal.shape[0], -1)
    component, _ = plan.locate(np.maximum(ids, 0))
    real = np.where(ids >= 0, plan.real_tokens[np.maximum(ids, 0)], 0)
    per = np.zeros((deal.shape[0], len(plan.names)), dtype=np.int64)
    np.add.at(
        per, (np.repeat(np.arange(deal.shape[0]), ids.shape[1]), component.reshape(-1)), real.reshape(-1)
    )
    return per.cumsum(axis=0), deal


def part_quality(inputs: dict[str, Path]) -> list[dict[str, Any]]:
    from puzzletron.dataset.packing.balance import balance_report
    from puzzletron.dataset.pipelines.mixture import build_mixture_batches

    rows = []
    for pack in (4096, 8192):
        for name, sources, shares, modality in (
            ("vlm+text", {"vlm": inputs["vlm"], "text": inputs["text"]}, SHARES, "multimodal"),
            ("text+text", {"a": inputs["a"], "b": inputs["b"]}, {"a": 0.7, "b": 0.3}, "text"),
        ):
            for bs in (1, 2):
                options = {"processor": inputs["processor"], "subsets": {"vlm": inputs["subset"]}}
                batches = build_mixture_batches(
                    sources, weights=shares, spec=_spec(pack, modality), batch_size=bs, dp_size=RANKS, seed=0,
                    **(options if modality == "multimodal" else {}),
                )  # fmt: skip
                cumulative, deal = _step_tokens(batches)
                share = np.array([shares[n] for n in batches.plan.names])
                totals = cumulative.sum(axis=1, keepdims=True)
                gap = np.abs(cumulative - totals * share).max(axis=0) / pack
                order = batches.plan.order(0)
                fill = batches.plan.real_tokens[order].sum() / (order.shape[0] * pack)
                image = batches.plan.image_tokens.astype(np.int64)
                balance = balance_report(deal, image, batches.plan.real_tokens.astype(np.int64))
                row = {
                    "mixture": name, "pack": pack, "batch": bs, "steps": int(deal.shape[0]),
                    "gap_packs": dict(zip(batches.plan.names, np.round(gap, 2).tolist(), strict=True)),
                    "fill": float(fill), "image_token_share": float(image[order].sum() / totals[-1, 0]),
                    "image_exceptions": batches.sampler.image_exceptions(), **balance,
                }  # fmt: skip
                rows.append(row)
                print(
                    f"{name:9s} pack {pack} batch {bs}: {row['steps']} steps, "
                    f"share gap {row['gap_packs']} packs, "
                    f"fill {fill:.4%}, image tokens {row['image_token_share']:.1%}, image exceptions "
                    f"{row['image_exceptions']}, image max/mean {balance['image_max_over_mean']:.3f} "
                    f"({balance['image_step_mean']:.3f}), "
                    f"real max/mean {balance['tokens_max_over_mean']:.4f}, "
                    f"image edge {balance['image_edge_ratio']:.2f}",
                    flush=True,
                )
    return rows


_COST = """
import json, sys, time
sys.path.insert(0, {bench!r})
from bench_mixture import _spec
from puzzletron.dataset.pipelines.mixture import build_mixture_batches
from puzzletron.dataset.pipelines.text import build_batches
from puzzletron.dataset.pipelines.vlm import build_vlm_batches
kind, pack, steps = {kind!r}, {pack}, {steps}
inputs = {inputs!r}
if kind == "one text":
    batches = build_batches(inputs["a"], spec=_spec(pack, "text"), batch_size=8, seed=0)
elif kind == "two texts":
    batches = build_mixture_batches({{"a": inputs["a"], "b": inputs["b"]}}, weights={{"a": 0.7, "b": 0.3}},
                                    spec=_spec(pack, "text"), batch_size=8, seed=0)
elif kind == "vlm":
    batches = build_vlm_batches(inputs["small_vlm"], processor=inputs["processor"],
                                subset=inputs["small_subset"], spec=_spec(pack, "multimodal"), batch_size=1,
                                seed=0)
elif kind == "text":
    batches = build_batches(inputs["text"], spec=_spec(pack, "text"), batch_size=1, seed=0)
else:
    batches = build_mixture_batches({{"vlm": inputs["small_vlm"], "text": inputs["text"]}},
                                    weights={shares!r}, spec=_spec(pack, "multimodal"), batch_size=1, seed=0,
                                    processor=inputs["processor"], subsets={{"vlm": inputs["small_subset"]}})
it = iter(batches)
next(it)  # warm: first reads, processor load (steps 0: the rest of the epoch)
start, tokens = time.process_time(), 0
for _, batch in zip(range(steps) if steps else iter(int, 1), it):
    tokens += int(batch.hidden_mask.sum())
by = {{}}
if hasattr(batches.plan, "report"):
    by = {{c.name: c.real_tokens for c in batches.plan.report()}}
print(json.dumps({{"cpu_s": time.process_time() - start, "tokens": tokens, "by_component": by}}))
"""


def _cost(inputs: dict[str, Path], kind: str, pack: int, steps: int, repeats: int) -> float:
    """Median CPU seconds per million delivered real tokens of ``kind`` (fresh processes; ``steps`` 0: the
    whole epoch after its first batch)."""
    code = _COST.format(
        bench=str(Path(__file__).parent), kind=kind, pack=pack, steps=steps,
        inputs={k: str(v) for k, v in inputs.items()}, shares=SHARES,
    )  # fmt: skip
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        runs.append(r["cpu_s"] / r["tokens"] * 1e6)
    return statistics.median(runs)


def part_cost(inputs: dict[str, Path], repeats: int) -> dict[str, Any]:
    text_one = _cost(inputs, "one text", 4096, 60, repeats)
    text_two = _cost(inputs, "two texts", 4096, 60, repeats)
    print(
        f"two text stores: {text_two:.3f} vs one store {text_one:.3f} CPU s / M tokens "
        f"({text_two / text_one:.2f}x)"
    )
    # The same documents on both sides: the 600-sample VLM store limits the mixture's epoch (one pass at
    # 35 %), so the mixture builds every VLM document once, as the VLM pipeline's epoch does.
    vlm = _cost(inputs, "vlm", 4096, 0, 1)
    text = _cost(inputs, "text", 4096, 60, repeats)
    mixed = _cost(inputs, "vlm+text", 4096, 0, 1)
    weighted = SHARES["vlm"] * vlm + SHARES["text"] * text
    print(
        f"vlm + text, a whole epoch: {mixed:.3f} vs token-weighted {weighted:.3f} CPU s / M tokens "
        f"({mixed / weighted:.2f}x; vlm alone {vlm:.3f}, text alone {text:.3f})"
    )
    return {"text_two": text_two, "text_one": text_one, "vlm": vlm, "text": text, "mixed": mixed}


_RANK = """
import json, time
t0 = time.perf_counter()
import numpy as np, psutil, torch
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
from puzzletron.dataset.distributed.mixture_sampler import MixtureSampler
from puzzletron.dataset.packing import row_sums
from puzzletron.dataset.packing.mixture import MixtureWeights
from puzzletron.dataset.packing.mixture_plan import MixtureComponent, MixturePlan
from puzzletron.dataset.packing.plan_cache import cached_plan
from puzzletron.dataset.pipelines._mixture_batches import MixtureBatches

class Synthetic:  # a SampleSource: real lengths, token ids made up (no disk)
    def __init__(self, lengths): self.lengths = lengths
    def __len__(self): return int(self.lengths.shape[0])
    def names(self, indices): return [str(i) for i in indices.tolist()]
    def gather(self, indices, starts, takes):
        n = int(takes.sum()); ids = np.arange(n, dtype=np.int64) % 30000
        return ids, np.where(np.arange(n) % 7 == 0, -100, ids)

t_import = time.perf_counter() - t0
spec = PackingSpec({pack})
names, components, sources, plans = ("code", "chat", "vlm"), [], [], []
for k, name in enumerate(names):
    lengths = np.load({work!r} + f"/lengths-{{k}}.npy", mmap_mode="r")
    plan = cached_plan(lengths, spec, lengths_identity=f"bench-{{k}}", cache={work!r} + "/plans", seed=0)
    image = np.load({work!r} + "/image-2.npy", mmap_mode="r") if name == "vlm" else None
    image_rows = row_sums(plan, image) if image is not None else np.zeros(plan.num_rows, np.int32)
    components.append(MixtureComponent(name, plan, np.asarray(plan.row_lengths, np.int32),
                                       image_rows.astype(np.int32), int(lengths.shape[0])))
    sources.append(Synthetic(lengths)); plans.append(plan)
weights = MixtureWeights.parse(names, {{"code": 0.3, "chat": 0.45, "vlm": 0.25}})
mixture = MixturePlan(tuple(components), weights, seed=0, row_size={pack}, cache={work!r} + "/plans")
t = time.perf_counter()
sampler = MixtureSampler(mixture, batch_size={batch}, dp_rank=1, dp_size={ranks})
data = PuzzletronDataSpec("text", "packed_varlen", {pack}, packing=spec)
dataset = MixtureBatches(names, tuple(sources), tuple(plans), mixture.offsets, data)
batch = dataset[next(iter(sampler))]
t_first = time.perf_counter() - t0
info = psutil.Process().memory_full_info()
rollup = {{l.split(":")[0]: int(l.split()[1]) / 1024
          for l in open("/proc/self/smaps_rollup") if l.endswith("kB\\n")}}
peak = next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({{"first_batch_s": t_first, "after_import_s": t_first - t_import,
    "deal_s": time.perf_counter() - t,
    "anon_mib": rollup["Anonymous"], "uss_mib": info.uss / 2**20, "peak_rss_mib": peak,
    "rows": int(mixture.offsets[-1]), "tokens": int(batch.hidden_mask.sum())}}))
"""


def part_scale(work: Path, n: int, repeats: int) -> dict[str, Any]:
    from bench_store import synthetic_lengths

    lengths = np.load(synthetic_lengths(work, n), mmap_mode="r")
    thirds = np.array_split(np.arange(n), 3)
    for k, part in enumerate(thirds):
        if not (work / f"lengths-{k}.npy").is_file():
            np.save(work / f"lengths-{k}.npy", np.asarray(lengths[part[0] : part[-1] + 1]))
    if not (work / "image-2.npy").is_file():  # the vlm component: image tokens of each sample
        part = np.load(work / "lengths-2.npy", mmap_mode="r")
        rng = np.random.default_rng(0)
        image = (np.asarray(part) * rng.uniform(0.3, 0.8, size=part.shape[0])).astype(np.int32)
        np.save(work / "image-2.npy", np.where(rng.random(part.shape[0]) < 0.8, image, 0).astype(np.int32))
    code = _RANK.format(work=str(work), pack=4096, batch=8, ranks=64)

    def fresh() -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    t = time.perf_counter()
    cold = fresh()  # plans every component and the epoch, publishes them
    cold["wall_s"] = time.perf_counter() - t
    warm = [fresh() for _ in range(repeats)]
    med = {k: statistics.median(w[k] for w in warm) for k in warm[0]}
    for label, r in (("cold", cold), ("warm", med)):
        print(
            f"{label}: first batch {r['first_batch_s']:.2f} s from process start "
            f"({r['after_import_s']:.2f} s after "
            f"the imports), anonymous {r['anon_mib']:.0f} MiB, USS {r['uss_mib']:.0f} MiB, peak RSS "
            f"{r['peak_rss_mib']:.0f} MiB, {r['rows']:,} packs",
            flush=True,
        )
    return {"cold": cold, "warm": med}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="quality,cost,scale")
    parser.add_argument("--samples", type=float, default=75e6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None, help="kept between runs (default: a temp dir)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        inputs = _inputs(work) if {"quality", "cost"} & set(parts) else {}
        if "quality" in parts:
            part_quality(inputs)
        if "cost" in parts:
            part_cost(inputs, args.repeats)
        if "scale" in parts:
            (work / "scale").mkdir(exist_ok=True)
            part_scale(work / "scale", int(args.samples), args.repeats)


if __name__ == "__main__":
    main()

"""VLM benchmarks (issue 16): the native path (`build_vlm_batches`) side by side with NeMo AutoModel 0.7.0's
neat VLM packing (`neat_pack_dataset_vlm`, packing_ratio 0.9, the factory's items) in one run.

    .venv/bin/python benchmarks/bench_vlm.py                      # everything (~10 min the first time)
    .venv/bin/python benchmarks/bench_vlm.py --parts pack,cpu --workdir /tmp/bench-vlm --steps 40

Inputs (``benchmarks/_vlm_synthetic.py``, written once into ``--workdir``): a Nemotron-like subset of
``--samples`` (3,000) samples, 0-4 JPEG images a sample with sides of 64-1500 px, log-normal text; a
Qwen2.5-VL-style processor with the real pixel limits and a 32k BPE. 8 DP ranks, pack 4096 and 8192.

Parts:

- ``build``: the VLM store: samples/s per process (1 process), bytes per sample on disk.
- ``pack``: fill (real tokens / slots over all packs), overflow (samples dropped when a pack is built),
  empty packs, tokens kept, for ours (exact lengths; ``drop`` and ``truncate``) and for AutoModel (its
  bins, realised as its ``PackedDatasetWrapper`` realises them from the true lengths: checked against its
  own ``__getitem__`` in ``cpu``), without and with our length hints; balance over 8 ranks
  (`balance_report`: per step max/mean of image and real tokens, first vs last tenth of the epoch).
- ``cpu``: CPU seconds per delivered (real) token of rank 0's first ``--steps`` batches through a DataLoader
  with 2 workers (decode, image processor, collate; workers included: the children's CPU counted), and the
  peak RSS of a worker; each path in a fresh process.
- ``plan``: planning on a reused store (open, plan, per-pack loads, the epoch's balanced deal): us and
  traced bytes per sample, at ``--samples`` and ``--large`` (100k, a tiled store), in fresh processes.
- ``first``: time to the first batch of rank 0 (open, plan, deal, first batch), at both sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["main"]

RANKS = 8
PACKS = (4096, 8192)
RATIO = 0.9  # AutoModel's packing_ratio, as the original Puzzletron sets it
FAKE_IMAGE_TOKENS = 4  # AutoModel's injected 56x56 image under min_pixels 3136: a 4x4 grid, 4 tokens


def _child(
    part: str, args: dict[str, Any], module: str = "bench_vlm", *, src: Path | None = None
) -> dict[str, Any]:
    """Run ``module._measure_<part>(args)`` in a fresh interpreter (its own CPU and RSS accounting), with the
    library at `src` (another checkout's ``src/``) first on its import path when given."""
    code = f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); import {module}; " \
           f"print(json.dumps({module}._measure_{part}(json.loads(sys.argv[1]))))"  # fmt: skip
    env = None if src is None else {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _spec(pack: int, policy: str = "drop") -> Any:
    from puzzletron.dataset.config import PuzzletronDataSpec

    packing = {"pack_size": pack, "long_samples": policy}
    return PuzzletronDataSpec.from_mapping(
        {"modality": "multimodal", "layout": "packed_varlen", "max_sample_length": pack, "packing": packing}
    )


# --------------------------------------------------------------------------------------------- AutoModel


def _rope_index() -> Any:
    """Qwen2.5-VL's own get_rope_index on a config-only stand-in (what the recipe resolves from the model)."""
    import types

    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    stub = types.SimpleNamespace(config=Qwen2_5_VLConfig())
    stub.get_vision_position_ids = types.MethodType(Qwen2_5_VLModel.get_vision_position_ids, stub)
    return types.MethodType(Qwen2_5_VLModel.get_rope_index, stub)


class _NoHints:
    """The factory's items without our length hints (AutoModel as the issue measured it)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self.dataset[i]
        item.pop("mm_inputs_meta", None)
        item.pop("_text_tokens", None)
        return item


def _automodel_packs(subset: Path, processor_dir: Path, pack: int, hints: str, store: Path | None) -> Any:
    """AutoModel's ``PackedDatasetWrapper`` over the factory's items (``hints``: none, sizes, exact)."""
    import logging

    from nemo_automodel.components.datasets.vlm.datasets import PreTokenizedDatasetWrapper
    from nemo_automodel.components.datasets.vlm.neat_packing_vlm import neat_pack_dataset_vlm

    from puzzletron.dataset import load_materialized_conversation_dataset
    from puzzletron.fixtures.tokenizer import load_qwen2_5_vl_processor

    logging.getLogger("nemo_automodel").setLevel(logging.WARNING)
    processor = load_qwen2_5_vl_processor(processor_dir)
    raw = load_materialized_conversation_dataset(subset, vlm_store=store if hints == "exact" else None)
    ds_raw = _NoHints(raw) if hints == "none" else raw
    wrapped = PreTokenizedDatasetWrapper(ds_raw, processor)
    packed = neat_pack_dataset_vlm(
        wrapped, pack, padding_idx=processor.tokenizer.pad_token_id or 0, get_rope_index=_rope_index(),
        ds_raw=ds_raw, packing_ratio=RATIO, processor=processor,
    )  # fmt: skip
    return packed, raw


def _realised(
    bins: list[list[int]], length: np.ndarray, image: np.ndarray, pack: int
) -> dict[str, np.ndarray]:
    """What ``PackedDatasetWrapper.__getitem__`` keeps of each bin (``neat_packing_vlm.py:572``): a sample
    over ``pack`` is skipped, then samples in bin order while they fit; per pack its real and image tokens
    and the samples and tokens it drops."""
    tokens, images, dropped, dropped_tokens = (np.zeros(len(bins), np.int64) for _ in range(4))
    for p, members in enumerate(bins):  # a few thousand bins: the simulation, not the code measured
        total = 0
        for i in members:
            if length[i] <= pack and total + length[i] <= pack:
                total += length[i]
                images[p] += image[i]
            else:
                dropped[p] += 1
                dropped_tokens[p] += length[i]
        tokens[p] = total
    return {"tokens": tokens, "image": images, "dropped": dropped, "dropped_tokens": dropped_tokens}


# --------------------------------------------------------------------------------------------- children


def _measure_cpu(args: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's first ``steps`` batches through a DataLoader with 2 workers: CPU (this process and its
    workers) per delivered token, peak worker RSS."""
    import resource

    import torch

    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    steps, pack = int(args["steps"]), int(args["pack"])
    if args["path"] == "ours":
        from puzzletron.dataset.pipelines.vlm import build_vlm_batches

        batches = build_vlm_batches(  # bf16 pixels: AutoModel's collater casts to bf16 too
            args["store"], processor=args["processor"], subset=args["subset"], spec=_spec(pack), batch_size=1,
            dp_rank=0, dp_size=RANKS, seed=0, pixel_dtype=torch.bfloat16,
        )  # fmt: skip
        start = cpu()
        loader = batches.loader(num_workers=2)
        delivered, seen = 0, 0
        for seen, batch in enumerate(loader, start=1):
            delivered += int(batch.hidden_mask.sum())
            if seen == steps:
                break
        realised = []
    else:
        from functools import partial

        from nemo_automodel.components.datasets.vlm.collate_fns import neat_packed_vlm_collater
        from torch.utils.data import DataLoader, DistributedSampler

        packed, _ = _automodel_packs(Path(args["subset"]), Path(args["processor"]), pack, "none", None)
        sampler = DistributedSampler(packed, num_replicas=RANKS, rank=0, shuffle=False)
        collate = partial(neat_packed_vlm_collater, padding_idx=packed.padding_idx)
        start = cpu()
        loader = DataLoader(packed, batch_size=1, sampler=sampler, collate_fn=collate, num_workers=2)
        delivered, seen, realised = 0, 0, []
        for batch in loader:
            mask = batch["attention_mask"]  # [B, 1, S, S] block-causal, padding rows all False
            real = int(mask[:, 0].any(dim=-1).sum()) if mask.dim() == 4 else int((mask != 0).sum())
            realised.append(real)
            delivered += real
            seen += 1
            if seen == steps:
                break
    del loader  # workers exit: their CPU and peak RSS land in RUSAGE_CHILDREN
    import gc

    gc.collect()
    time.sleep(0.5)
    used = cpu() - start
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    del torch
    return {"cpu_s": used, "tokens": delivered, "steps": seen, "worker_peak_rss": rss, "realised": realised}


def _plan_once(path: str, pack: int, cache: str) -> Any:
    """What a rank does on a reused store before its first batch: open the store, the plan (from the plan
    cache: memory-mapped), the per-pack loads, its column of the epoch's balanced deal."""
    from puzzletron.dataset.pipelines.vlm import build_vlm_batches

    batches = build_vlm_batches(
        path, processor=None, spec=_spec(pack), batch_size=1, dp_size=RANKS, plan_cache=cache
    )
    batches.sampler.key(0)
    return batches


def _measure_plan(args: dict[str, Any]) -> dict[str, Any]:
    """Planning on a reused store (the plan cache filled once first): the median time of untraced runs,
    then one traced run: the peak and what stays allocated per sample."""
    import tracemalloc

    n, pack, cache = int(args["samples"]), int(args["pack"]), args["cache"]
    start = time.perf_counter()
    _plan_once(args["store"], pack, cache)  # the first rank: plans and publishes (and lazy imports)
    first = time.perf_counter() - start
    times = []
    for _ in range(int(args["repeats"])):
        start = time.perf_counter()
        _plan_once(args["store"], pack, cache)
        times.append(time.perf_counter() - start)
    tracemalloc.start()
    kept = _plan_once(args["store"], pack, cache)
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del kept
    return {"us_per_sample": statistics.median(times) / n * 1e6, "peak_bytes_per_sample": peak / n,
            "kept_bytes_per_sample": current / n, "seconds": statistics.median(times),
            "first_plan_seconds": first}  # fmt: skip


def _measure_first(args: dict[str, Any]) -> dict[str, Any]:
    """Seconds from `build_vlm_batches` on a reused store to rank 0's first batch (libraries imported
    before; the processor's loading counted)."""
    import transformers  # noqa: F401  (imported by any training script already)

    from puzzletron.dataset.pipelines.vlm import build_vlm_batches

    start = time.perf_counter()
    batches = build_vlm_batches(
        args["store"], processor=args["processor"], subset=args["subset"], spec=_spec(int(args["pack"])),
        batch_size=1, dp_rank=0, dp_size=RANKS, seed=0,
    )  # fmt: skip
    next(iter(batches))
    return {"seconds": time.perf_counter() - start}


# --------------------------------------------------------------------------------------------- parts


def _store(work: Path, subset: Path, processor: Path) -> Path:
    from puzzletron.dataset.tokenize import build_vlm_store

    return build_vlm_store(subset, processor=processor, cache_dir=work / "stores")


def part_build(work: Path, subset: Path, processor: Path, repeats: int) -> dict[str, Any]:

    from puzzletron.dataset.formats.manifest import bytes_on_disk
    from puzzletron.dataset.formats.vlm_store import VlmStore
    from puzzletron.dataset.tokenize import build_vlm_store, vlm_processor

    vlm_processor(processor)  # loaded once, as a reused process has it
    rates = []
    for r in range(repeats):
        out = work / f"build-{r}"
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        build_vlm_store(subset, processor=processor, output=out)
        rates.append(len(VlmStore(out)) / (time.perf_counter() - start))
    store = VlmStore(out)
    result = {"samples_per_s": statistics.median(rates), "bytes_per_sample": bytes_on_disk(out) / len(store)}
    result |= {"tokens_per_sample": store.num_tokens / len(store), "images": store.num_images}
    for r in range(repeats):
        shutil.rmtree(work / f"build-{r}", ignore_errors=True)
    return result


def _ours_pack(store_path: Path, pack: int, policy: str) -> dict[str, Any]:
    from puzzletron.dataset.distributed import DistributedPackSampler
    from puzzletron.dataset.formats.vlm_store import VlmStore
    from puzzletron.dataset.packing import balance_report, plan_vlm, row_sums

    store = VlmStore(store_path)
    plan = plan_vlm(store.lengths, store.media_end, _spec(pack, policy), seed=0)
    image = row_sums(plan, store.image_tokens)
    sampler = DistributedPackSampler(plan.num_rows, batch_size=1, dp_rank=0, dp_size=RANKS, seed=0,
                                     loads=np.stack([image, plan.row_lengths], axis=1))  # fmt: skip
    report = balance_report(sampler.deal(), image, plan.row_lengths)
    overflow, empty = int((plan.row_lengths > pack).sum()), int((np.diff(plan.row_offsets) == 0).sum())
    return {
        "packs": plan.num_rows, "fill": plan.efficiency, "overflow": overflow, "empty": empty,
        "kept": plan.total_tokens / int(store.num_tokens), "dropped_samples": len(plan.dropped),
        "cut_samples": plan.cut_samples, **report,
    }  # fmt: skip


def _automodel_pack(subset: Path, processor: Path, store_path: Path, pack: int, hints: str) -> dict[str, Any]:
    import torch
    from torch.utils.data import DistributedSampler

    from puzzletron.dataset.formats.vlm_store import VlmStore
    from puzzletron.dataset.packing import balance_report

    packed, raw = _automodel_packs(subset, processor, pack, hints, store_path)
    store = VlmStore(store_path)
    n = len(raw)
    rows = np.fromiter((int(i.split(":")[0]) for i in store.sample_ids(np.arange(len(store)))), np.int64)
    length, image = np.zeros(n, np.int64), np.zeros(n, np.int64)
    length[rows], image[rows] = store.lengths, store.image_tokens
    length[rows[image[rows] == 0]] += (
        FAKE_IMAGE_TOKENS + 2
    )  # AutoModel injects a fake image, with its markers
    length = length - 1  # its autoregressive shift drops each sample's last token
    real = _realised(packed.bins, length, image, pack)
    out: dict[str, Any] = {
        "packs": len(packed.bins),
        "fill": real["tokens"].sum() / (len(packed.bins) * pack),
    }
    out |= {"overflow": int(real["dropped"].sum()), "empty": int((real["tokens"] == 0).sum())}
    out |= {"kept": real["tokens"].sum() / length[rows].sum()}
    for shuffle in (False, True):
        sampler = DistributedSampler(
            range(len(packed.bins)), num_replicas=RANKS, rank=0, shuffle=shuffle, seed=0
        )
        per_rank = []
        for r in range(RANKS):
            sampler.rank = r
            per_rank.append(list(iter(sampler)))
        steps = min(len(x) for x in per_rank)
        deal = torch.tensor([x[:steps] for x in per_rank]).T.reshape(steps, RANKS, 1).numpy()
        report = balance_report(deal, real["image"], real["tokens"])
        out |= {f"{k}{'' if shuffle else '_unshuffled'}": v for k, v in report.items()}
    out["rank0_realised"] = real["tokens"][: len(packed.bins) : RANKS].tolist()  # unshuffled rank 0, in order
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="build,pack,cpu,plan,first")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/puzzletron-bench-vlm"))
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--large", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    from _vlm_synthetic import build_processor, make_subset, tile_store

    start = time.perf_counter()
    processor = build_processor(work)
    subset = make_subset(work, args.samples)
    store = _store(work, subset, processor)
    print(json.dumps({"prepared_s": round(time.perf_counter() - start, 1), "store": str(store)}), flush=True)
    results: dict[str, Any] = {}
    if "build" in parts:
        results["build"] = part_build(work, subset, processor, max(1, args.repeats - 1))
        print(json.dumps({"build": results["build"]}), flush=True)
    if "pack" in parts:
        for pack in PACKS:
            row = {
                "ours_drop": _ours_pack(store, pack, "drop"),
                "ours_truncate": _ours_pack(store, pack, "truncate"),
            }
            for hints in ("none", "sizes", "exact"):
                row[f"automodel_{hints}"] = _automodel_pack(subset, processor, store, pack, hints)
            results[f"pack_{pack}"] = row
            print(json.dumps({f"pack_{pack}": row}), flush=True)
    if "cpu" in parts:
        for pack in PACKS:
            common = {"store": str(store), "processor": str(processor), "subset": str(subset), "pack": pack}
            ours = _child("cpu", {**common, "path": "ours", "steps": args.steps})
            theirs = _child("cpu", {**common, "path": "automodel", "steps": args.steps})
            row = {"ours": ours, "automodel": theirs}
            row["ratio"] = (ours["cpu_s"] / ours["tokens"]) / (theirs["cpu_s"] / theirs["tokens"])
            results[f"cpu_{pack}"] = row
            print(json.dumps({f"cpu_{pack}": row}), flush=True)
    if parts & {"plan", "first"}:
        large = tile_store(store, args.large, work / f"tiled-{args.large}")
        for name, path, n in (("small", store, args.samples), ("large", large, args.large)):
            common = {"store": str(path), "processor": str(processor), "subset": str(subset), "pack": 4096}
            if "plan" in parts:
                cache = str(work / f"plans-{name}")
                shutil.rmtree(cache, ignore_errors=True)  # the first rank of this run plans
                measure = {**common, "samples": n, "repeats": args.repeats, "cache": cache}
                results[f"plan_{name}"] = _child("plan", measure)
                print(json.dumps({f"plan_{name}": results[f"plan_{name}"]}), flush=True)
            if "first" in parts:
                runs = [_child("first", common)["seconds"] for _ in range(args.repeats)]
                results[f"first_{name}"] = {"seconds": statistics.median(runs), "runs": runs}
                print(json.dumps({f"first_{name}": results[f"first_{name}"]}), flush=True)
    if "cpu" in parts and "pack" in parts:  # AutoModel's own __getitem__ against the simulation of it
        for pack in PACKS:
            seen = results[f"cpu_{pack}"]["automodel"]["realised"]
            simulated = results[f"pack_{pack}"]["automodel_none"]["rank0_realised"][: len(seen)]
            shift = [a - b for a, b in zip(seen, simulated, strict=True)]
            print(
                json.dumps({f"simulation_check_{pack}": {"packs": len(seen), "differences": shift}}),
                flush=True,
            )
    old = json.loads((work / "results.json").read_text()) if (work / "results.json").is_file() else {}
    (work / "results.json").write_text(json.dumps({**old, **results}, indent=1))


if __name__ == "__main__":
    main()

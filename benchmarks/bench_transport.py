"""What a VLM batch costs to build and to cross from a loader worker to the trainer, pixels copied at the
crossing or built where they cross (issue 25: `distributed.transport.batch_buffer`).

    .venv/bin/python benchmarks/bench_transport.py                   # pack 8192, bfloat16 and uint8
    PYTHONPATH=OLD/src .venv/bin/python benchmarks/bench_transport.py   # an older build: "copied" only

Inputs: ``benchmarks/bench_vlm.py``'s subset and VLM store (``--workdir``, shared with ``bench_vlm_cpu.py``).
One process plays both sides, so the noise of two processes on a shared VM stays out: for each of the
first ``--batches`` batches of rank 0 of 8 it builds the batch as a worker does (``copied``: in private
memory; ``placed``: with `place_in_segments` on, its pixels in a segment of the pool), pickles it as the
worker's queue does (``ForkingPickler`` of `SharedTensors`: the segment filled) and unpickles it as the
trainer does. Printed per delivered token (us of CPU, the minimum over ``--repeats`` passes): ``build``,
``cross`` (pickle + unpickle) and their sum.

Figures (2-core VM shared with other jobs; pack 8192, 10 batches of rank 0 of 8, 81,898 tokens, minimum of
7 passes; us of CPU a delivered token). "before" is e176e9e (the segment filled with torch's ``copy_``):

================================  ===========  ===========  ===========  ===========
                                  bfloat16                  uint8
--------------------------------  ------------------------  ------------------------
                                  build        cross        build        cross
================================  ===========  ===========  ===========  ===========
before: copied (torch ``copy_``)  27.2         1.62         24.3         0.96
copied (memmove)                  28.8         1.21         24.8         0.87
placed (built in the segment)     28.0         0.35         25.1         0.34
================================  ===========  ===========  ===========  ===========

The crossing of a placed batch is the pickle of its small tensors and its metadata (about 0.35 us a token
in either dtype); the pixels' copy it saves was 1.3 us a token in bfloat16 (0.6 in uint8). Builds swing by
1-2 us a token from run to run here, more than what placing changes in them.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["main"]


def _measure(batches: Any, keys: list[Any], *, placed: bool, repeats: int) -> dict[str, float]:
    from puzzletron.dataset.distributed import transport

    transport._PLACING = False
    if placed:
        transport.place_in_segments(0)
    best = {"build": float("inf"), "cross": float("inf")}
    tokens = 0
    for _ in range(repeats):
        build = cross = 0.0
        tokens = 0
        for key in keys:
            start = time.process_time()
            batch = batches.dataset[key]
            built = time.process_time()
            tokens += int(batch.hidden_mask.sum())
            data = ForkingPickler.dumps(transport.SharedTensors(batch))
            del batch
            got = pickle.loads(data)
            crossed = time.process_time()
            del got
            build += built - start
            cross += crossed - built
        best = {"build": min(best["build"], build), "cross": min(best["cross"], cross)}
    transport._PLACING = False
    per = {k: v / tokens * 1e6 for k, v in best.items()}
    return {**per, "total": per["build"] + per["cross"], "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/puzzletron-bench-vlm"))
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--pack", type=int, default=8192)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--modes", default="bfloat16,uint8")
    args = parser.parse_args()
    import torch

    from _vlm_synthetic import build_processor, make_subset
    from bench_vlm import _store
    from bench_vlm_cpu import _batches
    from puzzletron.dataset.distributed import transport
    from puzzletron.dataset.distributed.worker_memory import keep_freed_memory

    torch.set_num_threads(1)  # as in a DataLoader worker
    keep_freed_memory()  # as in a batch_loader worker
    work = args.workdir
    processor = build_processor(work)
    subset = make_subset(work, args.samples)
    store = _store(work, subset, processor)
    can_place = hasattr(transport, "place_in_segments")
    for mode in filter(None, args.modes.split(",")):
        run = {"store": store, "processor": processor, "subset": subset, "pack": args.pack, "mode": mode}
        batches = _batches(run)  # rank 0 of bench_vlm_cpu.RANKS, as there
        keys = list(batches.sampler)[: args.batches]
        batches.dataset[keys[0]]  # the processor's tables, the first decode
        row = {"copied": _measure(batches, keys, placed=False, repeats=args.repeats)}
        if can_place:
            row["placed"] = _measure(batches, keys, placed=True, repeats=args.repeats)
        print(json.dumps({f"{mode}_{args.pack}": row}), flush=True)


if __name__ == "__main__":
    main()

"""The VLM loader's CPU per delivered token against another checkout of this repository, run in turn.

    git worktree add /tmp/puzzletron-before 8e524ea^       # the code before issue 25
    .venv/bin/python benchmarks/bench_vlm_ab.py --against /tmp/puzzletron-before
    .venv/bin/python benchmarks/bench_vlm_ab.py --against /tmp/puzzletron-before --modes uint8,decoded

On a shared machine the same build swings by a third from minute to minute, so a ratio of two separate
benchmark runs says little; this one runs the baseline and ours in turn, one loader run each, many times,
and reports every pair's ratio and their median. Each side builds its own inputs with its own benchmark
code and library (``bench_vlm.py``'s 3,000-sample subset, processor and VLM store, into
``<workdir>/against`` and ``<workdir>/this``: a store's format may differ between the two), then the same
harness measures both (``bench_vlm_cpu._measure_loader`` of this checkout, the library of each side on
``PYTHONPATH``): rank 0 of 8, ``batch_size`` 1, ``packed_varlen``, the CPU of the trainer and its
``--workers`` over batches ``--skip`` .. ``--steps``. The baseline always runs the default ``bfloat16``;
ours runs each of ``--modes`` after it (so ``uint8`` and ``decoded`` are measured against the baseline's
default, as issue 25's targets are). Figures are in ``bench_vlm_cpu.py``'s docstring.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_vlm  # noqa: E402  (beside this script)


def _python(code: str, src: Path, *args: str) -> Any:
    """The JSON that `code` prints last, run in a fresh interpreter with `src` first on the import path."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _prepare(checkout: Path, work: Path, samples: int) -> dict[str, str]:
    """`checkout`'s subset, processor and VLM store in `work`, built by its own benchmark code and library
    (once: later calls find them)."""
    code = (
        "import json, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
        "from _vlm_synthetic import build_processor, make_subset; from bench_vlm import _store; "
        "work = Path(sys.argv[2]); processor = build_processor(work); "
        "subset = make_subset(work, int(sys.argv[3])); store = _store(work, subset, processor); "
        "print(json.dumps({'processor': str(processor), 'subset': str(subset), 'store': str(store)}))"
    )
    work.mkdir(parents=True, exist_ok=True)
    return _python(code, checkout / "src", str(checkout / "benchmarks"), str(work), str(samples))


def _loader(src: Path, run: dict[str, Any]) -> float:
    """us of CPU per delivered token of one loader run of `run` with the library at `src`."""
    return bench_vlm._child("loader", run, module="bench_vlm_cpu", src=src)["cpu_per_token_s"] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, required=True, help="the baseline checkout (a worktree)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/puzzletron-bench-vlm-ab"))
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--skip", type=int, default=30, help="first batches left out (startup, warm pools)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--modes", default="bfloat16", help="ours, each against the baseline's bfloat16")
    parser.add_argument("--packs", default="4096,8192")
    args = parser.parse_args()
    this, against = HERE.parent, args.against.resolve()
    inputs = {
        "against": _prepare(against, args.workdir / "against", args.samples),
        "this": _prepare(this, args.workdir / "this", args.samples),
    }
    common = {"steps": args.steps, "skip": args.skip, "workers": args.workers}
    modes, packs = args.modes.split(","), [int(p) for p in args.packs.split(",")]
    ratios: dict[str, list[float]] = {f"{m}_{p}": [] for m in modes for p in packs}
    for pair in range(1, args.pairs + 1):
        for pack in packs:
            run = {**common, "pack": pack, "mode": "bfloat16"}
            before = _loader(against / "src", {**inputs["against"], **run})
            ours = {m: _loader(this / "src", {**inputs["this"], **run, "mode": m}) for m in modes}
            for mode, us in ours.items():
                ratios[f"{mode}_{pack}"].append(us / before)
            figures = {"pair": pair, "pack": pack, "against_us": round(before, 2)}
            figures.update({f"{m}_us": round(us, 2) for m, us in ours.items()})
            figures.update({f"{m}_ratio": round(us / before, 3) for m, us in ours.items()})
            print(json.dumps(figures), flush=True)
    print(json.dumps({"median_ratio": {k: round(statistics.median(v), 3) for k, v in ratios.items()}}))


if __name__ == "__main__":
    main()

"""Acquisition throughput and memory through a loopback olah mirror of generated fixture repositories.

Measures, each in a fresh child process with a cold Hub cache (so downloads through the mirror count):

- Puzzle-KD: 8,192 train + 1,024 validation rows -> rows/s and peak RSS;
- Nemotron-VLM: 512 samples over the three image subsets -> images/s and peak RSS;
- the same two on a repository with 4x the shards (same shard size): peak RSS must not grow with the number
  of shards in the repository, since shards are fetched one at a time and only while rows are missing.

Run: ``.venv/bin/python benchmarks/bench_acquisition.py [--repeats 3]``; prints medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from puzzletron.fixtures.hub import FixtureSizes, generate_fixture_hub
from puzzletron.fixtures.mirror import serve_hub

BASE = FixtureSizes(
    puzzle_kd_train_rows=4 * 3000,
    puzzle_kd_validation_rows=2 * 800,
    puzzle_kd_train_shards=4,
    puzzle_kd_validation_shards=2,
    vlm_images_per_shard=200,
    vlm_shards_per_subset=3,
    image_size=(320, 240),
    intersyn_rows=20,
)
WIDE = FixtureSizes(  # 4x the shards, each the same size as in BASE
    puzzle_kd_train_rows=16 * 3000,
    puzzle_kd_validation_rows=8 * 800,
    puzzle_kd_train_shards=16,
    puzzle_kd_validation_shards=8,
    vlm_images_per_shard=200,
    vlm_shards_per_subset=12,
    image_size=(320, 240),
    intersyn_rows=20,
)


def _peak_rss_mib() -> float:
    """This process's peak RSS. ``VmHWM`` is per address space; ``ru_maxrss`` is not: Linux carries the
    parent's high-water mark across fork+exec, so a child started by a big parent reports the parent's."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(kind: str, out: str) -> None:
    from puzzletron.dataset import (
        TextAcquisitionSpec,
        VlmAcquisitionSpec,
        materialize_nemotron_vlm_dataset,
        materialize_puzzle_kd_dataset,
    )

    start = time.perf_counter()
    if kind == "puzzle-kd":
        manifest = materialize_puzzle_kd_dataset(TextAcquisitionSpec(output_dir=Path(out)))
        count = sum(manifest["splits"].values())
    else:
        manifest = materialize_nemotron_vlm_dataset(VlmAcquisitionSpec(output_dir=Path(out)))
        count = manifest["image_count"]
    seconds = time.perf_counter() - start
    peak_mib = _peak_rss_mib()
    print(json.dumps({"count": count, "seconds": seconds, "peak_rss_mib": peak_mib}))


def _measure(kind: str, endpoint: str, work: Path) -> dict:
    home = Path(tempfile.mkdtemp(dir=work, prefix="hf-"))
    out = Path(tempfile.mkdtemp(dir=work, prefix="out-")) / "snapshot"
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(home)}
    done = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(out)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("KIND", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    with tempfile.TemporaryDirectory(prefix="bench-acq-") as tmp:
        work = Path(tmp)
        for label, sizes in (("base", BASE), ("4x shards", WIDE)):
            start = time.perf_counter()
            generate_fixture_hub(work / label.replace(" ", "-"), sizes=sizes)
            print(f"[{label}] fixture repositories generated in {time.perf_counter() - start:.1f}s")
            with serve_hub(work / label.replace(" ", "-")) as endpoint:
                for kind, unit in (("puzzle-kd", "rows"), ("nemotron-vlm", "images")):
                    runs = [_measure(kind, endpoint, work) for _ in range(args.repeats)]
                    rate = statistics.median(r["count"] / r["seconds"] for r in runs)
                    rss = statistics.median(r["peak_rss_mib"] for r in runs)
                    secs = statistics.median(r["seconds"] for r in runs)
                    print(
                        f"[{label}] {kind:13s} {runs[0]['count']:6d} {unit:6s} median {secs:6.2f}s "
                        f"{rate:9.0f} {unit}/s  peak RSS {rss:7.1f} MiB  (n={len(runs)}, cold cache)"
                    )


if __name__ == "__main__":
    main()

"""Benchmarks of the offline subset format; prints medians of repeats.

(a) Materialise photo-like 640x480 JPEGs two ways in the same run: keeping the encoded bytes (what we do)
    versus decoding and re-encoding every image as PNG (what the original did). Target: keep >= 5x faster.
(b) A 100,000-sample subset: open it and read 1,000 random samples in a fresh subprocess. Targets: < 1 s
    and < 200 MB resident for the reader (measured as the RSS growth over the interpreter after imports;
    the absolute RSS is printed too).

    python benchmarks/bench_subsets.py                    # both parts, defaults below
    python benchmarks/bench_subsets.py --part b --samples 100000 --image-every 10   # fewer image files
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from puzzletron.dataset.formats.subset import materialize_normalized_conversation_samples

SOURCE = {"dataset": "bench/photos", "revision": "0" * 40}


def photo_jpeg(seed: int, size: tuple[int, int] = (640, 480)) -> bytes:
    """A synthetic photo: smooth colour gradients, a few soft blobs, sensor-like noise; JPEG quality 90."""
    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.zeros((h, w, 3), np.float32)
    for c in range(3):
        a, b, off = rng.uniform(-0.3, 0.3), rng.uniform(-0.3, 0.3), rng.uniform(40, 200)
        img[..., c] = off + a * x + b * y
    for _ in range(6):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(30, 160)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))[..., None]
        img += blob * rng.uniform(-80, 80, 3)
    img += rng.normal(0, 6, img.shape)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB").save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _sample(i: int, image: Any) -> dict[str, Any]:
    return {
        "conversation": [
            {
                "role": "user",
                "content": [{"type": "image", "image": image}, {"type": "text", "text": f"q{i}"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": f"a{i}"}]},
        ],
        "image_count": 1,
        "source": {**SOURCE, "row_id": i},
    }


def _keep_stream(photos: list[bytes]) -> Iterator[dict[str, Any]]:
    for i, data in enumerate(photos):
        yield _sample(i, {"bytes": data, "path": None})


def _reencode_stream(photos: list[bytes]) -> Iterator[dict[str, Any]]:
    # A PIL image with no file behind it has no encoded form: it is decoded and written as PNG.
    for i, data in enumerate(photos):
        yield _sample(i, Image.open(io.BytesIO(data)))


def _disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def bench_keep_vs_png(photos: int, repeats: int) -> None:
    print(f"(a) generating {photos} photo-like 640x480 JPEGs ...", flush=True)
    data = [photo_jpeg(seed) for seed in range(photos)]
    times: dict[str, list[float]] = {"keep": [], "png": []}
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench-subsets-") as tmp:
        for r in range(repeats):
            for mode, stream in (("keep", _keep_stream), ("png", _reencode_stream)):
                dest = Path(tmp) / f"{mode}-{r}"
                start = time.perf_counter()
                materialize_normalized_conversation_samples(stream(data), dest)
                times[mode].append(time.perf_counter() - start)
                sizes[mode] = _disk(dest)
                print(f"    repeat {r} {mode:4s}: {times[mode][-1]:.2f} s", flush=True)
    keep, png = statistics.median(times["keep"]), statistics.median(times["png"])
    print(
        f"(a) median of {repeats}: keep bytes {keep:.2f} s ({photos / keep:.0f} img/s, "
        f"{sizes['keep'] / 2**20:.1f} MiB) | re-encode PNG {png:.2f} s ({photos / png:.0f} img/s, "
        f"{sizes['png'] / 2**20:.1f} MiB) | speed-up {png / keep:.1f}x (target >= 5x), "
        f"size ratio {sizes['png'] / sizes['keep']:.1f}x"
    )


_TEXT = "Describe the chart and compute the total of the second column, explaining each step briefly. "


def _large_stream(n: int, image_every: int, image: bytes) -> Iterator[dict[str, Any]]:
    for i in range(n):
        content: list[dict[str, Any]] = [{"type": "text", "text": f"{i}: {_TEXT * 2}"}]
        if i % image_every == 0:
            content.insert(0, {"type": "image", "image": image})
        yield {
            "conversation": [
                {"role": "user", "content": content},
                {"role": "assistant", "content": [{"type": "text", "text": f"{_TEXT * 3} answer {i}"}]},
            ],
            "image_count": len(content) - 1,
            "source": {"dataset": f"bench/part{i % 3}", "revision": "1" * 40, "row_id": i},
        }


# "reader" imports only the subset modules (the package __init__ would import torch for the batch code);
# "factory" goes through the public package and the Hydra factory, torch included.
_CHILD = r"""
import json, os, random, sys, time, types
import psutil
path, reads, seed, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if how == "reader":
    import puzzletron
    package = types.ModuleType("puzzletron.dataset")
    package.__path__ = [os.path.join(os.path.dirname(puzzletron.__file__), "dataset")]
    sys.modules["puzzletron.dataset"] = package
    from puzzletron.dataset.formats.subset import SubsetReader
else:
    from puzzletron.dataset import load_materialized_conversation_dataset
proc = psutil.Process()
rss0 = proc.memory_info().rss
start = time.perf_counter()
data = SubsetReader(path) if how == "reader" else load_materialized_conversation_dataset(path)
picks = random.Random(seed).sample(range(len(data)), reads)
chars = sum(len(json.dumps(data[i])) for i in picks)
elapsed = time.perf_counter() - start
rss1 = proc.memory_info().rss
print(json.dumps({"seconds": elapsed, "rss_mb": rss1 / 2**20, "rss_growth_mb": (rss1 - rss0) / 2**20,
                  "chars": chars}))
"""


def bench_random_access(samples: int, image_every: int, reads: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-subsets-") as tmp:
        dest = Path(tmp) / "large"
        buffer = io.BytesIO()
        Image.new("RGB", (16, 16), (10, 20, 30)).save(buffer, format="PNG")
        print(f"(b) materialising {samples} samples (one image every {image_every}) ...", flush=True)
        start = time.perf_counter()
        manifest = materialize_normalized_conversation_samples(
            _large_stream(samples, image_every, buffer.getvalue()), dest
        )
        build = time.perf_counter() - start
        print(
            f"    built in {build:.1f} s: {manifest['sample_count']} samples, "
            f"{manifest['image_count']} images, {_disk(dest) / 2**20:.1f} MiB on disk",
            flush=True,
        )
        for how in ("reader", "factory"):
            runs = []
            for r in range(repeats):
                out = subprocess.run(
                    [sys.executable, "-c", _CHILD, str(dest), str(reads), str(r), how],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                runs.append(json.loads(out.stdout))
            med = {
                k: statistics.median(run[k] for run in runs) for k in ("seconds", "rss_mb", "rss_growth_mb")
            }
            print(
                f"(b) {how:7s} open + {reads} random reads, median of {repeats} fresh processes: "
                f"{med['seconds']:.3f} s (target < 1 s), RSS growth {med['rss_growth_mb']:.1f} MB "
                f"(target < 200 MB), absolute RSS {med['rss_mb']:.0f} MB"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("a", "b", "all"), default="all")
    parser.add_argument("--photos", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--image-every", type=int, default=1)
    parser.add_argument("--reads", type=int, default=1000)
    args = parser.parse_args()
    if args.part in ("a", "all"):
        bench_keep_vs_png(args.photos, args.repeats)
    if args.part in ("b", "all"):
        bench_random_access(args.samples, args.image_every, args.reads, max(args.repeats, 3))


if __name__ == "__main__":
    main()

"""The resize a worker would no longer run (issue 25): Pillow's bicubic resize in the worker against the
bit-exact fixed-point resize of `tokenize._resize` run where the batch is.

    .venv/bin/python benchmarks/bench_device_resize.py                 # 200 images, 5 repeats
    .venv/bin/python benchmarks/bench_device_resize.py --images 50 --repeats 3

Images: ``--images`` random RGB images with sides of 64-1,500 px (seed 0; smooth content plus noise, like
the benchmark subset's), their grids under the Qwen2.5-VL pixel limits (patch 14, merge 2, 3,136 to
12,845,056 pixels). Per image token (median of ``--repeats``, CPU seconds of this process):

- ``pil_resize_us``: ``Image.resize`` to the grid's size (what a worker pays today, about 55 % of its
  processor time in ``bench_vlm_cpu.py``);
- ``patches_us``: resize + patchify by `tokenize._pixels.resized_patches` on the CPU, the stand-in for the
  accelerator where it is meant to run (torch ops, no host sync);
- ``decoded_bytes_per_token``: what shipping the decoded image costs, against 4,704 for uint8 patches.
Each image's patches are checked equal to the PIL path's before timing.

Figures (this shared 2-core VM, 60 images of 49,429 image tokens, 3 repeats, 2 torch threads):
Pillow 11.5 us an image token in the worker; the same resize + patchify as torch ops on this CPU 119 us
(about 10x: it is meant for the accelerator, where it takes that work off the worker); decoded images
2,351 bytes a token (half the uint8 patches: no temporal copy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image

from puzzletron.dataset.tokenize._pixels import resized_patches
from puzzletron.dataset.tokenize.grid import GridConfig

__all__ = ["main"]

GRID = GridConfig(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=12845056)


def _images(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        w, h = (int(v) for v in rng.integers(64, 1501, 2))
        y, x = np.mgrid[0:h, 0:w]
        base = 127 + 100 * np.sin(x[..., None] / 17.0 + y[..., None] / 23.0 + np.arange(3))
        out.append(np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8))
    return out


def _cpu(fn: Callable[[], object]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    arrays = _images(args.images)
    pils = [Image.fromarray(a) for a in arrays]
    sizes = np.array([(a.shape[1], a.shape[0]) for a in arrays])
    grid, _ = GRID.grids(sizes[:, 0], sizes[:, 1])
    tokens = int(GRID.tokens(grid).sum())
    tensors = [torch.from_numpy(a) for a in arrays]
    p = GRID.patch_size

    def pil() -> list[np.ndarray]:
        return [np.asarray(im.resize((int(g[2]) * p, int(g[1]) * p), resample=3, reducing_gap=None))
                for im, g in zip(pils, grid, strict=True)]  # fmt: skip

    def patches() -> torch.Tensor:
        return resized_patches(tensors, grid, patch_size=p, merge_size=2, temporal_patch_size=2)

    got = patches().reshape(-1, 3, 2, p * p)[:, :, 0]
    want = [torch.from_numpy(r.copy()) for r in pil()]
    ref = resized_patches(want, grid, patch_size=p, merge_size=2, temporal_patch_size=2)  # no-op resize
    assert torch.equal(got, ref.reshape(-1, 3, 2, p * p)[:, :, 0]), "the device resize differs from Pillow's"
    pil_s = statistics.median(_cpu(pil) for _ in range(args.repeats))
    patches_s = statistics.median(_cpu(patches) for _ in range(args.repeats))
    decoded = sum(a.nbytes for a in arrays)
    print(json.dumps({
        "images": args.images, "image_tokens": tokens, "torch_threads": torch.get_num_threads(),
        "pil_resize_us": round(pil_s / tokens * 1e6, 2), "patches_us": round(patches_s / tokens * 1e6, 2),
        "decoded_bytes_per_token": round(decoded / tokens), "uint8_patch_bytes_per_token": 4704,
    }))  # fmt: skip


if __name__ == "__main__":
    main()

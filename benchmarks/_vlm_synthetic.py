"""Synthetic inputs of the VLM benchmark: a Nemotron-like conversation subset, a Qwen2.5-VL-style processor
with the real pixel limits and a 32k BPE, and a VLM store tiled to any number of samples.

- Subset: 0-4 images a sample (uniform), each side uniform in 64-1500 px, JPEG crops of one photo-like
  canvas (a gradient with blotchy noise), so decoding and resizing cost what real photos cost; 1-3
  user/assistant turns of log-normal pseudo-English (median about 250 words a sample), images in the user
  turns before, between or after the text. Written once by the real subset writer and reused.
- Processor: ``benchmarks/_synthetic.py``'s 32k byte-level BPE with the fixture chat template, plus
  Qwen2.5-VL's image processor config (patch 14, merge 2, ``min_pixels`` 3,136, ``max_pixels``
  12,845,056, CLIP mean/std): a 1500x1500 image is 2,916 tokens.
- `tile_store`: a VLM store of N samples made of the base store's samples repeated (ids, masks and image
  references kept, so batches of it read the base subset's images): planning and time to first batch at
  100k samples without tokenising 100k samples.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from _synthetic import ConversationGenerator, build_tokenizer_32k

__all__ = ["PROCESSOR_CONFIG", "build_processor", "make_subset", "tile_store"]

PROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessorPil",
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def build_processor(work: Path) -> Path:
    """The benchmark's processor directory (32k BPE + Qwen2.5-VL image processor), built once."""
    from puzzletron.fixtures.tokenizer import CHAT_TEMPLATE

    out = work / "processor"
    if (out / "preprocessor_config.json").is_file():
        return out
    tok = build_tokenizer_32k(work / "tokenizer-32k")
    shutil.copytree(tok, out, dirs_exist_ok=True)
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR_CONFIG, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


def _canvas(rng: np.random.Generator) -> np.ndarray:
    """A 1500x1500 photo-like RGB canvas: smooth gradients with blotchy noise (JPEG-compressible)."""
    y, x = np.mgrid[0:1500, 0:1500].astype(np.float32)
    base = np.stack([x / 6, y / 6, (x + y) / 12], axis=-1)
    blotches = rng.normal(0, 20, (190, 190, 3)).astype(np.float32).repeat(8, 0).repeat(8, 1)[:1500, :1500]
    return np.clip(base + blotches + 40 * np.sin((x - y)[..., None] / 40), 0, 255).astype(np.uint8)


def _jpeg(canvas: np.ndarray, rng: np.random.Generator, width: int, height: int) -> bytes:
    from PIL import Image

    top, left = int(rng.integers(0, 1501 - height)), int(rng.integers(0, 1501 - width))
    buffer = io.BytesIO()
    Image.fromarray(canvas[top : top + height, left : left + width]).save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


def _samples(n: int, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    gen = ConversationGenerator(seed)
    canvas = _canvas(rng)
    words = np.exp(rng.normal(np.log(250), 0.9, n)).astype(int) + 8
    for i in range(n):
        turns = int(rng.integers(1, 4))
        images = int(rng.integers(0, 5))
        per = max(int(words[i]) // turns, 4)
        conversation = []
        for t in range(turns):
            here = images if t == turns - 1 else int(rng.integers(0, images + 1))
            images -= here
            user = max(int(per * rng.uniform(0.2, 0.6)), 1)
            items: list[dict[str, Any]] = [{"type": "text", "text": gen.text(user)}]
            for _ in range(here):
                w, h = (int(v) for v in rng.integers(64, 1501, 2))
                items.insert(
                    int(rng.integers(0, len(items) + 1)), {"type": "image", "image": _jpeg(canvas, rng, w, h)}
                )
            conversation.append({"role": "user", "content": items})
            conversation.append(
                {"role": "assistant", "content": [{"type": "text", "text": gen.text(per - user)}]}
            )
        count = sum(1 for turn in conversation for item in turn["content"] if item["type"] == "image")
        yield {
            "conversation": conversation,
            "image_count": count,
            "source": {"dataset": "bench/nemotron-like", "revision": "r0", "row_id": f"s{i}"},
        }


def make_subset(work: Path, n: int, *, seed: int = 0) -> Path:
    """The benchmark subset of `n` samples (written once, then reused)."""
    from puzzletron.dataset import materialize_normalized_conversation_samples

    out = work / f"subset-{n}"
    if not (out / "manifest.json").is_file():
        materialize_normalized_conversation_samples(_samples(n, seed), out)
    return out


def tile_store(base: Path, samples: int, out: Path) -> Path:
    """A VLM store of `samples` samples: the base store's samples repeated in order (the identity of the
    base's subset, so batches read the base subset's images; a ``tiled`` key in the identity keeps its plans
    apart). Written with the store's own writer (shards of the base's rows_per_shard); reused when present."""
    from puzzletron.dataset.errors import SnapshotError
    from puzzletron.dataset.formats.binary import ragged_arange
    from puzzletron.dataset.formats.manifest import canonical_sha256
    from puzzletron.dataset.formats.vlm_store import (
        VlmShardWriter,
        VlmStore,
        assemble_vlm_store,
        read_complete_manifest,
    )
    from puzzletron.dataset.formats.vlm_store._layout import token_identity

    if (out / "manifest.json").is_file():
        try:
            VlmStore(out)
            return out
        except SnapshotError:  # an earlier format version: tile again
            shutil.rmtree(out)
    store = VlmStore(base)
    inner = store.tokens.manifest
    n, per = len(store), int(inner["rows_per_shard"])
    build = out.parent / f".{out.name}.tile"
    shutil.rmtree(build, ignore_errors=True)
    dirs, records = [], []
    for k, a in enumerate(range(0, samples, per)):
        rows = np.arange(a, min(a + per, samples)) % n
        directory = build / f"shard-{k:06d}"
        directory.mkdir(parents=True)
        writer = VlmShardWriter(directory, inner["token_dtype"])
        ids, mask = store.read(store.offsets[rows], store.offsets[rows + 1])
        first, stop = store.image_offsets[rows], store.image_offsets[rows + 1]
        images = ragged_arange(first, stop - first)
        grid = np.asarray(store.grid[images], dtype=np.int64)
        refs = store.image_refs(images)
        lengths = store.lengths[rows].astype(np.int64)
        seen = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        writer.add(
            ids, mask, lengths=lengths, sample_ids=store.sample_ids(rows),
            supervised=seen[bounds[1:]] - seen[np.minimum(bounds[:-1] + 1, bounds[1:])],
            reasons=np.zeros(0, np.int64), images=stop - first, media_end=store.media_end[rows], grid=grid,
            image_tokens=grid.prod(axis=1) // store.merge_size**2, paths=[p for p, _ in refs],
            sha256=np.frombuffer(b"".join(bytes.fromhex(h) for _, h in refs), np.uint8).reshape(-1, 32),
        )  # fmt: skip
        records.append(writer.finish(rows=(a, a + rows.size)))
        dirs.append(directory)
    identity = dict(store.manifest["identity"], tiled=samples)
    fields = {key: store.manifest[key] for key in ("processor", "built_with")}
    fields |= {"identity": identity, "identity_sha256": canonical_sha256(identity)}
    tokens = {key: inner[key] for key in ("token_dtype", "vocab_size", "pad_token_id", "rows_per_shard",
                                          "built_with")}  # fmt: skip
    tokens |= {
        "identity": token_identity(identity),
        "identity_sha256": canonical_sha256(token_identity(identity)),
    }
    tmp = out.parent / f".{out.name}.txn"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    assemble_vlm_store(tmp, dirs, records, fields=fields, token_fields=tokens)
    tmp.rename(out)
    shutil.rmtree(build, ignore_errors=True)
    read_complete_manifest(out)
    VlmStore(out)  # the reader's checks too (its token store is this store's)
    return out

"""The VLM pipeline is deterministic: the same batches (fingerprints) in another process with another hash
seed, through 0 or 2 DataLoader workers, after a mid-epoch resume, and on every rank of a gloo world of 2
that builds the store together (each rank's batches are what one process deals to that rank)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp_mp

from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.pipelines.vlm import build_vlm_batches

SPEC = {
    "modality": "multimodal",
    "layout": "packed_varlen",
    "max_sample_length": 300,
    "packing": {"pack_size": 300},
}
SCRIPT = """
import json, sys
from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.pipelines.vlm import build_vlm_batches
store, processor, subset, spec = sys.argv[1:5]
spec = PuzzletronDataSpec.from_mapping(json.loads(spec))
batches = build_vlm_batches(
    store, processor=processor, subset=subset, spec=spec, batch_size=2, dp_rank=1, dp_size=2, seed=7
)
batches.sampler.set_epoch(1)
print(json.dumps([b.fingerprint for b in batches]))
"""


def _batches(vlm_stores, processor_dirs, vlm_subset, **kwargs):
    options = {"batch_size": 2, "dp_rank": 1, "dp_size": 2, "seed": 7, **kwargs}
    spec = PuzzletronDataSpec.from_mapping(SPEC)
    return build_vlm_batches(
        vlm_stores["qwen3_vl"], processor=processor_dirs["qwen3_vl"], subset=vlm_subset, spec=spec, **options
    )


def test_another_process_with_another_hash_seed_gives_the_same_batches(
    vlm_stores, processor_dirs, vlm_subset
):
    batches = _batches(vlm_stores, processor_dirs, vlm_subset)
    batches.sampler.set_epoch(1)
    here = [b.fingerprint for b in batches]
    env = {**os.environ, "PYTHONHASHSEED": "123", "TOKENIZERS_PARALLELISM": "false"}
    args = [str(vlm_stores["qwen3_vl"]), str(processor_dirs["qwen3_vl"]), str(vlm_subset), json.dumps(SPEC)]
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here and len(here) >= 2


@pytest.mark.parametrize("pixels", [{}, {"pixel_dtype": torch.uint8, "device_resize": True}])
def test_zero_and_two_workers_give_the_same_batches(
    vlm_stores, processor_dirs, vlm_subset, monkeypatch, pixels
):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    batches = _batches(vlm_stores, processor_dirs, vlm_subset, **pixels)
    direct = [b.fingerprint for b in batches]
    assert [b.fingerprint for b in batches.loader(num_workers=0)] == direct
    assert [b.fingerprint for b in batches.loader(num_workers=2)] == direct


def test_a_mid_epoch_resume_continues_with_the_same_batches(vlm_stores, processor_dirs, vlm_subset):
    batches = _batches(vlm_stores, processor_dirs, vlm_subset, dp_rank=0, dp_size=1, batch_size=1)
    batches.sampler.set_epoch(2)
    epoch = [b.fingerprint for b in batches]
    state = batches.sampler.state_dict(consumed=3)
    fresh = _batches(vlm_stores, processor_dirs, vlm_subset, dp_rank=0, dp_size=1, batch_size=1)
    fresh.sampler.load_state_dict(state)
    assert [b.fingerprint for b in fresh.loader(num_workers=2)] == epoch[3:]
    fresh.sampler.set_epoch(3)
    other = [b.fingerprint for b in fresh]
    assert other != epoch and len(other) == len(epoch)


# ---------------------------------------------------------------------------------- gloo process groups


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int, world: int, port: int, subset: Path, processor: Path, cache: Path, out: Path
) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        batches = build_vlm_batches(
            subset, processor=processor, spec=PuzzletronDataSpec.from_mapping(SPEC), batch_size=2,
            dp_rank=rank, dp_size=world, seed=7, cache_dir=cache, rows_per_shard=16,
        )  # fmt: skip
        result = {"store": batches.store.path.name, "batches": [b.fingerprint for b in batches]}
    finally:
        dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def test_a_gloo_world_of_2_builds_one_store_and_deals_as_one_process(vlm_subset, processor_dirs, tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    args = (2, _free_port(), vlm_subset, processor_dirs["qwen3_vl"], cache, out)
    tmp_mp.start_processes(_rank_main, args=args, nprocs=2, join=True, start_method="fork")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    (store,) = [p for p in cache.iterdir() if not p.name.startswith(".")]  # and the hidden plan cache
    assert {r["store"] for r in ranks} == {store.name}
    spec = PuzzletronDataSpec.from_mapping(SPEC)
    alone = build_vlm_batches(
        store,
        processor=processor_dirs["qwen3_vl"],
        subset=vlm_subset,
        spec=spec,
        batch_size=2,
        dp_size=2,
        seed=7,
    )
    assert [r["batches"] for r in ranks] == [[b.fingerprint for b in alone.for_rank(r)] for r in range(2)]


def _payload_offset(tensor: torch.Tensor) -> int | None:
    """Where `tensor` starts in the payload of the worker segment the trainer mapped it from."""
    import ctypes

    from puzzletron.dataset.distributed import transport

    for mapping in transport._MAPPINGS.values():
        base = ctypes.addressof(ctypes.c_uint8.from_buffer(mapping, transport._HEADER))
        if base <= tensor.data_ptr() < base + len(mapping):
            return tensor.data_ptr() - base
    return None


@pytest.mark.parametrize("pixel_dtype", [torch.bfloat16, torch.uint8])
def test_loader_workers_build_the_pixels_where_they_cross_and_give_the_same_batches(
    vlm_stores, processor_dirs, vlm_subset, monkeypatch, pixel_dtype
):
    from puzzletron.dataset.distributed import transport

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setattr(transport, "_MIN_PLACED", 1)  # the fixture's packs are small; forked workers see it
    batches = _batches(vlm_stores, processor_dirs, vlm_subset, pixel_dtype=pixel_dtype)
    direct = [b.fingerprint for b in batches]
    seen, offsets = [], set()
    for batch in batches.loader(num_workers=2):
        seen.append(batch.fingerprint)
        offsets.add(_payload_offset(batch.model_kwargs["pixel_values"]))
        del batch
    assert seen == direct and len(seen) >= 2
    assert offsets == {0}  # each pack's pixels built at the start of the segment they crossed in

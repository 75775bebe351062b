"""The demo's VLM stage: `build_vlm_batches` on the fixture Nemotron-VLM subset with the try-it processor.

The VLM store is built once into ``<workdir>/stores`` (the second rank finds it by identity); exact packs are
dealt to the DP ranks with their image tokens balanced, every pack and every image exactly once; one batch is
sharded over DP x CP x PP and reassembled (`puzzletron.dataset.distributed.sharding.check_sharding`).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["VLM_PACK_SIZE", "vlm_stage"]

VLM_PACK_SIZE = 1024  # the demo's VLM pack size (fixture image conversations: ~100-700 tokens)


def vlm_stage(workdir: Path, processor: Path, *, seed: int, dp: int, cp: int, pp: int) -> list[str]:
    """Run the stage; its report lines. `AssertionError` when a pack or an image is dealt other than once."""
    from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
    from puzzletron.dataset.distributed.sharding import check_sharding
    from puzzletron.dataset.pipelines.vlm import build_vlm_batches

    subset = workdir / "snapshots" / "nemotron-vlm"
    spec = PuzzletronDataSpec(
        "multimodal", "packed_varlen", VLM_PACK_SIZE, PackingSpec(pack_size=VLM_PACK_SIZE)
    )
    lines: list[str] = []
    packs: list[int] = []
    images, firsts = 0, []
    for rank in range(dp):
        batches = build_vlm_batches(
            subset, processor=processor, spec=spec, batch_size=2, dp_rank=rank, dp_size=dp, seed=seed,
            cache_dir=workdir / "stores",
        )  # fmt: skip
        built = list(batches)
        packs.extend(i for b in built for i in b.source_metadata["items"] if i >= 0)
        images += sum(int(b.model_kwargs["image_grid_thw"].shape[0]) for b in built)
        firsts.append(built[0])
        lines.append(
            f"rank {rank}: {len(built)} batches of 2 packs x {VLM_PACK_SIZE} tokens, first "
            f"{str(built[0].fingerprint)[:12]}"
        )
    store, plan = batches.store, batches.plan
    if sorted(packs) != list(range(plan.num_rows)):
        raise AssertionError("the sampler did not deal every VLM pack exactly once")
    placed = plan.sample_order
    want = int((store.image_offsets[placed + 1] - store.image_offsets[placed]).sum())
    if images != want:
        raise AssertionError(f"{images} images in the batches; the packed samples hold {want}")
    lines.append(
        f"VLM store {store.path.name}: {len(store)} samples, {store.num_images} images "
        f"({int(store.image_tokens.sum()):,} image tokens), built once, reused by rank 1"
    )
    lines.append(
        f"{plan.num_rows} packs of {VLM_PACK_SIZE} (lower bound {plan.lower_bound_rows}), efficiency "
        f"{plan.efficiency:.2%}, {len(plan.dropped)} samples dropped; every pack and all {images} images "
        "dealt once"
    )
    return lines + check_sharding(firsts[0], dp=dp, cp=cp, pp=pp)

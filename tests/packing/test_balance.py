"""`balanced_deal`: `deal_epoch`'s contract (every pack exactly once an epoch, the same tail and padding,
``drop_last``, a function of seed and epoch) and its purpose, on packs planned from Nemotron-like samples
(0-4 images of 64-1500 px under Qwen2.5-VL's pixel limits, log-normal text) for 8 DP ranks: image tokens per
step within 1.1x of the ranks' mean, real tokens within 1.01x, the first and last tenth of the epoch within
1.25x, and still a seeded shuffle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.distributed import DistributedPackSampler, deal_epoch
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.packing import balance_report, balanced_deal, plan_vlm, row_sums
from puzzletron.dataset.tokenize import GridConfig


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 90), bs=st.integers(1, 4), dp=st.integers(1, 5), seed=st.integers(0, 9),
       epoch=st.integers(0, 3), drop_last=st.booleans(), shuffle=st.booleans())  # fmt: skip
def test_the_contract_of_deal_epoch(n, bs, dp, seed, epoch, drop_last, shuffle) -> None:
    rng = np.random.default_rng(n)
    image, tokens = rng.integers(0, 50, n), rng.integers(40, 60, n)
    options = {
        "batch_size": bs,
        "dp_size": dp,
        "seed": seed,
        "epoch": epoch,
        "shuffle": shuffle,
        "drop_last": drop_last,
    }
    deal = balanced_deal(image, tokens, **options)
    plain = deal_epoch(n, **options)
    assert deal.shape == plain.shape and deal.dtype == np.int64
    assert np.array_equal(deal < 0, plain < 0)  # the same padding slots
    placed = np.sort(deal[deal >= 0])
    assert np.unique(placed).size == placed.size == (plain >= 0).sum()  # each once; drop_last: the tail out
    assert drop_last or np.array_equal(placed, np.arange(n))
    assert np.array_equal(deal, balanced_deal(image, tokens, **options))


def _nemotron_like_packs(pack_size: int, n: int = 3000) -> tuple[np.ndarray, np.ndarray]:
    """(image tokens, real tokens) of the packs of `n` synthetic samples, planned as the pipeline does."""
    rng = np.random.default_rng(0)
    grid = GridConfig(14, 2, 2, 56 * 56, 28 * 28 * 16384)
    images = rng.integers(0, 5, n)
    sizes = rng.integers(64, 1501, (int(images.sum()), 2))
    tokens = grid.tokens(grid.grids(sizes[:, 0], sizes[:, 1])[0])
    image = np.bincount(np.repeat(np.arange(n), images), weights=tokens, minlength=n).astype(np.int64)
    text = np.exp(rng.normal(5.5, 1.0, n)).astype(np.int64) + 20
    raw = {"modality": "multimodal", "layout": "packed_varlen", "max_sample_length": pack_size}
    spec = PuzzletronDataSpec.from_mapping({**raw, "packing": {"pack_size": pack_size}})
    plan = plan_vlm(image + text, np.where(image > 0, image + 10, 0), spec)
    return row_sums(plan, image), plan.row_lengths


@pytest.mark.parametrize("pack_size", [4096, 8192])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_eight_ranks_get_even_image_and_real_tokens_all_epoch_long(pack_size: int, batch_size: int) -> None:
    image, tokens = _nemotron_like_packs(pack_size)
    for seed in range(3):
        for epoch in range(2):
            deal = balanced_deal(image, tokens, batch_size=batch_size, dp_size=8, seed=seed, epoch=epoch)
            report = balance_report(deal, image, tokens)
            assert report["image_max_over_mean"] <= 1.1 and report["image_step_mean"] <= 1.1, report
            assert report["tokens_max_over_mean"] <= 1.01 and report["tokens_step_mean"] <= 1.01, report
            assert report["image_edge_ratio"] <= 1.25, report
    plain = balance_report(
        deal_epoch(len(image), batch_size=batch_size, dp_size=8, seed=0, epoch=0), image, tokens
    )
    assert plain["image_max_over_mean"] > 1.1  # what the plain permutation gives on the same packs


def test_the_shuffle_stays() -> None:
    image, tokens = _nemotron_like_packs(8192)
    deals = [
        balanced_deal(image, tokens, batch_size=1, dp_size=8, seed=s, epoch=e)
        for s, e in ((0, 0), (0, 1), (1, 0))
    ]
    firsts = [set(d[: len(d) // 10].reshape(-1).tolist()) for d in deals]
    assert len(firsts[0] & firsts[1]) < len(firsts[0]) / 2 and len(firsts[0] & firsts[2]) < len(firsts[0]) / 2
    unshuffled = balanced_deal(image, tokens, batch_size=1, dp_size=8, seed=5, epoch=3, shuffle=False)
    assert np.array_equal(
        unshuffled, balanced_deal(image, tokens, batch_size=1, dp_size=8, seed=0, epoch=0, shuffle=False)
    )


def test_a_balanced_sampler_resumes_only_as_balanced() -> None:
    loads = np.stack([np.arange(20) % 7, np.full(20, 100)], axis=1)
    sampler = DistributedPackSampler(20, batch_size=1, dp_rank=1, dp_size=4, seed=3, loads=loads)
    assert next(k.indices for k in sampler) == tuple(
        balanced_deal(loads[:, 0], loads[:, 1], batch_size=1, dp_size=4, seed=3, epoch=0)[0, 1]
    )
    state = sampler.state_dict(consumed=2)
    assert state["balanced"] is True
    other = sampler.for_rank(1)
    other.load_state_dict(state)
    assert [k.indices for k in other] == [k.indices for k in sampler][2:]
    plain = DistributedPackSampler(20, batch_size=1, dp_rank=1, dp_size=4, seed=3)
    with pytest.raises(ConfigError, match="balanced=True but this sampler has False"):
        plain.load_state_dict(state)
    with pytest.raises(ConfigError, match=r"loads must be \[num_items, 2\]"):
        DistributedPackSampler(20, batch_size=1, dp_rank=0, dp_size=4, seed=3, loads=loads[:5])

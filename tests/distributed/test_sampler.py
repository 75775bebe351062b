"""The distributed sampler: pure deal properties, resume, and real gloo process groups (2 and 4 ranks)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzletron.dataset.batch import PuzzletronBatch
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
from puzzletron.dataset.distributed import (
    BatchKey,
    DistributedPackSampler,
    PackedBatches,
    deal_epoch,
    steps_per_epoch,
)
from puzzletron.dataset.packing import TokenizedSamples, plan_packing

PACK = 64


def _samples(n: int = 90, *, seed: int = 7) -> TokenizedSamples:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 40, size=n)
    ids = [rng.integers(1, 500, size=k).tolist() for k in lengths]
    labels = [[*x[1:], -100] for x in ids]
    return TokenizedSamples.from_lists(ids, labels, sample_ids=[f"doc-{i}" for i in range(n)])


def _packed_dataset(**kwargs) -> PackedBatches:
    samples = _samples()
    spec = PuzzletronDataSpec("text", "packed_varlen", PACK, PackingSpec(pack_size=PACK))
    plan = plan_packing(samples.lengths, spec.packing, seed=1)
    return PackedBatches(samples, spec, plan, **kwargs)


# ------------------------------------------------------------------------------------------------ pure deal


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 200),
    batch_size=st.integers(1, 7),
    dp=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
    epoch=st.integers(0, 50),
)
def test_every_item_is_dealt_exactly_once_per_epoch_without_repeats(n, batch_size, dp, seed, epoch):
    deal = deal_epoch(n, batch_size=batch_size, dp_size=dp, seed=seed, epoch=epoch)
    assert deal.shape == (steps_per_epoch(n, batch_size=batch_size, dp_size=dp), dp, batch_size)
    real = deal[deal >= 0]
    assert sorted(real.tolist()) == list(range(n))
    # Only the last step may hold padding, and ranks' real counts differ by at most one there.
    assert (deal[:-1] >= 0).all()
    if deal.shape[0]:
        counts = (deal[-1] >= 0).sum(axis=1)
        assert counts.max() - counts.min() <= 1
        assert list(counts) == sorted(counts, reverse=True)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 200), batch_size=st.integers(1, 7), dp=st.integers(1, 6))
def test_drop_last_drops_only_the_incomplete_step(n, batch_size, dp):
    deal = deal_epoch(n, batch_size=batch_size, dp_size=dp, seed=0, epoch=0, drop_last=True)
    assert deal.shape[0] == n // (batch_size * dp)
    assert (deal >= 0).all() and len(set(deal.reshape(-1).tolist())) == deal.size


def test_deal_depends_on_seed_and_epoch_only():
    a = deal_epoch(100, batch_size=4, dp_size=2, seed=3, epoch=0)
    assert np.array_equal(a, deal_epoch(100, batch_size=4, dp_size=2, seed=3, epoch=0))
    assert not np.array_equal(a, deal_epoch(100, batch_size=4, dp_size=2, seed=3, epoch=1))
    assert not np.array_equal(a, deal_epoch(100, batch_size=4, dp_size=2, seed=4, epoch=0))
    ordered = deal_epoch(10, batch_size=2, dp_size=2, seed=0, epoch=0, shuffle=False)
    assert ordered.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, -1], [9, -1]]]


def test_a_rank_with_nothing_left_gets_a_fully_masked_padding_batch():
    dataset = _packed_dataset()
    n = len(dataset)
    dp = 4
    # A batch size whose last step holds fewer packs than ranks: the last rank gets none.
    bs = next(b for b in range(1, n + 1) if 0 < n % (dp * b) < dp)
    sampler = DistributedPackSampler(n, batch_size=bs, dp_rank=dp - 1, dp_size=dp, seed=0)
    keys = list(sampler)
    last = keys[-1]
    assert last.is_padding and last.items == ()
    batch = dataset[last]
    assert batch.source_metadata["padding"] is True
    assert not batch.hidden_mask.any() and (batch.labels == -100).all() and not batch.ce_mask.any()
    assert batch.input_ids.shape == (bs, PACK)


def test_drop_last_sampler_yields_only_full_batches_of_real_packs():
    dataset = _packed_dataset()
    n = len(dataset)
    dp, bs = 4, next(b for b in range(1, n + 1) if n % (4 * b))  # a batch size that leaves a tail
    keys = [
        key
        for rank in range(dp)
        for key in DistributedPackSampler(n, batch_size=bs, dp_rank=rank, dp_size=dp, seed=0, drop_last=True)
    ]
    assert len(keys) == dp * (n // (dp * bs))
    assert all(len(k.items) == bs and not k.is_padding for k in keys)
    assert all(not dataset[k].source_metadata["padding"] for k in keys[:2])
    dealt = [i for k in keys for i in k.items]
    assert len(set(dealt)) == len(dealt) == n - n % (dp * bs)  # only the incomplete last step is dropped


def test_sampler_rejects_a_state_from_other_deal_settings():
    sampler = DistributedPackSampler(50, batch_size=2, dp_rank=0, dp_size=2, seed=0)
    other = DistributedPackSampler(50, batch_size=3, dp_rank=0, dp_size=2, seed=0)
    with pytest.raises(ValueError, match="batch_size=2 but this sampler has 3"):
        other.load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match=r"dp_rank must be in 0\.\.1"):
        DistributedPackSampler(50, batch_size=2, dp_rank=2, dp_size=2, seed=0)


def test_resume_mid_epoch_continues_at_the_next_batch():
    sampler = DistributedPackSampler(37, batch_size=3, dp_rank=1, dp_size=2, seed=9)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2)
    it = iter(sampler)
    head = [next(it) for _ in range(4)]
    state = sampler.state_dict()
    assert state["next_step"] == 4 and state["epoch"] == 2
    fresh = DistributedPackSampler(37, batch_size=3, dp_rank=1, dp_size=2, seed=9)
    fresh.load_state_dict(json.loads(json.dumps(state)))  # the state is plain JSON
    fresh.set_epoch(2)  # a training loop calls this again on resume: it must keep the resume point
    assert head + list(fresh) == full
    fresh.set_epoch(3)
    assert [k.epoch for k in fresh] == [3] * len(full)


def _loader(dataset: PackedBatches, sampler: DistributedPackSampler, workers: int):
    # batch_size=None: no collation, the default conversion passes each PuzzletronBatch through unchanged.
    return torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=None, num_workers=workers)


def test_dataloader_workers_return_puzzletron_batches_directly():
    dataset = _packed_dataset()
    sampler = DistributedPackSampler(len(dataset), batch_size=2, dp_rank=1, dp_size=2, seed=5)
    sampler.set_epoch(1)
    expected = [dataset[key] for key in sampler]
    sampler.set_epoch(1)
    got = list(_loader(dataset, sampler, 2))
    assert all(type(b) is PuzzletronBatch for b in got)
    assert [b.fingerprint for b in got] == [b.fingerprint for b in expected]
    assert [b.source_metadata["step"] for b in got] == list(range(len(expected)))
    assert got[0].sequence.global_cu_seqlens.tolist() == expected[0].sequence.global_cu_seqlens.tolist()


@pytest.mark.parametrize(("before", "after"), [(0, 2), (2, 0), (2, 1)])
def test_resume_with_a_different_number_of_dataloader_workers_gives_identical_batches(before, after):
    dataset = _packed_dataset()

    def fingerprints(items):
        return [b.fingerprint for b in items]

    reference = DistributedPackSampler(len(dataset), batch_size=2, dp_rank=0, dp_size=2, seed=5)
    expected = fingerprints(_loader(dataset, reference, 0))
    sampler = DistributedPackSampler(len(dataset), batch_size=2, dp_rank=0, dp_size=2, seed=5)
    consumed = []
    for batch in _loader(dataset, sampler, before):  # workers prefetch ahead of what the loop consumed
        consumed.append(batch.fingerprint)
        if len(consumed) == 3:
            break
    state = sampler.state_dict(consumed=len(consumed))
    resumed = DistributedPackSampler(len(dataset), batch_size=2, dp_rank=0, dp_size=2, seed=5)
    resumed.load_state_dict(state)
    assert consumed + fingerprints(_loader(dataset, resumed, after)) == expected
    assert len(set(expected)) == len(expected)


def test_packed_batches_hold_exactly_the_dealt_packs():
    dataset = _packed_dataset()
    key = BatchKey(epoch=0, step=0, dp_rank=0, indices=(3, 0, -1))
    batch = dataset[key]
    names = [dataset.samples.sample_ids[i] for i in (*dataset.plan.row(3), *dataset.plan.row(0))]
    assert batch.source_metadata["document_ids"] == names
    assert batch.sample_ids[2] == "__padding_2"
    assert int(batch.sequence.seq_ids.max()) + 1 == len(names)
    assert not batch.hidden_mask[2].any()


# ------------------------------------------------------------------------------------- real gloo groups


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        dataset = _packed_dataset()
        n = len(dataset)
        result: dict[str, object] = {}
        for epoch in (0, 1):
            sampler = DistributedPackSampler.from_process_group(n, batch_size=2, seed=11)
            sampler.set_epoch(epoch)
            keys = list(sampler)
            batches = [dataset[k] for k in keys]
            mine = {
                "packs": [i for k in keys for i in k.items],
                "docs": [d for b in batches for d in b.source_metadata["document_ids"]],
                "fingerprints": [b.fingerprint for b in batches],
                "padding": [k.is_padding for k in keys],
            }
            gathered: list[dict] = [None] * world  # type: ignore[list-item]
            dist.all_gather_object(gathered, mine)
            result[f"epoch{epoch}"] = gathered
        # Resume: consume 2 batches of epoch 1, save the state, continue in a fresh sampler.
        sampler = DistributedPackSampler.from_process_group(n, batch_size=2, seed=11)
        sampler.set_epoch(1)
        it = iter(sampler)
        head = [dataset[next(it)].fingerprint for _ in range(2)]
        state = sampler.state_dict()
        fresh = DistributedPackSampler.from_process_group(n, batch_size=2, seed=11)
        fresh.load_state_dict(state)
        fresh.set_epoch(1)
        resumed = head + [dataset[k].fingerprint for k in fresh]
        gathered_resumed: list[list[str]] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(gathered_resumed, resumed)
        result["resumed_epoch1"] = gathered_resumed
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_together_see_every_pack_once_and_resume_identically(world, tmp_path):
    out = tmp_path / "result.json"
    mp.spawn(_rank_main, args=(world, _free_port(), str(out)), nprocs=world, join=True)
    result = json.loads(out.read_text())
    dataset = _packed_dataset()
    for epoch in ("epoch0", "epoch1"):
        ranks = result[epoch]
        packs = [p for r in ranks for p in r["packs"]]
        assert sorted(packs) == list(range(len(dataset)))  # every pack exactly once, across ranks
        docs = [d for r in ranks for d in r["docs"]]
        assert sorted(docs) == sorted(dataset.samples.sample_ids)  # hence every sample exactly once
        assert len({len(r["fingerprints"]) for r in ranks}) == 1  # same number of steps on every rank
    assert result["epoch0"][0]["packs"] != result["epoch1"][0]["packs"]
    for rank in range(world):
        assert result["resumed_epoch1"][rank] == result["epoch1"][rank]["fingerprints"]


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_a_bad_seed_is_an_error_naming_it_when_the_sampler_is_made(seed):
    with pytest.raises(ValueError, match=r"seed must be an int >= 0"):
        DistributedPackSampler(10, batch_size=2, dp_rank=0, dp_size=1, seed=seed)
    with pytest.raises(ValueError, match=r"seed must be an int >= 0"):
        deal_epoch(10, batch_size=2, dp_size=1, seed=seed, epoch=0)

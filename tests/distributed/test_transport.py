"""`transport`: a worker's batch crosses to the trainer with every tensor in one reused shared-memory
segment: the same values, dtypes and shapes (any nesting), one segment per batch, a segment handed out
again only once every tensor and view of its batch is gone, and the loader's batches equal the ones built
in the trainer's own process."""

from __future__ import annotations

import gc
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
import torch.multiprocessing
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
from puzzletron.dataset.distributed import DistributedPackSampler, PackedBatches, batch_loader, transport
from puzzletron.dataset.distributed.transport import SharedTensors, shared_collate
from puzzletron.dataset.packing import TokenizedSamples, plan_packing

DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float64]


def _cross(value):
    """`value` pickled as a worker hands it over (ForkingPickler) and unpickled as the trainer does."""
    return pickle.loads(ForkingPickler.dumps(SharedTensors(value)))


def _segments() -> list:
    return transport._pool().segments


@pytest.fixture(autouse=True)
def _fresh_pool():
    gc.collect()
    transport._POOL = None
    yield
    gc.collect()


def _tensor(draw, dtype: torch.dtype) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    values = torch.arange(int(np.prod(shape, dtype=np.int64)), dtype=torch.float64).reshape(shape)
    tensor = values.to(dtype) if dtype is not torch.bool else values.remainder(2).bool()
    return tensor.T if draw(st.booleans()) and tensor.dim() == 2 else tensor  # non-contiguous too


@st.composite
def _values(draw):
    tensors = [_tensor(draw, draw(st.sampled_from(DTYPES))) for _ in range(draw(st.integers(0, 6)))]
    return {"flat": tensors, "nested": {"pair": tuple(tensors[:2]), "text": "x", "n": 3}}


@settings(max_examples=40, deadline=None)
@given(value=_values())
def test_any_nesting_of_tensors_crosses_with_its_values_dtypes_and_shapes(value) -> None:
    got = _cross(value)
    assert got["nested"]["text"] == "x" and got["nested"]["n"] == 3
    for a, b in zip(got["flat"], value["flat"], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert len(got["nested"]["pair"]) == min(2, len(value["flat"]))


def test_every_tensor_of_a_batch_lies_in_one_segment() -> None:
    value = {"ids": torch.arange(4096), "pixels": torch.ones(300, 1176, dtype=torch.bfloat16)}
    got = _cross(value)
    starts = [t.data_ptr() for t in got.values()]
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in got.values()]
    assert max(ends) - min(starts) <= _segments()[0].capacity and len(_segments()) == 1


def test_a_segment_is_reused_once_its_batch_is_gone_and_never_before() -> None:
    first = _cross({"x": torch.full((1000,), 7)})
    kept = first["x"][10:20]  # a view of the segment outlives the batch's own tensor
    del first
    gc.collect()
    second = _cross({"x": torch.full((1000,), 9)})
    assert len(_segments()) == 2 and torch.equal(kept, torch.full((10,), 7))  # not overwritten
    del kept, second
    gc.collect()
    assert all(s.free for s in _segments())
    for value in range(5):  # one at a time: the pool's two segments serve them all
        got = _cross({"x": torch.full((1000,), value)})
        assert torch.equal(got["x"], torch.full((1000,), value))
        del got
        gc.collect()
    assert len(_segments()) == 2


def test_a_full_pool_hands_out_one_off_segments() -> None:
    held = [_cross({"x": torch.full((10,), i)}) for i in range(transport.POOL_SIZE + 3)]
    assert len(_segments()) == transport.POOL_SIZE
    assert [int(h["x"][0]) for h in held] == list(range(transport.POOL_SIZE + 3))


def test_the_collate_wrapper_returns_plain_values_outside_a_worker() -> None:
    collate = shared_collate(lambda items: items[0])
    assert shared_collate(collate) is collate
    assert collate([{"a": 1}]) == {"a": 1}


def _batches() -> tuple[PackedBatches, DistributedPackSampler]:
    rng = np.random.default_rng(0)
    ids = [rng.integers(1, 500, size=int(n)).tolist() for n in rng.integers(3, 60, size=64)]
    samples = TokenizedSamples.from_lists(ids, [[*x[1:], -100] for x in ids])
    spec = PuzzletronDataSpec("text", "packed_varlen", 128, PackingSpec(pack_size=128))
    plan = plan_packing(samples.lengths, spec.packing, seed=0)
    sampler = DistributedPackSampler(plan.num_rows, batch_size=2, dp_rank=0, dp_size=1, seed=0)
    return PackedBatches(samples, spec, plan), sampler


class _Source:
    def __init__(self) -> None:
        self.dataset, self.sampler = _batches()


def test_loader_workers_give_the_batches_of_one_process_through_segments() -> None:
    source = _Source()
    direct = [source.dataset[key].fingerprint for key in source.sampler]
    seen, pointers = [], set()
    for batch in batch_loader(source, num_workers=2):
        seen.append(batch.fingerprint)
        ptrs = [t.data_ptr() for t in (batch.input_ids, batch.labels, batch.hidden_mask)]
        pointers.add(max(ptrs) - min(ptrs) < 1 << 20)  # neighbours in one segment
    assert seen == direct and pointers == {True}


@pytest.fixture
def placing(monkeypatch):
    """`batch_buffer` as in a `batch_loader` worker (the pool is this process's)."""
    monkeypatch.setattr(transport, "_PLACING", False)
    transport.place_in_segments(0)
    assert transport._PLACING


def _pixels(n: int = 1200) -> tuple[np.ndarray, torch.Tensor]:
    room = transport.batch_buffer(n * 1176 * 2)
    pixels = torch.from_numpy(room).view(torch.bfloat16).view(n, 1176)
    pixels.copy_(torch.arange(n * 1176, dtype=torch.float32).reshape(n, 1176).remainder(251))
    return room, pixels


def test_a_tensor_built_in_a_batch_buffer_crosses_in_place_and_the_rest_after_it(placing) -> None:
    room, pixels = _pixels()
    value = {"ids": torch.arange(5000), "pixels": pixels, "turned": pixels[:8].T, "grid": torch.ones(3, 3)}
    expected = {k: v.clone() for k, v in value.items()}
    got = _cross(value)
    assert all(torch.equal(got[k], expected[k]) and got[k].dtype == expected[k].dtype for k in expected)
    room[2:4] = 0  # pixels[0, 1], 1.0 until now: the worker's pages are the trainer's, nothing was copied
    assert float(got["pixels"][0, 1]) == 0
    assert len(_segments()) == 1 and got["ids"].data_ptr() > got["pixels"].data_ptr()


def test_a_batch_buffer_dropped_before_it_crossed_frees_its_segment(placing) -> None:
    room, pixels = _pixels()
    (segment,) = _segments()
    assert not segment.free
    del room, pixels
    gc.collect()
    assert segment.free
    _pixels()
    assert len(_segments()) == 1  # the same segment again


def test_a_placed_segment_stays_the_trainers_until_its_batch_is_gone(placing) -> None:
    got = _cross({"pixels": _pixels()[1]})  # the worker's own views are gone with the call
    gc.collect()
    expected = got["pixels"].clone()
    room, _ = _pixels()
    room[:] = 7  # another segment: the trainer's batch is untouched
    assert len(_segments()) == 2 and torch.equal(got["pixels"], expected)
    del got
    gc.collect()
    assert sum(s.free for s in _segments()) == 1


def test_a_batch_too_large_for_its_placed_segment_crosses_copied(placing) -> None:
    room, pixels = _pixels(500)
    value = {"pixels": pixels, "big": torch.arange(3 << 20)}  # 24 MiB: more than the room after the pixels
    got = _cross(value)
    assert torch.equal(got["pixels"], pixels) and torch.equal(got["big"], value["big"])
    room[2:4] = 0
    assert float(got["pixels"][0, 1]) == 1  # a copy
    del room, pixels, value
    gc.collect()
    assert sum(s.free for s in _segments()) == 1  # the placed one, never sent: free again


def test_batch_buffer_outside_a_placing_worker_is_plain_memory(monkeypatch) -> None:
    monkeypatch.setattr(transport, "_PLACING", False)
    assert transport.batch_buffer(8 << 20).nbytes == 8 << 20 and transport._POOL is None

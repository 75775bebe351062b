"""Dealing a mixture's epoch (`packing.mixture_deal`): images on every rank or none, every row once, a resume
at any DP size from two counters."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzletron.dataset.packing.mixture_deal import image_exceptions, row_queues, step_cursors, step_rows


def _deal(queues, cursors, dp, bs, image_tokens=None, real=None):
    rows = step_rows(queues, cursors, slice(None), dp_size=dp, batch_size=bs)
    for rank in range(dp):  # a rank's own column is its part of the whole deal
        own = step_rows(queues, cursors, slice(None), dp_size=dp, batch_size=bs, rank=rank)
        assert np.array_equal(own[:, 0], rows[:, rank])
    return rows


def test_golden_steps_take_image_rows_in_multiples_of_the_dp_size() -> None:
    """The docstring's example: dp 2, batch 2, stream t t I t t I I t I t t t."""
    image = np.array([0, 0, 5, 0, 0, 5, 5, 0, 5, 0, 0, 0])
    queues = row_queues(np.arange(12), image)
    cursors = step_cursors(queues, dp_size=2, batch_size=2)
    assert cursors.tolist() == [[0, 0], [2, 2], [4, 4], [4, 8]]
    rows = _deal(queues, cursors, 2, 2, image, np.full(12, 10))
    assert sorted(rows[0].reshape(-1).tolist()) == [0, 1, 2, 5]
    assert sorted(rows[1].reshape(-1).tolist()) == [3, 4, 6, 8]
    assert sorted(rows[2].reshape(-1).tolist()) == [7, 9, 10, 11]
    for step in rows[:2]:  # every rank holds one image row
        assert (image[step] > 0).sum(axis=1).tolist() == [1, 1]


def _stream(seed: int, n: int, image_share: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    image = np.where(rng.random(n) < image_share, rng.integers(1, 3000, size=n), 0)
    return rng.permutation(n), image


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 300),
    dp=st.integers(1, 9),
    bs=st.integers(1, 4),
    share=st.floats(0.0, 1.0),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_every_row_once_and_image_rows_on_every_rank_or_none(n, dp, bs, share, drop_last, seed) -> None:
    order, image = _stream(seed, n, share)
    queues = row_queues(order, image)
    cursors = step_cursors(queues, dp_size=dp, batch_size=bs, drop_last=drop_last)
    rows = _deal(queues, cursors, dp, bs, image, np.full(n, 7))
    dealt = rows[rows >= 0]
    assert np.unique(dealt).shape[0] == dealt.shape[0]
    full_steps = n // (dp * bs)
    assert dealt.shape[0] == (full_steps * dp * bs if drop_last else n)
    for step, (i0, i1) in zip(rows, zip(cursors[:-1, 0], cursors[1:, 0], strict=True), strict=False):
        taken = int(i1 - i0)
        held = (image[np.where(step >= 0, step, 0)] > 0) & (step >= 0)
        assert int(held.sum()) == taken
        ranks = held.any(axis=1)
        if (step >= 0).all() and taken > 0:  # a full step: multiples of dp unless a queue ran out
            assert ranks.all() or taken < dp
    assert image_exceptions(cursors, dp) <= 2  # only where a queue runs out (the end of the epoch)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    dp_a=st.integers(1, 8),
    dp_b=st.integers(1, 8),
    bs_a=st.integers(1, 3),
    bs_b=st.integers(1, 3),
    cut=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_a_resume_at_another_dp_size_repeats_and_skips_nothing(n, dp_a, dp_b, bs_a, bs_b, cut, seed) -> None:
    order, image = _stream(seed, n, 0.4)
    queues = row_queues(order, image)
    first = step_cursors(queues, dp_size=dp_a, batch_size=bs_a)
    k = int(cut * (first.shape[0] - 1))
    before = _deal(queues, first[: k + 1], dp_a, bs_a, image, np.full(n, 3))
    second = step_cursors(queues, dp_size=dp_b, batch_size=bs_b, start=tuple(first[k]))
    taken = np.diff(second, axis=0)  # each queue moves forward, a step holds at most dp * batch rows
    assert (taken >= 0).all() and (taken.sum(axis=1) <= dp_b * bs_b).all()
    after = _deal(queues, second, dp_b, bs_b, image, np.full(n, 3))
    dealt = np.concatenate([before[before >= 0], after[after >= 0]])
    assert sorted(dealt.tolist()) == sorted(order.tolist())


def test_text_only_steps_follow_the_stream_at_any_dp_and_batch_size() -> None:
    order = np.random.default_rng(0).permutation(96)
    queues = row_queues(order, np.zeros(96, dtype=np.int64))
    for dp, bs in ((1, 1), (2, 3), (4, 2), (8, 1)):
        cursors = step_cursors(queues, dp_size=dp, batch_size=bs)
        rows = _deal(queues, cursors, dp, bs, np.zeros(96, dtype=np.int64), np.full(96, 5))
        g = dp * bs
        for s, step in enumerate(rows):  # a step holds the next dp * bs rows of the stream
            assert sorted(step.reshape(-1).tolist()) == sorted(order[s * g : (s + 1) * g].tolist())


def test_image_rows_lag_the_stream_by_less_than_half_the_dp_size() -> None:
    order, image = _stream(4, 4000, 0.3)
    queues = row_queues(order, image)
    for dp in (2, 4, 8):
        cursors = step_cursors(queues, dp_size=dp, batch_size=1)
        owed = np.searchsorted(queues.image_positions, cursors[:, 0] + cursors[:, 1])
        assert np.abs(cursors[:, 0] - owed).max() <= dp / 2


def test_ranks_of_a_step_are_even_in_image_and_real_tokens() -> None:
    rng = np.random.default_rng(2)
    n = 6000
    image = np.where(rng.random(n) < 0.4, rng.integers(100, 3000, size=n), 0)
    real = rng.integers(4050, 4097, size=n)
    queues = row_queues(rng.permutation(n), image)
    cursors = step_cursors(queues, dp_size=8, batch_size=1)
    rows = _deal(queues, cursors, 8, 1, image, real)
    full = rows[(rows >= 0).all(axis=(1, 2))]
    per_rank_images = image[full].sum(axis=2).astype(float)
    steps_with_images = per_rank_images.sum(axis=1) > 0
    m = per_rank_images[steps_with_images]
    assert m.max(axis=1).sum() / m.mean(axis=1).sum() <= 1.1
    per_rank_tokens = real[full].sum(axis=2).astype(float)
    assert per_rank_tokens.max(axis=1).sum() / per_rank_tokens.mean(axis=1).sum() <= 1.01


def test_a_resume_that_finds_the_images_behind_catches_up_a_step_at_a_time() -> None:
    """Found by the property above: 91 rows dealt to 3 ranks of 2 leave the image rows 2 behind; at 1 rank
    of 1 the next step may take 1 row only (it took 2 and gave the text queue back one)."""
    rng = np.random.default_rng(0)
    image = np.where(rng.random(91) < 0.4, rng.integers(1, 3000, size=91), 0)
    queues = row_queues(rng.permutation(91), image)
    first = step_cursors(queues, dp_size=3, batch_size=2)
    second = step_cursors(queues, dp_size=1, batch_size=1, start=tuple(first[8]))
    taken = np.diff(second, axis=0)
    assert (taken >= 0).all() and (taken.sum(axis=1) == 1).all()


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    dp=st.integers(1, 8),
    bs=st.integers(1, 3),
    share=st.floats(0.0, 1.0),
    cut=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_a_resume_at_the_same_dp_size_continues_the_same_deal(n, dp, bs, share, cut, seed) -> None:
    order, image = _stream(seed, n, share)
    queues = row_queues(order, image)
    first = step_cursors(queues, dp_size=dp, batch_size=bs)
    k = int(cut * (first.shape[0] - 1))
    again = step_cursors(queues, dp_size=dp, batch_size=bs, start=tuple(first[k]))
    assert again.tolist() == first[k:].tolist()


def test_the_last_image_rows_join_the_step_before_when_it_has_room() -> None:
    """dp 4: 4 image rows early in the stream, one more near its end; alone, the last would be a step with
    an image on one rank of four. With 2 rows a rank it joins the step that took the first four (then 5
    image rows and 3 text rows); with 1 row a rank there is no room and it stays the one exception."""
    image = np.zeros(40, dtype=np.int64)
    image[[0, 2, 4, 6, 33]] = 100
    queues = row_queues(np.arange(40), image)
    two = step_cursors(queues, dp_size=4, batch_size=2)
    assert two.tolist() == [[0, 0], [5, 3], [5, 11], [5, 19], [5, 27], [5, 35]]
    assert image_exceptions(two, 4) == 0
    rows = _deal(queues, two, 4, 2)
    held = (image[np.maximum(rows, 0)] > 0).any(axis=2)  # [steps, ranks]
    assert held[0].all() and not held[1:].any()
    assert sorted(rows[rows >= 0].tolist()) == list(range(40))
    one = step_cursors(queues, dp_size=4, batch_size=1)
    assert image_exceptions(one, 4) == 1

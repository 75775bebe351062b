"""`check_sharding`: DP x CP x PP splits of packed and fixed batches reassemble; a broken split is caught."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from puzzletron.dataset.batch.cp import batch_cp_indices
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
from puzzletron.dataset.distributed.sharding import check_sharding
from puzzletron.dataset.errors import BatchValidationError
from puzzletron.dataset.packing import TokenizedSamples, build_batch, plan_packing

PACK = 128
HEX12 = r"\b[0-9a-f]{12}\b"


def _samples(n: int = 32, seed: int = 0) -> TokenizedSamples:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 60, size=n)
    ids = [rng.integers(1, 1000, size=int(k)).tolist() for k in lengths]
    labels = [[*x[1:], -100] for x in ids]
    return TokenizedSamples.from_lists(ids, labels, sample_ids=[f"s{i}" for i in range(n)])


def _packed(rows: int = 4) -> Any:
    samples = _samples()
    spec = PuzzletronDataSpec("text", "packed_varlen", PACK, PackingSpec(pack_size=PACK))
    plan = plan_packing(samples.lengths, spec.packing, seed=0)
    assert plan.num_rows >= rows
    return build_batch(samples, plan.rows[:rows], spec=spec)


def _fixed(rows: int = 4) -> Any:
    spec = PuzzletronDataSpec("text", "fixed", 48)
    return build_batch(_samples(), [[i] for i in range(rows)], spec=spec)


def _fp(batch: Any) -> str:
    return str(batch.fingerprint)[:12]


def _expected_lines(batch: Any, *, dp: int, cp: int, pp: int) -> list[str]:
    """The report lines, from the splits made here independently of `check_sharding`."""
    shards = [batch.dp_slice(dp_rank=r, dp_size=dp) for r in range(dp)]
    lines = [f"dp={dp}: " + " ".join(_fp(s) for s in shards)]
    for r, shard in enumerate(shards):
        parts = [
            shard.cp_partition(batch_cp_indices(shard, cp_rank=c, cp_size=cp), cp_rank=c, cp_size=cp)
            for c in range(cp)
        ]
        micro = len(shard.pp_microbatches(pp)) if shard.batch_size >= pp else 1
        lines.append(
            f"  dp{r}: cp={cp} " + " ".join(_fp(p) for p in parts) + f" | pp={micro} microbatches ok"
        )
    return lines


@pytest.mark.parametrize("make", [_packed, _fixed], ids=["packed_varlen", "fixed"])
@pytest.mark.parametrize(("dp", "cp", "pp"), [(2, 2, 2), (1, 2, 1), (4, 1, 1), (2, 4, 2), (1, 1, 4)])
def test_a_batch_reassembles_and_every_shard_is_named(make, dp: int, cp: int, pp: int) -> None:
    batch = make()
    lines = check_sharding(batch, dp=dp, cp=cp, pp=pp)
    assert lines == _expected_lines(batch, dp=dp, cp=cp, pp=pp)
    assert len(lines) == 1 + dp
    # Every DP shard, then every CP partition of each, is named by its own fingerprint.
    dp_prints = re.findall(HEX12, lines[0])
    assert len(dp_prints) == len(set(dp_prints)) == dp
    for line in lines[1:]:
        cp_prints = re.findall(HEX12, line)
        assert len(cp_prints) == len(set(cp_prints)) == cp


def test_one_packed_row_is_split_over_dp_by_whole_samples() -> None:
    batch = _packed(rows=1)
    lines = check_sharding(batch, dp=2, cp=1, pp=1)
    shards = [batch.dp_slice(dp_rank=r, dp_size=2) for r in range(2)]
    assert lines[0] == f"dp=2: {_fp(shards[0])} {_fp(shards[1])}"
    assert lines[1:] == [f"  dp{r}: cp=1 {_fp(s)} | pp=1 microbatches ok" for r, s in enumerate(shards)]
    assert sum(s.input_ids.shape[1] for s in shards) == int(batch.sequence.global_cu_seqlens[-1])


def test_a_shard_with_fewer_rows_than_pp_is_one_microbatch() -> None:
    lines = check_sharding(_fixed(rows=2), dp=2, cp=1, pp=2)
    assert [line.rsplit("|", 1)[1] for line in lines[1:]] == [" pp=1 microbatches ok"] * 2


class _Tampered:
    """A real batch with some split methods replaced: what a bug in a split would hand back."""

    def __init__(self, batch: Any, **methods: Any) -> None:
        self._batch = batch
        self._methods = methods

    def __getattr__(self, name: str) -> Any:
        if name in self._methods:
            return self._methods[name]
        return getattr(self._batch, name)


def _as_only_dp_shard(tampered: _Tampered) -> _Tampered:
    tampered._methods["dp_slice"] = lambda *, dp_rank, dp_size: tampered
    return tampered


def test_dp_shards_out_of_order_are_caught() -> None:
    batch = _fixed()
    swapped = _Tampered(
        batch,
        dp_slice=lambda *, dp_rank, dp_size: batch.dp_slice(dp_rank=dp_size - 1 - dp_rank, dp_size=dp_size),
    )
    with pytest.raises(AssertionError, match=r"^DP shards do not concatenate back to the batch's input_ids$"):
        check_sharding(swapped, dp=2, cp=1, pp=1)


def test_a_cp_partition_of_the_wrong_rank_is_caught() -> None:
    batch = _packed()

    def other_rank(index: Any, *, cp_rank: int, cp_size: int) -> Any:
        other = (cp_rank + 1) % cp_size
        return batch.cp_partition(
            batch_cp_indices(batch, cp_rank=other, cp_size=cp_size), cp_rank=other, cp_size=cp_size
        )

    shard = _as_only_dp_shard(_Tampered(batch, cp_partition=other_rank))
    with pytest.raises(
        AssertionError, match=r"^CP partitions of DP shard 0 do not reassemble its input_ids$"
    ):
        check_sharding(shard, dp=1, cp=2, pp=1)


def test_pp_microbatches_out_of_order_are_caught() -> None:
    batch = _fixed()
    shard = _as_only_dp_shard(_Tampered(batch, pp_microbatches=lambda n: batch.pp_microbatches(n)[::-1]))
    with pytest.raises(
        AssertionError, match=r"^PP microbatches of DP shard 0 do not reassemble its input_ids$"
    ):
        check_sharding(shard, dp=1, cp=1, pp=2)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"dp": 0, "cp": 1, "pp": 1}, "dp must be > 0; got 0"),
        ({"dp": 1, "cp": -2, "pp": 1}, "cp must be > 0; got -2"),
        ({"dp": 1, "cp": 1, "pp": True}, "pp must be a positive int; got True"),
    ],
)
def test_sizes_must_be_positive_ints(sizes: dict[str, Any], message: str) -> None:
    with pytest.raises(BatchValidationError, match=f"^{message}"):
        check_sharding(_fixed(), **sizes)


def test_a_split_the_batch_refuses_is_a_batch_error() -> None:
    with pytest.raises(BatchValidationError):
        check_sharding(_fixed(rows=3), dp=2, cp=1, pp=1)  # 3 rows do not divide over 2 DP ranks

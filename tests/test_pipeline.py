"""`build_batches` from a token store: batches identical to the in-memory path, no tokenizer needed, a
snapshot + cache directory builds once and is reused, and a rank holds the index, never the tokens."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from _token_store_data import ROWS_PER_SHARD, SKIPPED_ROWS, TRAIN_ROWS
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec, TokenizeOptions
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.formats.token_store import TokenStore
from puzzletron.dataset.pipelines.text import TextBatches, build_batches
from puzzletron.dataset.tokenize import store as build_store
from puzzletron.dataset.tokenize.store import build_token_store

pytest_plugins = ["_token_store_fixtures"]

SPECS = {
    "packed": PuzzletronDataSpec("text", "packed_varlen", 1024, PackingSpec(1024)),
    "packed-truncate": PuzzletronDataSpec(
        "text", "packed_varlen", 512, PackingSpec(512, long_samples="truncate")
    ),
    "packed-split": PuzzletronDataSpec("text", "packed_varlen", 256, PackingSpec(256, long_samples="split")),
    "padded": PuzzletronDataSpec("text", "padded_varlen", 700),
    "fixed": PuzzletronDataSpec("text", "fixed", 300),  # shorter than many samples: truncation labels
}


@pytest.fixture(scope="module")
def store(snapshot: Path, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stores") / "store"
    return build_token_store(
        snapshot, tokenizer=tokenizer_dir, output=out, options=TokenizeOptions(rows_per_shard=ROWS_PER_SHARD)
    )


def _fingerprints(batches: TextBatches) -> list[str]:
    return [batch.fingerprint for rank in range(batches.sampler.dp_size) for batch in batches.for_rank(rank)]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_batches_from_a_store_are_identical_to_the_in_memory_ones(
    name: str, snapshot: Path, tokenizer_dir: Path, store: Path
) -> None:
    spec = SPECS[name]
    options = {"spec": spec, "batch_size": 3, "dp_size": 2, "seed": 5}
    in_memory = build_batches(snapshot, tokenizer=tokenizer_dir, **options)
    from_store = build_batches(store, **options)  # no tokenizer: the store has the tokens
    assert _fingerprints(from_store) == _fingerprints(in_memory)
    assert len(_fingerprints(from_store)) >= 4
    assert from_store.tokenized.skipped == in_memory.tokenized.skipped == len(SKIPPED_ROWS)
    assert from_store.tokenized.skipped_ids == in_memory.tokenized.skipped_ids
    assert from_store.tokenized.pad_token_id == in_memory.tokenized.pad_token_id
    if spec.packing is not None:
        assert from_store.plan.summary() == in_memory.plan.summary()


def test_split_pieces_cover_every_supervised_token_of_the_long_samples(store: Path) -> None:
    batches = build_batches(store, spec=SPECS["packed-split"], batch_size=4, seed=0)
    assert batches.plan.cut_samples > 0
    names = [d for b in batches for d in b.source_metadata["document_ids"]]
    assert any("#1" in name for name in names)  # a second piece exists
    # Every stored token of the split is in exactly one piece of one batch.
    assert sum(int(b.hidden_mask.sum()) for b in batches) == TokenStore(store).num_tokens


def test_a_snapshot_with_a_cache_dir_is_tokenised_once_then_reused(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = SPECS["packed"]
    first = build_batches(snapshot, tokenizer=tokenizer_dir, spec=spec, batch_size=2, cache_dir=tmp_path)
    (built,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert TokenStore(built).manifest["counts"]["samples"] == TRAIN_ROWS - len(SKIPPED_ROWS)

    def no_tokenising(*args: object, **kwargs: object) -> None:
        raise AssertionError("the store should have been reused")

    monkeypatch.setattr(build_store, "tokenize_rows", no_tokenising)
    again = build_batches(snapshot, tokenizer=tokenizer_dir, spec=spec, batch_size=2, cache_dir=tmp_path)
    assert [b.fingerprint for b in again] == [b.fingerprint for b in first]


def test_store_batches_come_through_dataloader_workers_unchanged(store: Path) -> None:
    batches = build_batches(store, spec=SPECS["packed"], batch_size=2, seed=1)
    assert [b.fingerprint for b in batches.loader(num_workers=2)] == [b.fingerprint for b in batches]
    assert pickle.loads(pickle.dumps(batches.dataset))[batches.sampler.key(0)] == next(iter(batches))


def test_a_rank_holds_the_index_never_the_tokens(store: Path) -> None:
    samples = build_batches(store, spec=SPECS["packed"], batch_size=2).tokenized.samples
    assert not hasattr(samples, "input_ids")  # tokens are read per batch from the shards
    assert samples.lengths.dtype.name == "uint32" and samples.lengths.shape == (len(samples),)


def test_a_snapshot_without_a_tokenizer_or_rows_with_a_cache_dir_are_errors(
    snapshot: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="tokenizer is required"):
        build_batches(snapshot, spec=SPECS["packed"], batch_size=1)
    with pytest.raises(ConfigError, match="cache_dir needs a snapshot folder"):
        build_batches(
            [{"messages": []}], tokenizer="unused", spec=SPECS["packed"], batch_size=1, cache_dir=tmp_path
        )

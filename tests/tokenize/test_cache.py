"""One store, never two: a token store is found by its identity wherever it lies under a cache directory
(the hashed name, a name the user chose with ``tokenize --output``, a nested folder), and `build_batches`
with that cache directory reuses it without tokenising; stores of another identity, incomplete ones and
hidden folders are passed over."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from _token_store_data import ROWS_PER_SHARD
from puzzletron.cli import main
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec, TokenizeOptions
from puzzletron.dataset.formats.text_snapshot import open_split
from puzzletron.dataset.pipelines import _core as pipeline  # where build_batches tokenises in memory
from puzzletron.dataset.pipelines.text import build_batches
from puzzletron.dataset.tokenize import build_token_store, find_store, short_hash, store_identity
from puzzletron.dataset.tokenize import store as build_store

OPTIONS = TokenizeOptions(rows_per_shard=ROWS_PER_SHARD)
SPEC = PuzzletronDataSpec("text", "packed_varlen", 1024, PackingSpec(1024))


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("a store of this identity exists under the cache directory: nothing is tokenised")


@pytest.fixture
def no_tokenising(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way to tokenise (store shards, the tokenizer, the in-memory path) fails the test."""
    monkeypatch.setattr(build_store, "tokenize_rows", _never)
    monkeypatch.setattr(build_store, "chat_tokenizer", _never)
    monkeypatch.setattr(pipeline, "tokenize_conversations", _never)


def _identity(snapshot: Path, tokenizer_dir: Path, options: TokenizeOptions = OPTIONS) -> dict:
    return store_identity(open_split(snapshot), tokenizer=tokenizer_dir, options=options)


def test_build_batches_reuses_the_store_tokenize_wrote_under_the_cache_dir(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The README's path: ``tokenize ... --output stores/puzzle-kd``, then ``build_batches(snapshot,
    cache_dir="stores")``: the second step tokenises nothing and builds no second store."""
    stores = tmp_path / "stores"
    argv = [
        "tokenize",
        str(snapshot),
        "--tokenizer",
        str(tokenizer_dir),
        "--output",
        str(stores / "puzzle-kd"),
    ]
    assert main([*argv, "--rows-per-shard", str(ROWS_PER_SHARD)]) == 0
    capsys.readouterr()
    named = build_batches(stores / "puzzle-kd", spec=SPEC, batch_size=2)  # the store itself
    monkeypatch.setattr(build_store, "tokenize_rows", _never)
    monkeypatch.setattr(build_store, "chat_tokenizer", _never)
    monkeypatch.setattr(pipeline, "tokenize_conversations", _never)
    batches = build_batches(
        snapshot, tokenizer=tokenizer_dir, spec=SPEC, batch_size=2, cache_dir=stores, options=OPTIONS
    )
    assert batches.tokenized.samples.store.path == stores / "puzzle-kd"
    assert [b.fingerprint for b in batches] == [b.fingerprint for b in named]
    assert sorted(p.name for p in stores.iterdir() if not p.name.startswith(".")) == ["puzzle-kd"]  # (plans)


@pytest.fixture(scope="module")
def built(snapshot: Path, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of `OPTIONS` built outside any cache directory (before a test's patches)."""
    out = tmp_path_factory.mktemp("built") / "store"
    return build_token_store(snapshot, tokenizer=tokenizer_dir, output=out, options=OPTIONS)


def test_a_store_anywhere_under_the_cache_dir_is_found_and_hidden_folders_are_not_searched(
    built: Path, snapshot: Path, tokenizer_dir: Path, tmp_path: Path, no_tokenising: None
) -> None:
    cache = tmp_path / "cache"
    identity = _identity(snapshot, tokenizer_dir)
    assert find_store(cache, identity) is None  # no such directory yet
    shutil.copytree(built, cache / ".hidden" / "copy")
    assert find_store(cache, identity) is None
    shutil.copytree(built, cache / "team" / "text" / "puzzle-kd-train")
    found = build_token_store(snapshot, tokenizer=tokenizer_dir, cache_dir=cache, options=OPTIONS)
    assert found == cache / "team" / "text" / "puzzle-kd-train" == find_store(cache, identity)
    assert sorted(p.name for p in cache.iterdir()) == [".hidden", "team"]


def test_another_identity_or_an_incomplete_store_is_passed_over(
    built: Path, snapshot: Path, tokenizer_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    other = build_token_store(
        snapshot, tokenizer=tokenizer_dir, output=cache / "other", options=TokenizeOptions(rows_per_shard=64)
    )
    damaged = shutil.copytree(built, cache / "damaged")
    (damaged / "shards" / "000000.tokens").unlink()  # its manifest names the identity; a shard is gone
    created = build_token_store(snapshot, tokenizer=tokenizer_dir, cache_dir=cache, options=OPTIONS)
    assert created == cache / short_hash(_identity(snapshot, tokenizer_dir))  # a new one, at its hash
    assert created not in (other, damaged)
    assert "passing over" in caplog.text and "damaged" in caplog.text
    assert find_store(cache, _identity(snapshot, tokenizer_dir)) == created  # the hashed name first


def test_a_fifo_a_huge_or_a_deeply_nested_manifest_under_the_cache_dir_is_passed_over_unread(
    built: Path, snapshot: Path, tokenizer_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    for name in ("a-fifo", "b-huge", "c-deep", "d-device"):
        (cache / name).mkdir(parents=True)
    os.mkfifo(cache / "a-fifo" / "manifest.json")  # opening it for reading would wait for a writer
    with open(cache / "b-huge" / "manifest.json", "wb") as fh:
        fh.truncate(1 << 30)  # 1 GiB (sparse: no disk), over the 64 MiB a lookup reads
    (cache / "c-deep" / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    (cache / "d-device" / "manifest.json").symlink_to("/dev/zero")
    shutil.copytree(built, cache / "team" / "puzzle-kd")
    found: list = []
    lookup = threading.Thread(
        target=lambda: found.append(find_store(cache, _identity(snapshot, tokenizer_dir))), daemon=True
    )
    lookup.start()
    lookup.join(120)  # a guard against the hang only
    if lookup.is_alive():  # an old version waits on the FIFO: a writer lets its thread end
        os.close(os.open(cache / "a-fifo" / "manifest.json", os.O_WRONLY | os.O_NONBLOCK))
    assert found == [cache / "team" / "puzzle-kd"], "the lookup did not end (it waited on the FIFO)"
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "a-fifo/manifest.json: the manifest is a FIFO, not a regular file" in said
    assert "b-huge/manifest.json: the manifest is 1.0 GiB (1073741824 bytes); at most 64.0 MiB" in said
    assert "c-deep" in said and "nests JSON more than 64 levels deep" in said
    assert "d-device/manifest.json: the manifest is a character device, not a regular file" in said

"""The token store format: every sample round-trips to the in-memory tokenisation, the reader's API (lengths,
offsets, lazy ids, positional reads across shards, pickling into DataLoader workers), and verify / the
reader against tampered, truncated and foreign stores."""

from __future__ import annotations

import gc
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from _token_store_data import ROWS_PER_SHARD, SKIPPED_ROWS, TRAIN_ROWS
from puzzletron.dataset import formats
from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.errors import ConfigError, SubsetError
from puzzletron.dataset.formats.text_snapshot import load_text_split
from puzzletron.dataset.formats.token_store import TokenStore, content_sha256
from puzzletron.dataset.tokenize import labels_from_mask, tokenize_conversations
from puzzletron.dataset.tokenize.store import build_token_store


@pytest.fixture(scope="module")
def store_path(snapshot: Path, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stores") / "train"
    return build_token_store(
        snapshot, tokenizer=tokenizer_dir, output=out, options=TokenizeOptions(rows_per_shard=ROWS_PER_SHARD)
    )


@pytest.fixture(scope="module")
def reference(snapshot: Path, tokenizer_dir: Path):
    return tokenize_conversations(load_text_split(snapshot), tokenizer=tokenizer_dir)


def _copy(store_path: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(store_path, copy)
    return copy


def test_every_sample_equals_the_in_memory_tokenisation(store_path: Path, reference) -> None:
    store, samples = TokenStore(store_path), reference.samples
    assert len(store) == len(samples) == TRAIN_ROWS - len(SKIPPED_ROWS)
    assert store.num_tokens == int(samples.offsets[-1])
    assert store.skipped == reference.skipped and store.skipped_ids() == list(reference.skipped_ids)
    assert store.pad_token_id == reference.pad_token_id
    assert np.array_equal(store.offsets, samples.offsets) and np.array_equal(store.lengths, samples.lengths)
    assert store.lengths.dtype == np.uint32 and store.offsets.dtype == np.int64
    assert not store.lengths.flags.writeable and not store.offsets.flags.writeable
    assert store.sample_ids(range(len(store))) == list(samples.sample_ids)
    # the whole store in one read, and sample by sample: ids and (derived) labels are today's
    ids, mask = store.read(store.offsets[:-1], store.offsets[1:])
    assert np.array_equal(ids, samples.input_ids)
    assert np.array_equal(labels_from_mask(ids, mask, np.asarray(store.offsets)), samples.labels)
    for i in (0, 17, 23, 29, len(store) - 1):  # an empty reply, unicode, a leading assistant turn
        a, b = samples.offsets[i], samples.offsets[i + 1]
        one_ids, one_mask = store.read([a], [b])
        assert np.array_equal(one_ids, samples.input_ids[a:b])
        assert np.array_equal(labels_from_mask(one_ids, one_mask, np.array([0, b - a])), samples.labels[a:b])
    manifest = store.manifest
    assert manifest["token_dtype"] == "uint16" and manifest["counts"]["shards"] == -(
        -TRAIN_ROWS // ROWS_PER_SHARD
    )
    assert (store_path / "shards" / "000000.tokens").stat().st_size == 2 * manifest["shards"][0]["tokens"][1]


def test_reads_cross_shards_and_take_empty_partial_and_repeated_ranges(store_path: Path) -> None:
    store = TokenStore(store_path)
    all_ids, all_mask = store.read([0], [store.num_tokens])
    bounds = [s["tokens"][0] for s in store.manifest["shards"]]
    rng = np.random.default_rng(0)
    starts = np.concatenate([rng.integers(0, store.num_tokens, 40), np.array(bounds[1:]) - 3, [5, 5, 0]])
    stops = np.minimum(starts + rng.integers(0, 3000, starts.size), store.num_tokens)
    stops[-3:] = [5, 9, 0]  # an empty range, a repeated start, an empty range at 0
    ids, mask = store.read(starts, stops)
    assert np.array_equal(ids, np.concatenate([all_ids[a:b] for a, b in zip(starts, stops, strict=True)]))
    assert np.array_equal(mask, np.concatenate([all_mask[a:b] for a, b in zip(starts, stops, strict=True)]))
    empty_ids, empty_mask = store.read(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert empty_ids.shape == empty_mask.shape == (0,) and empty_ids.dtype == np.int64
    with pytest.raises(ConfigError, match="token ranges"):
        store.read([10], [5])
    with pytest.raises(ConfigError, match="token ranges"):
        store.read([0], [store.num_tokens + 1])
    with pytest.raises(ConfigError, match=r"sample indices must be in \[0, "):
        store.sample_ids([len(store)])
    every = store.sample_ids(range(len(store)))
    assert store.sample_ids([3, 0, 3]) == [every[3], every[0], every[3]] and store.sample_ids([]) == []


class _Samples(torch.utils.data.Dataset):
    """Sample i of a store as a tensor: what a DataLoader worker reads through a pickled store."""

    def __init__(self, store: TokenStore) -> None:
        self.store = store

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i: int) -> torch.Tensor:
        ids, _ = self.store.read(self.store.offsets[i : i + 1], self.store.offsets[i + 1 : i + 2])
        return torch.from_numpy(ids)


def test_a_store_pickles_and_reads_the_same_in_dataloader_workers(store_path: Path) -> None:
    store = TokenStore(store_path)
    store.read([0], [100])  # open files and maps before pickling: they do not travel
    clone = pickle.loads(pickle.dumps(store))
    assert np.array_equal(clone.read([7], [900])[0], store.read([7], [900])[0])
    direct = [store.read([a], [b])[0] for a, b in zip(store.offsets[:-1], store.offsets[1:], strict=True)]
    loader = torch.utils.data.DataLoader(_Samples(store), batch_size=None, num_workers=2)
    assert all(np.array_equal(a.numpy(), b) for a, b in zip(loader, direct, strict=True))
    store.close()
    assert np.array_equal(store.read([7], [900])[0], clone.read([7], [900])[0])  # reopens lazily


def test_verify_and_describe_dispatch_on_the_manifest(store_path: Path) -> None:
    report = formats.verify(store_path)
    assert (
        report.ok
        and report.format == "puzzletron-token-store"
        and report.sample_count == len(TokenStore(store_path))
    )
    assert formats.summary(report) == f"{report.sample_count} samples"
    info = formats.describe(store_path)
    assert info["format"] == "puzzletron-token-store" and info["counts"]["skipped"] == len(SKIPPED_ROWS)
    assert info["identity"]["snapshot"]["revision"] == "f" * 40 and info["bytes_on_disk"] > 0
    lines = formats.render(info)
    assert lines[0].startswith("token store ") and any(line.startswith("identity") for line in lines)


def test_verify_catches_a_tampered_shard_and_the_reader_refuses_its_ids(
    store_path: Path, tmp_path: Path
) -> None:
    store_dir = _copy(store_path, tmp_path)
    shard = store_dir / "shards" / "000002.tokens"
    data = bytearray(shard.read_bytes())
    data[100:102] = (65535).to_bytes(2, "little")  # same size, an id outside the vocabulary
    shard.write_bytes(bytes(data))
    report = formats.verify(store_dir)
    assert not report.ok
    assert any("000002.tokens: SHA-256 differs" in p for p in report.problems)
    assert any("token id 65535 is outside the vocabulary" in p for p in report.problems)
    store = TokenStore(store_dir)  # sizes match: opening succeeds, reading the damaged block does not
    first = store.manifest["shards"][2]["tokens"][0]
    with pytest.raises(SubsetError, match=r"000002\.tokens: bytes 0\.\.\d+ \(block 0\) do not match"):
        store.read([first], [first + 200])
    assert np.array_equal(store.read([0], [first])[0], TokenStore(store_path).read([0], [first])[0])


@pytest.mark.parametrize("change", ["truncate", "extend", "remove"])
def test_verify_catches_a_truncated_or_missing_shard_and_the_reader_refuses_to_open(
    store_path: Path, tmp_path: Path, change: str
) -> None:
    store_dir = _copy(store_path, tmp_path)
    shard = store_dir / "shards" / "000003.mask"
    if change == "remove":
        shard.unlink()
    else:
        data = shard.read_bytes()
        shard.write_bytes(data[:-5] if change == "truncate" else data + b"\0")
    report = formats.verify(store_dir)
    assert not report.ok and any("000003.mask" in p for p in report.problems)
    with pytest.raises(SubsetError, match=r"000003\.mask (is missing|has \d+ bytes)"):
        TokenStore(store_dir)


def test_verify_catches_an_inconsistent_index_behind_matching_hashes(
    store_path: Path, tmp_path: Path
) -> None:
    store_dir = _copy(store_path, tmp_path)
    lengths = np.fromfile(store_dir / "index" / "lengths.u32", dtype="<u4")
    lengths[[3, 4]] = lengths[[4, 3]]  # plausible lengths, swapped: offsets no longer agree
    (store_dir / "index" / "lengths.u32").write_bytes(lengths.tobytes())
    manifest = json.loads((store_dir / "manifest.json").read_text())
    record = next(r for r in manifest["files"] if r["path"] == "index/lengths.u32")
    record["sha256"] = formats.manifest.sha256_file(store_dir / "index" / "lengths.u32")  # re-signed
    manifest["content_sha256"] = content_sha256(manifest)  # and the binding: a forger's store
    (store_dir / "manifest.json").write_text(json.dumps(manifest))
    report = formats.verify(store_dir)
    assert report.problems and "disagree in samples" in report.problems[0]


@pytest.mark.parametrize(("key", "value", "message"), [
    ("version", 1, "token store version 1 is not supported"),
    ("format", "puzzletron-text-snapshot", "not a token store"),
])  # fmt: skip
def test_the_reader_refuses_another_version_or_format(
    store_path: Path, tmp_path: Path, key: str, value: object, message: str
) -> None:
    store_dir = _copy(store_path, tmp_path)
    manifest = json.loads((store_dir / "manifest.json").read_text())
    manifest[key] = value
    (store_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SubsetError, match=message):
        TokenStore(store_dir)
    assert not formats.verify(store_dir).ok


def test_a_split_without_supervised_rows_gives_an_empty_store(tokenizer_dir: Path, tmp_path: Path) -> None:
    rows = [{"uuid": f"u{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(5)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "plain" / "train"))  # no manifest
    path = build_token_store(tmp_path / "plain", tokenizer=tokenizer_dir, output=tmp_path / "store")
    store = TokenStore(path)
    assert len(store) == 0 and store.num_tokens == 0 and store.skipped == 5
    assert store.skipped_ids() == [f"u{i}" for i in range(5)] and store.lengths.shape == (0,)
    assert store.offsets.tolist() == [0] and store.read([], [])[0].size == 0
    assert formats.verify(path).ok


def test_a_store_collected_at_interpreter_exit_closes_its_files_silently(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At exit Python sets a module's globals to None before the last objects are collected; the store's
    finaliser must neither need them nor print ``Exception ignored in TokenStore.__del__``."""
    from puzzletron.dataset.formats.token_store import reader
    from puzzletron.dataset.storage import local

    store = TokenStore(store_path)
    store.read(store.offsets[[0]], store.offsets[[1]])
    fds = list(store._files._fds.values())  # the pinned files it read through
    assert fds
    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    for module in (reader, local):
        for name in [n for n in vars(module) if not n.startswith("__")]:
            monkeypatch.setattr(module, name, None)  # what interpreter shutdown does to the module
    del store
    gc.collect()
    monkeypatch.undo()
    assert unraisable == []
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed


def test_one_sample_reads_give_what_read_gives_for_every_sample(store_path: Path) -> None:
    store = TokenStore(store_path)
    offsets = np.asarray(store.offsets)
    for reader in (store, pickle.loads(pickle.dumps(store))):
        for i in [*range(len(store)), 0, len(store) - 1]:  # every sample, then again (verified, mapped)
            ids, mask = reader.read(offsets[i : i + 1], offsets[i + 1 : i + 2])
            one_ids, one_mask = reader.sample(i)
            assert one_ids.dtype == np.int64 and one_mask.dtype == np.bool_
            assert np.array_equal(one_ids, ids) and np.array_equal(one_mask, mask)
            assert np.array_equal(reader.tokens(i), ids)
    with pytest.raises(IndexError, match=f"sample index {len(store)} out of range"):
        store.sample(len(store))
    with pytest.raises(IndexError, match="sample index -1 out of range"):
        store.tokens(-1)
    store.close()  # closing drops the mappings; the next read maps again
    assert np.array_equal(store.tokens(3), store.read(offsets[3:4], offsets[4:5])[0])


def _forge(store_dir: Path, rel: str, data: bytes) -> None:
    """Replace a shard file and make the block checksums and the manifest agree with it (a forger's store:
    only the content checks can refuse it)."""
    import hashlib

    from puzzletron.dataset.formats.blocks import block_sums

    (store_dir / rel).write_bytes(data)
    manifest = json.loads((store_dir / "manifest.json").read_text())
    records = {r["path"]: r for r in manifest["files"]}
    records[rel]["sha256"] = hashlib.sha256(data).hexdigest()
    sums = [block_sums((store_dir / r["path"]).read_bytes()) for r in manifest["files"]
            if r["path"] != "index/blocks.u64"]  # fmt: skip
    blocks = np.concatenate(sums).astype("<u8").tobytes()
    (store_dir / "index/blocks.u64").write_bytes(blocks)
    records["index/blocks.u64"]["sha256"] = hashlib.sha256(blocks).hexdigest()
    manifest["content_sha256"] = content_sha256(manifest)
    (store_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def test_an_id_outside_the_vocabulary_behind_matching_checksums_is_refused_by_every_read(
    store_path: Path, tmp_path: Path
) -> None:
    store_dir = _copy(store_path, tmp_path)
    data = bytearray((store_dir / "shards/000001.tokens").read_bytes())
    data[10:12] = (65535).to_bytes(2, "little")
    _forge(store_dir, "shards/000001.tokens", bytes(data))
    for read in (
        lambda s: s.sample(int(np.searchsorted(s.offsets, s.manifest["shards"][1]["tokens"][0]))),
        lambda s: s.tokens(int(np.searchsorted(s.offsets, s.manifest["shards"][1]["tokens"][0]))),
        lambda s: s.read(s.offsets[:-1], s.offsets[1:]),
    ):
        with pytest.raises(SubsetError, match=r"000001\.tokens: token id 65535 outside the vocabulary"):
            read(TokenStore(store_dir))


def _resident_kib(path: Path) -> int:
    """KiB of `path`'s mappings resident in this process (``/proc/self/smaps``)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps (Linux)")
def test_an_epoch_of_reads_keeps_the_mapped_shard_resident_below_the_release_bound(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from puzzletron.dataset.formats.token_store import reader as token_reader

    one_shard = TokenizeOptions(rows_per_shard=TRAIN_ROWS)  # a 500 KiB token file
    path = build_token_store(snapshot, tokenizer=tokenizer_dir, output=tmp_path / "one", options=one_shard)
    monkeypatch.setattr(token_reader, "_RELEASE_BYTES", 16 * 1024)
    store = TokenStore(path)
    shard = (path / "shards" / "000000.tokens").resolve()
    released, release = [], store._files.release
    store._files.release = lambda: (released.append(_resident_kib(shard)), release())  # type: ignore[method-assign]
    for i in range(len(store)):
        store.sample(i)
    # a release every 16 KiB copied out: the walk's pages never pile up (their granularity is the file
    # system's: 4 KiB pages, 64 KiB fault-around, or 2 MiB huge pages on tmpfs)
    longest = 2 * int(store.lengths.max())  # a release comes before the read after the bound was passed
    assert len(released) >= store.num_tokens * 2 // (16 * 1024 + longest) and max(released) > 0
    assert _resident_kib(shard) <= max(released)
    store._files.release()
    assert released[-1] > 0 and _resident_kib(shard) == 0

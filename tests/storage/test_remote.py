"""`RemoteFiles`, the ByteSource of an URL prefix: reads across chunks through the node's cache (served
from it once fetched, bounded while an epoch walks past it), whole files mapped, pins from one listing,
a file replaced after it was pinned refused, picklable into forked readers."""

from __future__ import annotations

import multiprocessing
import pickle

import numpy as np
import pytest

from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.storage.object_cache import ObjectCache
from puzzletron.dataset.storage.objects import ObjectChanged, ObjectOptions, Objects, join_url
from puzzletron.dataset.storage.remote import RemoteFiles
from puzzletron.dataset.storage.sources import ByteSource, open_source

FORK = multiprocessing.get_context("fork")
CHUNK = 64 * 1024
DATA = np.random.default_rng(0).integers(0, 256, size=10 * CHUNK + 123, dtype=np.uint8).tobytes()


@pytest.fixture
def url(bucket: str) -> str:
    url = join_url(bucket, "store")
    objects = Objects(url)
    objects.put_bytes("shards/data.bin", DATA)
    objects.put_bytes("index/small.i64", np.arange(100, dtype="<i8").tobytes())
    return url


def _read(files: RemoteFiles, rel: str, offset: int, size: int) -> bytes:
    out = np.empty(size, np.uint8)
    files.read_into(rel, offset, out)
    return out.tobytes()


def test_open_source_picks_the_medium_by_the_location(url: str, tmp_path) -> None:
    assert isinstance(open_source(url), RemoteFiles) and isinstance(open_source(url), ByteSource)
    assert type(open_source(tmp_path)).__name__ == "LocalFiles"


def test_reads_across_chunks_are_exact_and_then_served_by_the_cache(
    url: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ObjectCache(tmp_path / "cache", max_bytes=1 << 30)
    files = RemoteFiles(url, cache=cache, chunk_size=CHUNK)
    files.pin("shards/data.bin")
    for offset, size in [(0, 10), (CHUNK - 5, 10), (3 * CHUNK + 7, 4 * CHUNK), (len(DATA) - 50, 50)]:
        assert _read(files, "shards/data.bin", offset, size) == DATA[offset : offset + size]
    assert files.read_bytes("shards/data.bin") == DATA
    files.close()
    # another reader of the node, with the server gone: everything comes from the cache
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    again = RemoteFiles(url, cache=cache, chunk_size=CHUNK, options=ObjectOptions(retries=0))
    again._pins, again._listing = dict(files._pins), dict(files.listing())
    assert again.read_bytes("shards/data.bin") == DATA


def test_an_epoch_through_a_small_cache_stays_bounded_and_exact(url: str, tmp_path) -> None:
    cache = ObjectCache(tmp_path / "cache", max_bytes=3 * CHUNK)
    files = RemoteFiles(url, cache=cache, chunk_size=CHUNK)
    for _ in range(2):
        for offset in range(0, len(DATA), 10_000):
            size = min(10_000, len(DATA) - offset)
            assert _read(files, "shards/data.bin", offset, size) == DATA[offset : offset + size]
    assert cache.usage() <= 3 * CHUNK


def test_a_mapped_file_is_downloaded_whole_once_and_mapped(url: str, tmp_path) -> None:
    cache = ObjectCache(tmp_path / "cache", max_bytes=1 << 30)
    files = RemoteFiles(url, cache=cache, chunk_size=CHUNK)
    mapped = files.map("index/small.i64", "<i8", 100)
    assert isinstance(mapped, np.memmap) and mapped.tolist() == list(range(100))
    assert len([p for p in cache.root.glob("files/*/*") if not p.name.startswith(".")]) == 1
    assert RemoteFiles(url, cache=None).map("index/small.i64", "<i8", 100).tolist() == list(range(100))


def test_missing_objects_and_reads_past_the_end_name_the_object(url: str) -> None:
    files = RemoteFiles(url, cache=None)
    with pytest.raises(SnapshotError, match=r"s3://bkt/store/nope: no such object"):
        files.pin("nope")
    with pytest.raises(SnapshotError, match=r"ends at byte 800; bytes 790..810"):
        _read(files, "index/small.i64", 790, 20)


@pytest.mark.parametrize("cached", [True, False])
def test_an_object_replaced_after_it_was_pinned_is_refused(url: str, tmp_path, cached: bool) -> None:
    cache = ObjectCache(tmp_path / "cache", max_bytes=1 << 30) if cached else None
    files = RemoteFiles(url, cache=cache, chunk_size=CHUNK)
    files.pin("shards/data.bin")
    assert _read(files, "shards/data.bin", 0, 100) == DATA[:100]
    Objects(url).put_bytes("shards/data.bin", DATA[::-1])  # same size: only the ETag tells
    with pytest.raises(ObjectChanged, match=r"s3://bkt/store/shards/data.bin: the object changed"):
        _read(files, "shards/data.bin", 5 * CHUNK, 100)  # a chunk not cached yet
    fresh = RemoteFiles(url, cache=cache, chunk_size=CHUNK)  # a reader opened after: the new bytes
    assert _read(fresh, "shards/data.bin", 0, 100) == DATA[::-1][:100]


def _child_reads(files: RemoteFiles, out: multiprocessing.Queue) -> None:
    out.put(_read(files, "shards/data.bin", 2 * CHUNK, 1000) == DATA[2 * CHUNK : 2 * CHUNK + 1000])


def test_a_pickled_or_forked_reader_reads_with_its_own_client(url: str) -> None:
    files = RemoteFiles(url, chunk_size=CHUNK)
    files.pin("shards/data.bin")
    assert _read(files, "shards/data.bin", 0, 10) == DATA[:10]  # the parent's client exists now
    copy = pickle.loads(pickle.dumps(files))
    assert copy._pins == files._pins and _read(copy, "shards/data.bin", 7, 3) == DATA[7:10]
    out = FORK.Queue()
    child = FORK.Process(target=_child_reads, args=(files, out))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and out.get() is True


def test_a_cache_bound_below_one_chunk_is_refused_naming_the_variable(url: str, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"PUZZLETRON_OBJECT_CACHE_BYTES\) is 32768 bytes, below one chunk"):
        RemoteFiles(url, cache=ObjectCache(tmp_path / "cache", max_bytes=CHUNK // 2), chunk_size=CHUNK)


def test_a_cache_of_one_chunk_fetches_every_chunk_once_even_when_a_read_spans_several(
    url: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spans: list[tuple[int, int]] = []
    real = Objects.get_ranges

    def counted(self, rel, wanted, *, etag=None):
        wanted = list(wanted)
        spans.extend(wanted)
        return real(self, rel, wanted, etag=etag)

    monkeypatch.setattr(Objects, "get_ranges", counted)
    cache = ObjectCache(tmp_path / "cache", max_bytes=CHUNK)  # each write evicts down to 0.9 chunk
    files = RemoteFiles(url, cache=cache, chunk_size=CHUNK)
    for offset in range(0, len(DATA), 10_000):
        size = min(10_000, len(DATA) - offset)
        assert _read(files, "shards/data.bin", offset, size) == DATA[offset : offset + size]
    assert len(spans) == 11  # 10 chunks and the short last one, each fetched once
    spans.clear()
    fresh = RemoteFiles(url, cache=cache, chunk_size=CHUNK)
    assert _read(fresh, "shards/data.bin", CHUNK - 7, 2 * CHUNK + 14) == DATA[CHUNK - 7 : 3 * CHUNK + 7]
    assert sorted(spans) == [(k * CHUNK, (k + 1) * CHUNK) for k in range(4)]  # chunks 0..3, once each
    assert cache.usage() <= CHUNK

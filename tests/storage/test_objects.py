"""Objects under an URL prefix, against a real S3-compatible server on loopback: listing, ranged reads
pinned by ETag, the create-once write, and what a dropped or stalled connection does (retried to the right
bytes, or a clear error within the timeouts: never wrong bytes)."""

from __future__ import annotations

import hashlib
import threading
import time
from urllib.parse import urlsplit

import pytest

from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.storage.objects import ObjectChanged, ObjectOptions, Objects, is_url, join_url
from puzzletron.fixtures.tcp_faults import TcpFaults

DATA = bytes(range(256)) * 4096  # 1 MiB
FAST = ObjectOptions(connect_timeout_s=1, read_timeout_s=1, retries=2)


@pytest.fixture
def objects(bucket: str) -> Objects:
    objects = Objects(join_url(bucket, "prefix"))
    objects.put_bytes("a/data.bin", DATA)
    return objects


def test_urls_and_paths_are_told_apart() -> None:
    assert [is_url(x) for x in ("s3://b/p", "gs://b", "stores/x", "/abs", "file:///x")] == [
        True, True, False, False, False,
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="name a bucket"):
        Objects("s3://")


def test_a_listing_gives_sizes_and_etags_relative_to_the_prefix(objects: Objects) -> None:
    objects.put_bytes("b.txt", b"hello")
    listing = objects.list()
    assert sorted(listing) == ["a/data.bin", "b.txt"]
    assert listing["b.txt"].size == 5
    assert listing["a/data.bin"].etag == f'"{hashlib.md5(DATA).hexdigest()}"'  # single-part: the MD5
    assert sorted(objects.list("a")) == ["a/data.bin"]


def test_ranged_reads_give_exactly_the_bytes_asked(objects: Objects) -> None:
    etag = objects.list()["a/data.bin"].etag
    assert objects.get_range("a/data.bin", 1000, 71_000, etag=etag) == DATA[1000:71_000]
    spans = [(0, 10), (500_000, 600_000), (len(DATA) - 3, len(DATA))]
    assert objects.get_ranges("a/data.bin", spans, etag=etag) == [DATA[a:b] for a, b in spans]
    assert objects.get("missing") is None


def test_a_replaced_object_is_refused_on_the_read_that_would_serve_its_bytes(objects: Objects) -> None:
    etag = objects.list()["a/data.bin"].etag
    objects.put_bytes("a/data.bin", DATA[::-1])  # same size, other bytes
    with pytest.raises(ObjectChanged, match="changed after it was pinned"):
        objects.get_range("a/data.bin", 0, 100, etag=etag)
    objects.delete(["a/data.bin"])
    with pytest.raises(ObjectChanged, match="gone"):
        objects.get_range("a/data.bin", 0, 100, etag=etag)


def test_create_once_writes_only_the_first_time(objects: Objects) -> None:
    assert objects.create_once("manifest.json", b"first")
    assert not objects.create_once("manifest.json", b"second")
    assert objects.get("manifest.json") == b"first"


def _through(proxy: TcpFaults, monkeypatch: pytest.MonkeyPatch, bucket: str) -> Objects:
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    return Objects(join_url(bucket, "prefix"), options=FAST)


@pytest.mark.parametrize("after", [2000, 300_000])
def test_a_connection_dropped_mid_body_is_retried_to_the_right_bytes(
    objects: Objects, s3_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch, after: int
) -> None:
    etag = objects.list()["a/data.bin"].etag
    with TcpFaults(urlsplit(s3_endpoint).port) as proxy:
        faulty = _through(proxy, monkeypatch, bucket)
        proxy.configure("cut", after=after, faults=1)
        assert faulty.get_range("a/data.bin", 100, 700_100, etag=etag) == DATA[100:700_100]
        assert proxy.connections >= 2


def test_connections_that_always_drop_are_a_clear_error_never_short_bytes(
    objects: Objects, s3_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    etag = objects.list()["a/data.bin"].etag
    with TcpFaults(urlsplit(s3_endpoint).port) as proxy:
        faulty = _through(proxy, monkeypatch, bucket)
        proxy.configure("cut", after=2000)
        with pytest.raises(
            OSError, match=r"s3://bkt/prefix/a/data.bin: bytes 0..700000 could not be read in 3"
        ):
            faulty.get_range("a/data.bin", 0, 700_000, etag=etag)


def test_a_stall_once_is_retried_and_a_server_that_always_stalls_fails_within_the_timeouts(
    objects: Objects, s3_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    etag = objects.list()["a/data.bin"].etag
    with TcpFaults(urlsplit(s3_endpoint).port) as proxy:
        faulty = _through(proxy, monkeypatch, bucket)
        proxy.configure("stall", after=2000, faults=1)
        assert faulty.get_range("a/data.bin", 0, 500_000, etag=etag) == DATA[:500_000]
        for after in (0, 2000):  # before the headers, in the body
            proxy.configure("stall", after=after)
            started = time.monotonic()
            with pytest.raises(OSError, match="could not be read in 3 attempts"):
                faulty.get_range("a/data.bin", 0, 500_000, etag=etag)
            # 3 attempts of a 1 s read timeout plus backoff; generous for a loaded machine
            assert time.monotonic() - started < 3 * (1 + 1) + 1.5 + 5


def _ends(call, out: list) -> threading.Thread:
    """`call()` in a thread (its result or error appended to `out`): a read that never ends stays alive."""

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_server_trickling_bodies_is_cut_by_the_request_deadline_retried_then_a_clear_error(
    objects: Objects, s3_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    etag = objects.list()["a/data.bin"].etag
    monkeypatch.setenv("PUZZLETRON_OBJECT_REQUEST_TIMEOUT_S", "2")
    with TcpFaults(urlsplit(s3_endpoint).port) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        slow = Objects(join_url(bucket, "prefix"), options=ObjectOptions(read_timeout_s=1, retries=1))
        proxy.configure("trickle", rate=2000)  # a piece every 0.1 s: no read ever waits 1 s
        for call, said in [
            (lambda: slow.get_range("a/data.bin", 0, 700_000, etag=etag), "bytes 0..700000 could not"),
            (lambda: slow.get("a/data.bin"), "reading s3://bkt/prefix/a/data.bin failed"),
        ]:
            out: list = []
            _ends(call, out).join(120)  # 2 attempts of 2 s and a backoff; the guard only catches a hang
            assert out, "the read did not end: no deadline"
            assert isinstance(out[0], OSError), out[0]
            assert said in str(out[0]) and "in 2 attempts" in str(out[0])
            assert "within 2 s (PUZZLETRON_OBJECT_REQUEST_TIMEOUT_S)" in str(out[0])
        proxy.configure("pass")
        assert slow.get_range("a/data.bin", 5, 10, etag=etag) == DATA[5:10]


def test_no_retries_is_one_attempt_and_says_so(
    objects: Objects, s3_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PUZZLETRON_OBJECT_RETRIES", "0")
    with TcpFaults(urlsplit(s3_endpoint).port) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        once = Objects(join_url(bucket, "prefix"), options=ObjectOptions(read_timeout_s=1))
        proxy.configure("cut", after=100)
        with pytest.raises(OSError, match=r"could not be read in 1 attempts \((?!NoneType)"):
            once.get_range("a/data.bin", 0, 1000)

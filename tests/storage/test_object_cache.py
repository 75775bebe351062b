"""The node's object cache: bounded (least recently used entries go first), shared by processes that
fork and race on the same entries, whole objects downloaded once a node, temporary files of killed
writers swept."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.storage import object_cache
from puzzletron.dataset.storage.object_cache import ObjectCache, entry_key, parse_size

FORK = multiprocessing.get_context("fork")
KIB = 1024


def _entries(cache: ObjectCache) -> list[str]:
    return sorted(p.name for p in cache.root.glob("*/*/*") if not p.name.startswith("."))


def test_sizes_parse_in_binary_units() -> None:
    assert parse_size("2K") == 2048 and parse_size("3MiB") == 3 << 20 and parse_size("1g") == 1 << 30
    with pytest.raises(ConfigError, match="size='lots': expected bytes"):
        parse_size("lots")


def test_keys_change_with_the_etag_so_a_replaced_object_never_hits_old_bytes() -> None:
    assert entry_key("s3://b/x", '"a"', 10) != entry_key("s3://b/x", '"b"', 10)
    assert entry_key("s3://b/x", '"a"', 10) == entry_key("s3://b/x", '"a"', 10)


def test_the_least_recently_used_entries_go_when_the_bound_is_passed(tmp_path: Path) -> None:
    cache = ObjectCache(tmp_path / "c", max_bytes=10 * KIB)
    for k in range(8):  # 8 KiB: under the bound
        os.close(cache.put_chunk(f"c{k}", bytes([k]) * KIB))
        os.utime(cache.lookup("chunks", f"c{k}", KIB), ns=(k * 10**9, k * 10**9))  # c0 is the oldest
    fresh = ObjectCache(tmp_path / "c", max_bytes=10 * KIB)  # a hit from another process refreshes
    assert fresh.lookup("chunks", "c0", KIB) is not None
    for k in range(8, 11):  # 11 KiB: over; down to 90% = 9 KiB by age
        os.close(cache.put_chunk(f"c{k}", bytes([k]) * KIB))
    assert _entries(cache) == sorted(["c0", *(f"c{k}" for k in range(3, 11))])
    assert cache.usage() == 9 * KIB
    assert (cache.root / "usage").read_text() == str(9 * KIB)


def test_a_lookup_of_a_short_entry_misses(tmp_path: Path) -> None:
    cache = ObjectCache(tmp_path, max_bytes=1 << 20)
    os.close(cache.put_chunk("x", b"abc"))
    assert cache.lookup("chunks", "x", 3) is not None
    assert cache.lookup("chunks", "x", 4) is None  # not what the caller expects: fetched again
    assert cache.open_entry("chunks", "x", 4) is None


def _reader(root: Path, seed: int, out: multiprocessing.Queue) -> None:
    cache, rng, wrong = ObjectCache(root, max_bytes=20 * 4 * KIB), np.random.default_rng(seed), 0
    for k in rng.integers(0, 40, size=300).tolist():
        want = bytes([k]) * (4 * KIB)
        fd = cache.open_entry("chunks", f"k{k}", len(want))
        if fd is None:
            fd = cache.put_chunk(f"k{k}", want)
        try:  # held open: an eviction by another process never takes the bytes being read
            wrong += os.pread(fd, len(want) + 1, 0) != want
        finally:
            os.close(fd)
    out.put(wrong)


def test_processes_sharing_the_cache_never_read_a_wrong_or_partial_entry_and_stay_bounded(
    tmp_path: Path,
) -> None:
    out = FORK.Queue()
    workers = [FORK.Process(target=_reader, args=(tmp_path / "c", seed, out)) for seed in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0] * 6
    assert sum(out.get() for _ in workers) == 0
    cache = ObjectCache(tmp_path / "c", max_bytes=20 * 4 * KIB)
    assert cache.usage() <= cache.max_bytes
    assert not list(cache.root.glob("chunks/*/.tmp-*"))


def _download_once(root: Path, out: multiprocessing.Queue) -> None:
    cache = ObjectCache(root, max_bytes=1 << 20)

    def slow(fh) -> None:
        out.put("downloaded")
        time.sleep(0.3)
        fh.write(b"z" * 1000)

    fd = cache.whole("index", 1000, slow)
    out.put(os.pread(fd, 1001, 0) == b"z" * 1000)
    os.close(fd)


def test_a_whole_object_is_downloaded_by_one_process_of_the_node(tmp_path: Path) -> None:
    out = FORK.Queue()
    workers = [FORK.Process(target=_download_once, args=(tmp_path / "c", out)) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    said = [out.get() for _ in range(5)]
    assert said.count("downloaded") == 1 and said.count(True) == 4


def test_a_download_of_the_wrong_size_is_an_error_and_leaves_nothing(tmp_path: Path) -> None:
    cache = ObjectCache(tmp_path, max_bytes=1 << 20)
    with pytest.raises(OSError, match="downloaded 3 bytes, expected 5"):
        cache.whole("w", 5, lambda fh: fh.write(b"abc"))
    assert _entries(cache) == []


def test_temporary_files_of_killed_writers_are_swept_when_old(tmp_path: Path) -> None:
    cache = ObjectCache(tmp_path, max_bytes=2 * KIB)
    os.close(cache.put_chunk("a", b"a" * KIB))
    folder = cache.lookup("chunks", "a", KIB).parent
    old, new = folder / ".tmp-1-aaaa", folder / ".tmp-2-bbbb"
    old.write_bytes(b"x")
    new.write_bytes(b"y")
    os.utime(old, (0, 0))
    os.close(cache.put_chunk("b", b"b" * 2 * KIB))  # over the bound: a scan
    assert not old.exists() and new.exists()


@pytest.mark.parametrize("counter", ["-1000000000000000000", "-1", "lots", "9" * 40, " 12 "])
def test_a_usage_counter_that_is_not_a_byte_count_is_recomputed_and_never_disables_the_bound(
    tmp_path: Path, counter: str
) -> None:
    cache = ObjectCache(tmp_path, max_bytes=4 * KIB)
    os.close(cache.put_chunk("first", b"f" * KIB))
    for k in range(6):  # 6 KiB more under a 4 KiB bound, the counter forged before every write
        (tmp_path / "usage").write_text(counter)
        os.close(cache.put_chunk(f"c{k}", bytes([k]) * KIB))
    assert cache.usage() <= 4 * KIB
    assert int((tmp_path / "usage").read_text()) == cache.usage()


def test_a_counter_that_lies_low_is_recomputed_within_a_bounded_number_of_writes(tmp_path: Path) -> None:
    cache = ObjectCache(tmp_path, max_bytes=4 * KIB)
    for k in range(object_cache._RESCAN_EVERY):  # 64 B each: 16 KiB, the counter reset to 0 every time
        (tmp_path / "usage").write_text("0")
        os.close(cache.put_chunk(f"c{k}", b"x" * 64))
    assert cache.usage() <= 4 * KIB


_FULL = """
import sys
from puzzletron.dataset.storage.object_cache import ObjectCache
try:
    ObjectCache(sys.argv[1], max_bytes=1 << 30).put_chunk("ab" * 20, b"x" * (1 << 20))
except OSError as exc:
    print(exc)
"""


def test_a_full_disk_names_the_cache_entry_and_the_bound(tmp_path: Path) -> None:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no mount namespace can be made here (unshare -rm)")
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = 'mount -t tmpfs -o size=64k tmpfs "$1" && exec "$2" -c "$3" "$1"'
    done = subprocess.run(["unshare", "-rm", "sh", "-c", mount, "sh", str(disk), sys.executable, _FULL],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = done.stdout.strip()
    assert "No space left on device" in said and f"{disk}/chunks/ab/" in said, said
    assert "PUZZLETRON_OBJECT_CACHE_BYTES, is 1073741824 bytes" in said

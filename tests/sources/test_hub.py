"""`dataset.acquisition._hub` against the olah mirror: revision resolution, listing, whole-file downloads,
local readers; and the mirror quirks the design works around (pinned here so a change in olah shows up)."""

from __future__ import annotations

import random
import tarfile
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from huggingface_hub import HfApi
from huggingface_hub import errors as hf_errors

from puzzletron.dataset.errors import AcquisitionError
from puzzletron.dataset.sources import hub as _hub
from puzzletron.fixtures.hub import NEMOTRON_VLM, PUZZLE_KD, FixtureHub
from puzzletron.fixtures.mirror import free_port


def test_a_commit_sha_is_used_as_given_without_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert _hub.resolve_revision(PUZZLE_KD, sha) == sha


@pytest.mark.parametrize("revision", [None, "main", "latest"])
def test_none_main_latest_resolve_to_the_head_sha(
    hub_endpoint: str, fixture_hub: FixtureHub, revision
) -> None:
    assert _hub.resolve_revision(PUZZLE_KD, revision) == fixture_hub.shas[PUZZLE_KD]


def test_endpoint_and_cache_are_read_at_call_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9/")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert _hub.endpoint() == "http://127.0.0.1:9"
    assert _hub.cache_dir() == tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert _hub.cache_dir() == tmp_path / "elsewhere"


def test_unreachable_endpoint_is_an_acquisition_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(AcquisitionError) as info:
        _hub.resolve_revision(PUZZLE_KD, None)
    assert PUZZLE_KD in str(info.value) and "HF_ENDPOINT" in str(info.value)


def test_list_files_filters_by_glob_at_a_revision(hub_endpoint: str, fixture_hub: FixtureHub) -> None:
    sha = fixture_hub.shas[NEMOTRON_VLM]
    tars = _hub.list_files(NEMOTRON_VLM, sha, "sparsetables/media/*.tar")
    assert tars == [f"sparsetables/media/shard_{i:06d}.tar" for i in range(3)]
    assert _hub.list_files(NEMOTRON_VLM, sha, "chartqa_cot/media/*") == []
    patterns = _hub.split_patterns(PUZZLE_KD, fixture_hub.shas[PUZZLE_KD])
    assert patterns == {"train": ["data/train-*.parquet"], "validation": ["data/validation-*.parquet"]}


def test_download_is_whole_cached_and_reused_offline(
    fresh_hf_home: Path, fixture_hub: FixtureHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = fixture_hub.shas[NEMOTRON_VLM]
    name = "wiki_en/media/shard_000001.tar"
    local = _hub.download(NEMOTRON_VLM, name, sha)
    assert local.read_bytes() == (fixture_hub.repo_dir(NEMOTRON_VLM) / name).read_bytes()
    assert str(local).startswith(str(fresh_hf_home))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # mirror unreachable now
    assert _hub.download(NEMOTRON_VLM, name, sha) == local


def test_missing_file_is_an_acquisition_error(hub_endpoint: str, fixture_hub: FixtureHub) -> None:
    with pytest.raises(AcquisitionError, match=r"downloading nope\.tar of .*Nemotron"):
        _hub.download(NEMOTRON_VLM, "nope.tar", fixture_hub.shas[NEMOTRON_VLM])


def test_parquet_tables_shuffle_with_the_rng_and_cover_every_row_once(fixture_hub: FixtureHub) -> None:
    shard = next((fixture_hub.repo_dir(PUZZLE_KD) / "data").glob("train-00000-*.parquet"))
    plain = [r["uuid"] for t in _hub.iter_parquet_tables(shard) for r in t.to_pylist()]
    assert plain == pq.read_table(shard).column("uuid").to_pylist()
    a = [
        u for t in _hub.iter_parquet_tables(shard, rng=random.Random(1)) for u in t.column("uuid").to_pylist()
    ]
    b = [
        u for t in _hub.iter_parquet_tables(shard, rng=random.Random(1)) for u in t.column("uuid").to_pylist()
    ]
    c = [
        u for t in _hub.iter_parquet_tables(shard, rng=random.Random(2)) for u in t.column("uuid").to_pylist()
    ]
    assert a == b != c and a != plain and sorted(a) == sorted(plain)
    assert pq.ParquetFile(shard).num_row_groups > 1  # the shuffle crosses row groups


def test_tar_members_index_reads_exact_bytes(fixture_hub: FixtureHub) -> None:
    shard = fixture_hub.repo_dir(NEMOTRON_VLM) / "wiki_en" / "media" / "shard_000000.tar"
    index = _hub.tar_members(shard)
    assert "clip_000.mp4" in index
    with tarfile.open(shard) as tar:
        for name, span in index.items():
            assert _hub.read_member(shard, span) == tar.extractfile(name).read()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("name", "data", "read"),
    [
        ("shard_000000.tar", b"not a tar at all" * 40, _hub.tar_members),
        ("train-00000.parquet", b"PAR1 garbage", lambda p: list(_hub.iter_parquet_tables(p))),
    ],
)
def test_a_damaged_downloaded_file_is_an_acquisition_error_naming_it(
    tmp_path: Path, name: str, data: bytes, read
) -> None:
    damaged = tmp_path / name
    damaged.write_bytes(data)
    with pytest.raises(AcquisitionError, match=rf"{name}: the downloaded .* cannot be read.*delete it"):
        read(damaged)


# --------------------------------------------------------------------- olah quirks the code works around


def test_olah_rejects_dataset_info_without_a_revision(hub_endpoint: str) -> None:
    with pytest.raises(hf_errors.HfHubHTTPError):
        HfApi(endpoint=hub_endpoint).dataset_info(PUZZLE_KD)
    assert HfApi(endpoint=hub_endpoint).dataset_info(PUZZLE_KD, revision="main").sha


def test_olah_ignores_http_range_so_we_fetch_whole_files(hub_endpoint: str, fixture_hub: FixtureHub) -> None:
    sha = fixture_hub.shas[NEMOTRON_VLM]
    url = f"{hub_endpoint}/datasets/{NEMOTRON_VLM}/resolve/{sha}/sparsetables/media/shard_000000.tar"
    request = urllib.request.Request(url, headers={"Range": "bytes=0-99"})
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read()
    whole = (fixture_hub.repo_dir(NEMOTRON_VLM) / "sparsetables/media/shard_000000.tar").read_bytes()
    assert response.status == 200 and body == whole  # not 206 with 100 bytes


def test_invalid_repository_id_is_an_acquisition_error(hub_endpoint: str) -> None:
    with pytest.raises(AcquisitionError, match="invalid repository id"):
        _hub.resolve_revision("acme/bad name!", None)


def test_a_connection_the_mirror_dropped_after_an_error_is_retried(
    hub_endpoint: str, fixture_hub: FixtureHub
) -> None:
    """olah answers 500 for an unknown commit and then resets the kept-alive connection: the next API call
    would fail with "connection reset by peer" on a healthy mirror without the retry on fresh connections."""
    with pytest.raises(AcquisitionError, match="HTTP 500"):
        _hub.split_patterns(PUZZLE_KD, "0" * 40)
    assert _hub.resolve_revision(PUZZLE_KD, None) == fixture_hub.shas[PUZZLE_KD]
    with pytest.raises(AcquisitionError, match="HTTP 404"):  # the file listing answers 404
        _hub.list_files(PUZZLE_KD, "0" * 40)
    assert "README.md" in _hub.list_files(PUZZLE_KD, fixture_hub.shas[PUZZLE_KD])

"""A text snapshot at an URL becomes one verified local copy a node (`formats.local_copy`): only the files its
manifest lists are fetched, the copy is checked byte for byte before first use (a tampered object is a
`SnapshotError` naming it, and nothing is published), reused without fetching a data file again, fetched
again when the copy changed since, and keyed by the manifest's content."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.local_copy import COPIES, PINS_SUFFIX, local_text_snapshot, snapshot_folder
from puzzletron.dataset.formats.text_snapshot import verify_text_snapshot
from puzzletron.dataset.storage.objects import Objects
from puzzletron.dataset.storage.settings import object_settings

JUNK = 3 << 20
ARROW = "train/data-00000-of-00001.arrow"


@pytest.fixture
def url(snapshot: Path, bucket: str) -> str:
    """The fixture text snapshot uploaded to ``s3://bkt/snapshots/pk``."""
    url = f"{bucket}/snapshots/pk"
    Objects(url).upload(snapshot)
    return url


def _data_gets(fetched: list[tuple[str, str]]) -> list[str]:
    return [path for _, path in fetched if not path.endswith("/manifest.json")]


def test_the_copy_holds_exactly_the_listed_files_in_a_folder_named_by_the_manifest_sha256(
    url: str, snapshot: Path, fetched: list[tuple[str, str]]
) -> None:
    Objects(url).put_bytes("junk/big.bin", b"\0" * JUNK)  # unlisted: passed over, never fetched
    folder = local_text_snapshot(url)
    key = hashlib.sha256((snapshot / "manifest.json").read_bytes()).hexdigest()
    assert folder == object_settings().cache / COPIES / key
    assert verify_text_snapshot(folder).ok
    listed = {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()}
    assert {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} == listed
    assert not [path for path in _data_gets(fetched) if "junk" in path]
    assert {path.split("/snapshots/pk/", 1)[1] for path in _data_gets(fetched)} == listed - {"manifest.json"}
    assert snapshot_folder(snapshot) == snapshot  # a folder is its own


def test_a_second_call_reuses_the_copy_without_fetching_a_data_file(
    url: str, fetched: list[tuple[str, str]]
) -> None:
    folder = local_text_snapshot(url)
    fetched.clear()
    assert local_text_snapshot(url) == folder == snapshot_folder(url)
    assert _data_gets(fetched) == []  # the manifest alone (its SHA-256 names the copy)


def test_a_tampered_object_is_a_snapshot_error_naming_it_and_nothing_is_published(
    url: str, snapshot: Path, tmp_path: Path
) -> None:
    data = bytearray((snapshot / ARROW).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the SHA-256 tells
    Objects(url).put_bytes(ARROW, bytes(data))
    with pytest.raises(SnapshotError, match=rf"{url}: {ARROW}: SHA-256 differs from the manifest"):
        local_text_snapshot(url, root=tmp_path / "copies")
    assert not (tmp_path / "copies").exists()  # no copy, transaction, lock or folder made for them


def test_a_listed_object_of_another_size_is_refused_unread(
    url: str, fetched: list[tuple[str, str]], tmp_path: Path
) -> None:
    Objects(url).put_bytes(ARROW, b"\0" * JUNK)
    with pytest.raises(SnapshotError, match=rf"{url}/{ARROW} has {JUNK} bytes, the manifest records"):
        local_text_snapshot(url, root=tmp_path)
    assert not [path for path in _data_gets(fetched) if path.endswith(ARROW)]


def test_a_copy_changed_since_it_was_verified_is_fetched_again(url: str, snapshot: Path) -> None:
    folder = local_text_snapshot(url)
    arrow = folder / ARROW
    data = bytearray(arrow.read_bytes())
    data[100] ^= 0xFF
    arrow.write_bytes(bytes(data))  # damaged on the node's disk after verification
    (folder / "train" / "stray.txt").write_text("added")
    assert local_text_snapshot(url) == folder
    assert arrow.read_bytes() == (snapshot / ARROW).read_bytes()
    assert not (folder / "train" / "stray.txt").exists()
    os.unlink(folder.with_name(folder.name + PINS_SUFFIX))  # a killed copy: published, never pinned
    assert local_text_snapshot(url) == folder and verify_text_snapshot(folder).ok


def test_another_manifest_at_the_url_is_another_copy(url: str, snapshot: Path) -> None:
    first = local_text_snapshot(url)
    compact = json.dumps(json.loads((snapshot / "manifest.json").read_bytes())).encode()  # other bytes
    Objects(url).put_bytes("manifest.json", compact)
    second = local_text_snapshot(url)
    assert second != first and second.name == hashlib.sha256(compact).hexdigest()
    assert (second / "manifest.json").read_bytes() == compact and verify_text_snapshot(second).ok


def test_an_url_that_holds_no_text_snapshot_is_refused(bucket: str, snapshot: Path) -> None:
    with pytest.raises(SnapshotError, match=r"s3://bkt/nothing/manifest.json: no snapshot there"):
        local_text_snapshot(f"{bucket}/nothing")
    Objects(f"{bucket}/store").put_bytes("manifest.json", b'{"format": "puzzletron-token-store"}')
    with pytest.raises(SnapshotError, match=r"s3://bkt/store: a puzzletron-token-store, not a text snapshot"):
        local_text_snapshot(f"{bucket}/store")

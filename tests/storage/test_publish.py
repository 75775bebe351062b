"""Publishing a finished folder at an URL (a real S3-compatible server on loopback): the manifest last, and a
publish killed (SIGKILL) or failed part-way resumed by its rerun, which uploads only what is not there as
it was uploaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from puzzletron.dataset.storage.claims import claim_url, staging_url
from puzzletron.dataset.storage.objects import Objects, url_parent
from puzzletron.dataset.storage.publish import publish_folder

DIGEST = "d" * 64
NAMES = [f"media/{k:06d}.shard" for k in range(6)] + ["data/rows.parquet", "index.bin", "notes/a.txt"]


def _folder(root: Path) -> Path:
    """A finished snapshot: nine data files of seeded bytes and its manifest."""
    rng = np.random.default_rng(7)
    for rel in NAMES:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.integers(0, 256, size=int(rng.integers(1, 40_000)), dtype=np.uint8).tobytes())
    (root / "manifest.json").write_text(json.dumps({"acquisition": {"seed": 1}, "files": NAMES}))
    return root


class _Uploads:
    """Counts the files a publish uploads (the real uploads still happen)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, fail_at: int | None = None) -> None:
        self.names: list[str] = []
        real = Objects.put_file

        def put_file(objects: Objects, rel: str, local: str | os.PathLike[str]) -> None:
            if fail_at is not None and len(self.names) + 1 == fail_at:
                raise OSError(f"{objects.url_of(rel)}: the connection dropped (injected)")
            real(objects, rel, local)
            self.names.append(rel)

        monkeypatch.setattr(Objects, "put_file", put_file)


def _publish(folder: Path, url: str) -> bool:
    return publish_folder(folder, url, digest=DIGEST, what="text snapshot")


def _fail_at(monkeypatch: pytest.MonkeyPatch, folder: Path, url: str, k: int) -> None:
    """Publish `folder` at `url` with the `k`-th upload failing (the connection drops)."""
    with monkeypatch.context() as patch:
        _Uploads(patch, fail_at=k)
        with pytest.raises(OSError, match="injected"):
            _publish(folder, url)
    assert "manifest.json" not in Objects(url).list()


def _published_as(folder: Path, url: str) -> None:
    """Every file of `folder` is at `url` with its bytes; no journal, no claim left."""
    objects = Objects(url)
    assert sorted(objects.list()) == sorted([*NAMES, "manifest.json"])
    for rel in [*NAMES, "manifest.json"]:
        assert objects.get(rel) == (folder / rel).read_bytes(), rel
    assert Objects(staging_url(url, DIGEST)).list() == {}
    assert claim_url(url).rsplit("/", 1)[1] not in Objects(url_parent(url)).list()


_KILLED = """
import os, signal, sys
from puzzletron.dataset.storage import upload_journal
from puzzletron.dataset.storage.objects import Objects
from puzzletron.dataset.storage.publish import publish_folder

upload_journal.PART_FILES = 2  # a part every two files
real, done = Objects.put_file, []

def put_file(objects, rel, local):
    real(objects, rel, local)
    done.append(rel)
    if len(done) == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)  # uploaded, not journaled

Objects.put_file = put_file
publish_folder(sys.argv[1], sys.argv[2], digest="d" * 64, what="text snapshot")
"""


def test_a_killed_publish_is_resumed_uploading_only_what_its_journal_does_not_hold(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, url = _folder(tmp_path / "snap"), f"{bucket}/snapshots/s"
    child = subprocess.run([sys.executable, "-c", _KILLED, str(folder), url, "5"], capture_output=True)
    assert child.returncode == -9, child.stderr.decode()[-2000:]
    order = sorted(NAMES)
    assert "manifest.json" not in Objects(url).list() and len(Objects(url).list()) == 5
    uploads = _Uploads(monkeypatch)
    assert _publish(folder, url) is True
    assert uploads.names == order[4:]  # the two parts held four; the fifth went up unjournaled
    _published_as(folder, url)


def test_a_failed_publish_journals_what_went_up_and_its_rerun_uploads_the_rest(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, url = _folder(tmp_path / "snap"), f"{bucket}/snapshots/s"
    _fail_at(monkeypatch, folder, url, 4)
    uploads = _Uploads(monkeypatch)
    assert _publish(folder, url) is True
    assert uploads.names == sorted(NAMES)[3:]
    _published_as(folder, url)


def test_an_object_overwritten_or_a_local_file_changed_since_its_upload_is_uploaded_again(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, url = _folder(tmp_path / "snap"), f"{bucket}/snapshots/s"
    order = sorted(NAMES)
    _fail_at(monkeypatch, folder, url, len(NAMES))  # every file but the last went up
    Objects(url).put_bytes(order[0], b"other bytes of the same name")  # another ETag
    (folder / order[1]).write_bytes((folder / order[1]).read_bytes()[::-1])  # same size, other bytes
    uploads = _Uploads(monkeypatch)
    assert _publish(folder, url) is True
    assert uploads.names == [order[0], order[1], order[-1]]
    _published_as(folder, url)


def test_a_journal_part_that_is_not_one_saves_no_upload(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, url = _folder(tmp_path / "snap"), f"{bucket}/snapshots/s"
    _fail_at(monkeypatch, folder, url, len(NAMES))
    staging = Objects(staging_url(url, DIGEST))
    (part,) = staging.list()
    real = json.loads(staging.get(part))
    forged = {rel: {**entry, "etag": '"0"'} for rel, entry in real["files"].items()}  # no object has it
    staging.put_bytes(part, json.dumps({**real, "files": forged}).encode())
    staging.put_bytes("uploads/x-000000.json", b"{not json")
    staging.put_bytes("uploads/z-000000.json", json.dumps({**real, "pad": "x" * (1 << 20)}).encode())
    staging.put_bytes(
        "uploads/y-000000.json", json.dumps({"format": "other", "files": real["files"]}).encode()
    )
    uploads = _Uploads(monkeypatch)
    assert _publish(folder, url) is True
    assert uploads.names == sorted(NAMES)
    _published_as(folder, url)

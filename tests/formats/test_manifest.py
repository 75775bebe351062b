"""Every JSON file a format reads goes through one bounded reader: only a regular file (a FIFO is refused
without waiting for a writer, a device is never read), at most a bound of bytes, nested at most 64 levels;
each refusal is one `SnapshotError` naming the file."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats import manifest
from puzzletron.dataset.formats.manifest import load_json
from puzzletron.dataset.formats.token_store import TokenStore
from puzzletron.dataset.storage.local import LocalFiles


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "manifest.json")
    out: list = []

    def read() -> None:
        try:
            load_json(tmp_path / "manifest.json", "the manifest")
        except SnapshotError as exc:
            out.append(str(exc))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(60)  # a guard against the hang only
    if thread.is_alive():  # an old version waits: a writer lets its thread end
        os.close(os.open(tmp_path / "manifest.json", os.O_WRONLY | os.O_NONBLOCK))
    assert out == [f"{tmp_path}/manifest.json: the manifest is a FIFO, not a regular file"]


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda p: p.mkdir(), "is a folder, not a regular file"),
        (lambda p: p.symlink_to("/dev/zero"), "is a character device, not a regular file"),
        (lambda p: p.write_text("[" * 70 + "]" * 70), "nests JSON more than 64 levels deep"),
        (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "nests JSON more than 64 levels deep"),
        (lambda p: p.write_bytes(b"{\xff}"), "is not valid UTF-8"),
    ],
)
def test_what_is_not_a_bounded_json_file_is_one_error_naming_it(tmp_path: Path, make, said: str) -> None:
    make(tmp_path / "x.json")
    with pytest.raises(SnapshotError, match=f"x.json: .*{said}"):
        load_json(tmp_path / "x.json", "the record")


def test_a_file_over_the_bound_is_refused_before_it_is_read(tmp_path: Path) -> None:
    with open(tmp_path / "x.json", "wb") as fh:
        fh.truncate((64 << 20) + 1)  # sparse
    with pytest.raises(SnapshotError, match=r"x.json: the manifest is 64.0 MiB \(67108865 bytes\); at most"):
        load_json(tmp_path / "x.json", "the manifest", max_bytes=64 << 20)
    with pytest.raises(SnapshotError, match=r"x.json: the manifest is 64.0 MiB .* at most 1.0 KiB"):
        manifest.read_bounded(LocalFiles(tmp_path), "x.json", "the manifest", max_bytes=1024)


def test_a_token_store_with_a_huge_manifest_is_refused_unread(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    with open(tmp_path / "store" / "manifest.json", "wb") as fh:
        fh.truncate(1 << 30)  # sparse: 1 GiB of zeros no disk holds
    with pytest.raises(SnapshotError, match=r"manifest.json: the manifest is 1.0 GiB .*at most 64.0 MiB"):
        TokenStore(tmp_path / "store")

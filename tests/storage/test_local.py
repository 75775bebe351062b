"""`LocalFiles`, the local `ByteSource`: positional reads into a buffer, files pinned when a reader opens
them (a file replaced afterwards is an error naming it), pickling without open descriptors."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.storage import ByteSource, LocalFiles, open_source


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "b.bin").write_bytes(b"hello")
    return tmp_path


def test_reads_go_straight_into_the_buffer_and_a_short_file_is_an_error_naming_it(root: Path) -> None:
    files = open_source(root)
    assert isinstance(files, ByteSource) and isinstance(files, LocalFiles)
    out = np.empty(10, np.uint8)
    files.read_into("sub/a.bin", 250, out)
    assert out.tolist() == [*range(250, 256), 0, 1, 2, 3]
    assert files.read_bytes("b.bin") == b"hello" and files.size("sub/a.bin") == 1024
    with pytest.raises(SnapshotError, match=r"b\.bin: ends at byte 5; 5 more expected"):
        files.read_into("b.bin", 0, np.empty(10, np.uint8))
    mapped = files.map("sub/a.bin", "<u4", 256)
    assert not mapped.flags.writeable and int(mapped[0]) == 0x03020100


def test_a_pinned_file_replaced_before_it_is_opened_is_refused(root: Path) -> None:
    files = LocalFiles(root)
    files.pin("sub/a.bin")
    files.pin("b.bin")
    files.read_bytes("b.bin")  # opened: keeps serving what was pinned
    os.replace(root / "b.bin", root / "old.bin")
    (root / "b.bin").write_bytes(b"HELLO")
    assert files.read_bytes("b.bin") == b"hello"
    (root / "sub" / "a.bin").unlink()
    (root / "sub" / "a.bin").write_bytes(bytes(1024))  # same size, another file
    with pytest.raises(SnapshotError, match=r"sub/a\.bin: the file was replaced or changed since"):
        files.read_bytes("sub/a.bin")
    with pytest.raises(SnapshotError, match="cannot be read"):
        files.pin("missing.bin")


def test_a_pickled_source_keeps_its_pins_not_its_descriptors(root: Path) -> None:
    files = LocalFiles(root)
    files.pin("b.bin")
    files.read_bytes("b.bin")
    clone = pickle.loads(pickle.dumps(files))
    assert clone.read_bytes("b.bin") == b"hello"
    (root / "b.bin").unlink()
    (root / "b.bin").write_bytes(b"world")
    with pytest.raises(SnapshotError, match="replaced or changed"):
        pickle.loads(pickle.dumps(files)).read_bytes("b.bin")

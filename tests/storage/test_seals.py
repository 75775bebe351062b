"""A sealed folder is recognised as exactly what was written, and any change since (a byte, a size, a file
added or removed, a seal that is not one) is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from puzzletron.dataset.storage.seals import SEAL, seal_problem, write_seal


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "tokens").write_bytes(bytes(range(256)) * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "index").write_bytes(b"abc")
    write_seal(tmp_path)
    return tmp_path


def test_an_untouched_folder_is_sealed(folder: Path) -> None:
    assert seal_problem(folder) is None


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda f: (f / "tokens").write_bytes(bytes(range(255, -1, -1)) * 100), "changed since"),
        (lambda f: (f / "sub" / "index").write_bytes(b"abcd"), "4 bytes, sealed with 3"),
        (lambda f: (f / "extra").write_bytes(b""), "sealed with"),
        (lambda f: (f / "tokens").unlink(), "sealed with"),
        (lambda f: (f / SEAL).write_text("[" * 100_000), "no seal.json"),
        (lambda f: (f / SEAL).unlink(), "no seal.json"),
    ],
)
def test_any_change_since_the_seal_is_named(folder: Path, change, said: str) -> None:
    change(folder)
    assert said in (seal_problem(folder) or "")

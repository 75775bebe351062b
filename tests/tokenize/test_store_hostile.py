"""Token store builds against damaged inputs and careless runs (``docs/trust-model.md``): a snapshot edited
after it was written builds nothing under its clean identity."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from _token_store_data import ROWS_PER_SHARD
from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.tokenize import build_token_store
from puzzletron.fixtures.tampering import edit_arrow_in_place

OPTIONS = TokenizeOptions(rows_per_shard=ROWS_PER_SHARD)


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def test_an_arrow_file_edited_in_place_builds_nothing_and_does_not_poison_the_cache(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(snapshot, damaged)
    arrow = next((damaged / "train").glob("data-*.arrow"))
    old, new = edit_arrow_in_place(arrow)
    clean_arrow = next((snapshot / "train").glob("data-*.arrow"))
    assert old != new and arrow.stat().st_size == clean_arrow.stat().st_size
    cache = tmp_path / "cache"
    with pytest.raises(SnapshotError) as exc:
        build_token_store(damaged, tokenizer=tokenizer_dir, cache_dir=cache, options=OPTIONS)
    assert f"train/{arrow.name} differs from the SHA-256 its manifest records" in _one_line(exc)
    assert not cache.exists() or not any(cache.iterdir())  # nothing published, no build directory left
    clean = build_token_store(snapshot, tokenizer=tokenizer_dir, cache_dir=cache, options=OPTIONS)
    assert sorted(p.name for p in cache.iterdir()) == [clean.name]

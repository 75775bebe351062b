"""The fixtures the token-store tests share (under tokenize/, formats/token_store/, pipelines/ and cli/): a
plugin module, registered by ``pytest_plugins`` in the root ``conftest.py`` (never import it yourself)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _token_store_data import make_snapshot
from puzzletron.fixtures.hub import FixtureHub
from puzzletron.fixtures.tokenizer import build_chat_tokenizer

__all__ = ["snapshot", "tokenizer_dir"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture chat tokenizer, saved."""
    return build_chat_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def snapshot(fixture_hub: FixtureHub, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make_snapshot` in a module-temporary directory."""
    return make_snapshot(fixture_hub, tmp_path_factory.mktemp("snap") / "puzzle-kd")

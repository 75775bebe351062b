"""Fixtures of the acquisition tests: an empty Hub cache per test, to count what a run downloads."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def fresh_hf_home(hub_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hub cache for one test (to count what it downloads)."""
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    return home

"""Fixtures of the AutoModel collator tests: one working directory per module."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("automodel")

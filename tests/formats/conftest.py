"""Fixtures the format tests at URLs share: ``fetched``, every object s3fs reads whole or downloads."""

from __future__ import annotations

import pytest


@pytest.fixture
def fetched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every object read whole or downloaded through s3fs, as ``(call, path)``."""
    import s3fs

    calls: list[tuple[str, str]] = []
    for name in ("_get_file", "_cat_file"):
        real = getattr(s3fs.S3FileSystem, name)

        async def counted(self, path, *args, _real=real, _name=name, **kwargs):
            calls.append((_name, str(path)))
            return await _real(self, path, *args, **kwargs)

        monkeypatch.setattr(s3fs.S3FileSystem, name, counted)
    return calls

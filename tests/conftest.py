"""Fixtures shared by several test folders: the generated fixture Hub and a running olah mirror of it on
loopback, and (from the plugin module ``_token_store_fixtures``) the chat tokenizer and text snapshot the
tokenize, token-store, pipeline and CLI tests build on.

``fixture_hub`` generates the four fixture repositories once per session (about a second);
``hub_endpoint`` serves them with olah and points ``HF_ENDPOINT`` at it, with a session-temporary
``HF_HOME`` so no Hub cache leaks between runs (the library reads both at call time). ``s3_endpoint``
serves an S3-compatible store (moto's server, a process on loopback) for the session, with the client's
environment (``AWS_ENDPOINT_URL``, test credentials) pointing at it; ``bucket`` empties it and gives each
test ``s3://bkt`` and a fresh object cache. Fixtures one folder
alone uses live in that folder's ``conftest.py``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from puzzletron.fixtures.hub import FixtureHub, generate_fixture_hub
from puzzletron.fixtures.mirror import serve_hub
from puzzletron.fixtures.object_store import client_environment, create_bucket, reset, serve_object_store

pytest_plugins = ["_token_store_fixtures", "_vlm_fixtures"]  # `tokenizer_dir`, `snapshot`; VLM subset, stores

_HUB_ENV = ("HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_TOKEN", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


class _SessionEnv:
    """Set and restore environment variables for a whole session (monkeypatch is function-scoped)."""

    def __init__(self) -> None:
        self._saved: dict[str, str | None] = {}

    def set(self, name: str, value: str | None) -> None:
        self._saved.setdefault(name, os.environ.get(name))
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

    def restore(self) -> None:
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def _signal_handlers() -> Iterator[None]:
    """Each test leaves the process's signal handlers as it found them. NeMo AutoModel's recipes install a
    SIGTERM handler that only records the signal; a worker forked after such a test ignores
    `Pool.terminate` and the run hangs in whichever later test forks."""
    saved = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if signal.getsignal(sig) is not handler and handler is not None:
                signal.signal(sig, handler)


@pytest.fixture(autouse=True, scope="session")
def _per_user_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The per-user store cache (`default_cache_dir`, where a call without ``cache_dir`` builds) in a
    session-temporary folder: no test writes into the home directory."""
    env = _SessionEnv()
    env.set("PUZZLETRON_CACHE_DIR", str(tmp_path_factory.mktemp("per-user-cache")))
    try:
        yield
    finally:
        env.restore()


@pytest.fixture(scope="session")
def fixture_hub(tmp_path_factory: pytest.TempPathFactory) -> FixtureHub:
    """The generated fixture repositories (``.root``, ``.mirrors``, ``.shas[repo_id]``, ``.repo_dir()``).

    Session-wide and shared: tests must not commit to these repositories (use a private hub for that).
    """
    return generate_fixture_hub(tmp_path_factory.mktemp("fixture-hub"))


@pytest.fixture(scope="session")
def hub_endpoint(fixture_hub: FixtureHub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A running olah mirror of `fixture_hub`; ``HF_ENDPOINT`` points at it, ``HF_HOME`` is temporary."""
    env = _SessionEnv()
    with serve_hub(fixture_hub.root) as endpoint:
        for name in _HUB_ENV:
            env.set(name, None)
        env.set("HF_ENDPOINT", endpoint)
        env.set("HF_HOME", str(tmp_path_factory.mktemp("hf-home")))
        try:
            yield endpoint
        finally:
            env.restore()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A running S3-compatible server on loopback; the backend's environment points at it."""
    env = _SessionEnv()
    with serve_object_store() as endpoint:
        for name, value in client_environment(endpoint).items():
            env.set(name, value)
        try:
            yield endpoint
        finally:
            env.restore()


@pytest.fixture
def bucket(
    s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> str:
    """``s3://bkt`` on an emptied server, and an empty object cache (``PUZZLETRON_OBJECT_CACHE``)."""
    reset(s3_endpoint)
    create_bucket(s3_endpoint, "bkt")
    monkeypatch.setenv("PUZZLETRON_OBJECT_CACHE", str(tmp_path_factory.mktemp("object-cache")))
    return "s3://bkt"

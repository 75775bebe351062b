"""The credential policy (docs/trust-model.md, "Credentials"): the user's Hub token goes only to the official
Hub, or to the one endpoint ``PUZZLETRON_HUB_TOKEN_ENDPOINT`` names; a mirror or proxy gets none, whether the
token comes from ``HF_TOKEN`` or from the token file ``hf auth login`` stores in ``HF_HOME``; manifests never
record one. Proved with `FaultProxy`, which records every request's Authorization header."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from puzzletron.dataset.sources import TextAcquisitionSpec, materialize_puzzle_kd_dataset
from puzzletron.dataset.sources import hub as _hub
from puzzletron.fixtures.faults import FaultProxy

SECRET = "hf_puzzletron_test_secret_do_not_send"
STORED = "hf_puzzletron_stored_login_do_not_send"


def _materialise(out: Path) -> None:
    materialize_puzzle_kd_dataset(TextAcquisitionSpec(output_dir=out, train_samples=8, validation_samples=4))


def _no_secret_in(tree: Path, *secrets: str) -> None:
    for path in tree.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(s.encode() in data for s in secrets), path


def test_hf_token_is_not_sent_to_a_mirror_unless_the_endpoint_is_named(
    hub_endpoint: str, fresh_hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    with FaultProxy(hub_endpoint) as proxy:
        monkeypatch.setenv("HF_ENDPOINT", proxy.endpoint)
        _materialise(tmp_path / "anonymous")
        sent = list(proxy.authorizations)
        assert len(sent) >= 5 and sent == [None] * len(sent), sent  # every request, none with a token
        monkeypatch.setenv(_hub.TOKEN_ENDPOINT_ENV, proxy.endpoint + "/")  # the user names this endpoint
        _materialise(tmp_path / "named")
        named = proxy.authorizations[len(sent) :]
    assert named and named == [f"Bearer {SECRET}"] * len(named)
    _no_secret_in(tmp_path, SECRET)  # neither snapshot records it


_CHILD = "import sys; from puzzletron.cli import main; sys.exit(main(sys.argv[1:]))"


def test_a_stored_login_token_is_not_sent_to_a_mirror_unless_the_endpoint_is_named(
    hub_endpoint: str, tmp_path: Path
) -> None:
    home = tmp_path / "hf-home"
    home.mkdir()
    (home / "token").write_text(STORED)  # what `hf auth login` writes (huggingface_hub reads it at import)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PUZZLETRON_"))}
    with FaultProxy(hub_endpoint) as proxy:
        env |= {"HF_HOME": str(home), "HF_ENDPOINT": proxy.endpoint}
        argv = ["materialize", "puzzle-kd", "--train-samples", "8", "--validation-samples", "4", "--quiet"]
        for name, extra in (("anonymous", {}), ("named", {_hub.TOKEN_ENDPOINT_ENV: proxy.endpoint})):
            before = len(proxy.requests)
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, *argv, "--output", str(tmp_path / name)],
                env=env | extra,
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert done.returncode == 0, done.stderr
            # huggingface_hub's own telemetry request (no token) may go to an endpoint the user trusts
            sent = [
                auth
                for (_, path), auth in zip(
                    proxy.requests[before:], proxy.authorizations[before:], strict=True
                )
                if name == "anonymous" or not path.startswith("/api/agent-harnesses")
            ]
            want = None if name == "anonymous" else f"Bearer {STORED}"
            assert sent and sent == [want] * len(sent), (name, sent)
    _no_secret_in(tmp_path / "anonymous", STORED)
    _no_secret_in(tmp_path / "named", STORED)


@pytest.mark.parametrize(
    ("endpoint", "named", "sends"),
    [
        ("https://huggingface.co", "", None),
        ("https://HUGGINGFACE.co:443/", "", None),
        ("http://127.0.0.1:9999", "", False),
        ("https://mirror.example.org", "", False),
        ("https://mirror.example.org", "https://mirror.example.org/", None),
        ("https://mirror.example.org", "https://other.example.org", False),
        ("https://huggingface.co.evil.example", "", False),
    ],
)
def test_the_token_policy_by_endpoint(
    endpoint: str, named: str, sends: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """None: huggingface_hub sends the user's token (HF_TOKEN, else the stored login); False: none."""
    monkeypatch.setenv(_hub.TOKEN_ENDPOINT_ENV, named)
    assert _hub.token_for_endpoint(endpoint) is sends

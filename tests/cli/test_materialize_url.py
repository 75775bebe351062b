"""`puzzletron-data materialize ... --output s3://...`: built in scratch, published with the manifest last,
read back, reused without the Hub, refused for another spec, and republished after a failed publish (with
no file uploaded twice)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from puzzletron.cli import main
from puzzletron.dataset.storage.objects import Objects
from puzzletron.fixtures.hub import INTERSYN_MULTI, INTERSYN_SINGLE, FixtureHub

_KD = ["--train-samples", "8", "--validation-samples", "2", "--quiet"]


def _lines(capsys: pytest.CaptureFixture[str]) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_puzzle_kd_at_an_url_verifies_and_tokenizes_to_the_store_of_a_folder(
    hub_endpoint: str, bucket: str, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{bucket}/snapshots/pk"
    assert main(["materialize", "puzzle-kd", "--output", url, *_KD]) == 0
    (line,) = _lines(capsys)
    assert (line["status"], line["path"], line["manifest"]) == ("done", url, f"{url}/manifest.json")
    assert (line["format"], line["row_count"]) == ("puzzletron-text-snapshot", 10)
    assert not any(rel.endswith(".claim.json") for rel in Objects(bucket).list())  # released
    assert main(["verify", url, "--json"]) == 0
    assert _lines(capsys)[0]["status"] == "ok"
    local = tmp_path / "pk"
    assert main(["materialize", "puzzle-kd", "--output", str(local), *_KD]) == 0
    capsys.readouterr()
    assert Objects(url).get("manifest.json") == (local / "manifest.json").read_bytes()
    identities = []
    for snapshot, out in ((url, tmp_path / "from-url"), (str(local), tmp_path / "from-folder")):
        argv = ["tokenize", snapshot, "--tokenizer", str(tokenizer_dir), "--output", str(out), "--json"]
        assert main([*argv, "--split", "validation", "--quiet"]) == 0
        identities.append(_lines(capsys)[0]["identity_sha256"])
    assert identities[0] == identities[1]


def test_another_spec_into_a_published_url_is_refused_naming_both(
    hub_endpoint: str, bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{bucket}/snapshots/pk"
    assert main(["materialize", "puzzle-kd", "--output", url, *_KD]) == 0
    before = Objects(url).list()
    capsys.readouterr()
    assert main(["materialize", "puzzle-kd", "--output", url, "--train-samples", "6", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert url in captured.err and "does not match requested acquisition" in captured.err
    assert "--train-samples: existing 8 vs requested 6" in captured.err
    assert Objects(url).list() == before


def test_a_publish_of_another_snapshot_is_refused_naming_both_acquisitions(
    hub_endpoint: str, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The publisher's own check (a manifest written at the URL after the command looked): both named."""
    from puzzletron.dataset.errors import SnapshotError
    from puzzletron.dataset.storage.publish import publish_folder

    url = f"{bucket}/snapshots/pk"
    for name, rows in (("a", "8"), ("b", "6")):
        argv = ["materialize", "puzzle-kd", "--output", str(tmp_path / name), "--train-samples", rows]
        assert main([*argv, "--validation-samples", "2", "--quiet"]) == 0
    assert publish_folder(tmp_path / "a", url, digest="a" * 64, what="text snapshot") is True
    assert publish_folder(tmp_path / "a", url, digest="a" * 64, what="text snapshot") is False  # reused
    with pytest.raises(SnapshotError, match="another text snapshot is published here") as info:
        publish_folder(tmp_path / "b", url, digest="b" * 64, what="text snapshot")
    assert '"train_samples": 8' in str(info.value) and '"train_samples": 6' in str(info.value)


def test_a_publish_that_fails_before_the_manifest_leaves_none_and_the_rerun_publishes(
    hub_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{bucket}/snapshots/pk"
    real = Objects.create_once

    def no_manifest(self: Objects, rel: str, data: bytes) -> bool:
        if rel == "manifest.json":
            raise OSError(f"{self.url_of(rel)}: the connection dropped (injected)")
        return real(self, rel, data)

    monkeypatch.setattr(Objects, "create_once", no_manifest)
    assert main(["materialize", "puzzle-kd", "--output", url, *_KD]) == 1
    assert "injected" in capsys.readouterr().err
    listing = Objects(url).list()
    assert listing and "manifest.json" not in listing  # the data went up, the publication did not
    assert not any(rel.endswith(".claim.json") for rel in Objects(bucket).list())  # a clean failure
    monkeypatch.setattr(Objects, "create_once", real)
    uploaded, put_file = [], Objects.put_file
    monkeypatch.setattr(
        Objects, "put_file", lambda o, rel, local: (uploaded.append(rel), put_file(o, rel, local))
    )
    assert main(["materialize", "puzzle-kd", "--output", url, *_KD]) == 0
    assert _lines(capsys)[0]["status"] == "done"
    assert uploaded == []  # built again to the same bytes: every file is there as the journal recorded it
    assert main(["verify", url, "--json"]) == 0


def test_a_media_shards_subset_at_an_url_verifies_reads_and_reruns_without_the_hub(
    hub_endpoint: str, fixture_hub: FixtureHub, bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nemotron-VLM in media shards and InterSyn at URLs; each rerun in a fresh process whose Hub refuses
    every connection and whose outbound traffic is trapped: reused, no request."""
    from puzzletron.dataset.formats.subset import SubsetReader
    from puzzletron.fixtures.faults import OutboundTrap
    from puzzletron.fixtures.mirror import free_port
    from puzzletron.fixtures.tcp_faults import TcpFaults

    vlm, inter = f"{bucket}/subsets/vlm", f"{bucket}/subsets/inter"
    shas = fixture_hub.shas
    pinned = ["--single-turn-revision", shas[INTERSYN_SINGLE], "--multi-turn-revision", shas[INTERSYN_MULTI]]
    runs = [
        [
            "materialize",
            "nemotron-vlm",
            "--output",
            vlm,
            "--num-samples",
            "4",
            "--media",
            "shards",
            "--quiet",
        ],
        ["materialize", "intersyn", "--output", inter, "--rows-per-source", "2", *pinned, "--quiet"],
        ["materialize", "puzzle-kd", "--output", f"{bucket}/snapshots/pk", *_KD],
    ]
    for argv in runs:
        assert main(argv) == 0
    lines = _lines(capsys)
    assert [line["status"] for line in lines] == ["done"] * 3
    assert (lines[0]["media"], lines[0]["sample_count"], lines[0]["path"]) == ("shards", 4, vlm)
    assert any(rel.startswith("media/") for rel in Objects(vlm).list())
    for url in (vlm, inter):
        assert main(["verify", url, "--json"]) == 0
        assert _lines(capsys)[0]["status"] == "ok"
    assert len(SubsetReader(vlm)) == 4
    with TcpFaults(free_port()) as stopped, OutboundTrap() as trap:
        env = {**os.environ, **trap.environment(), "HF_ENDPOINT": stopped.endpoint}
        child = subprocess.run(
            [sys.executable, "-c", _RERUN, json.dumps(runs)], env=env, capture_output=True, text=True
        )
    assert child.returncode == 0, child.stderr[-3000:]
    lines = [json.loads(line) for line in child.stdout.splitlines()]
    assert [r["code"] for r in lines if "argv" in r] == [0] * 3, child.stderr[-3000:]
    assert [line["status"] for line in lines if "status" in line] == ["reused"] * 3
    assert lines[0]["media"] == "shards"
    assert (stopped.connections, trap.requests) == (0, [])


_RERUN = """
import json, sys
from puzzletron.cli import main
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    print(json.dumps({"argv": argv, "code": code}), flush=True)
"""

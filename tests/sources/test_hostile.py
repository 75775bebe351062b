"""Hostile Hub repositories and broken machines (docs/trust-model.md): no local file leaks, no silent drift,
no tracebacks. The repositories are `puzzletron.fixtures.hostile`'s, served by the session's olah mirror;
mounts are made in a user namespace (`unshare`) where the machine allows it, skipped with the reason
otherwise."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from _conversation_samples import png_bytes, single_samples
from puzzletron.cli import main
from puzzletron.dataset import (
    TextAcquisitionSpec,
    VlmAcquisitionSpec,
    formats,
    materialize_intersyn_subset,
    materialize_nemotron_vlm_dataset,
    materialize_puzzle_kd_dataset,
)
from puzzletron.dataset.conversation.images import HUB_REFERENCE_REASON, encode_image
from puzzletron.dataset.errors import AcquisitionError, ConversationError, ImageError
from puzzletron.dataset.formats.subset import materialize_normalized_conversation_samples, verify_subset
from puzzletron.dataset.formats.text_snapshot import load_text_split
from puzzletron.dataset.sources import hub as _hub
from puzzletron.dataset.tokenize import tokenize_conversations
from puzzletron.fixtures.faults import FaultProxy
from puzzletron.fixtures.hostile import (
    BAIT_IMAGE,
    HOSTILE_INTERSYN,
    HOSTILE_NEMOTRON,
    HOSTILE_PUZZLE_KD,
    INTERSYN_LOCAL_ROWS,
    NEMOTRON_LOCAL_ROWS,
    HostileHub,
    apng_bytes,
    generate_hostile_hub,
)
from puzzletron.fixtures.hub import INTERSYN_MULTI, NEMOTRON_VLM, PUZZLE_KD, FixtureHub

_OPENED: list[tuple[str, bool]] | None = None  # while a list: (absolute path, for writing) of every open
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND


def _audit(event: str, args: tuple) -> None:
    if _OPENED is None or event != "open" or not args or not isinstance(args[0], str | bytes | os.PathLike):
        return
    mode, flags = [*args[1:3], None, None][:2]
    writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)
    _OPENED.append((os.path.abspath(os.fsdecode(args[0])), writing))


sys.addaudithook(_audit)  # audit hooks cannot be removed: this one records only inside `_opened()`


@contextmanager
def _opened() -> Iterator[list[tuple[str, bool]]]:
    """``(absolute path, for writing)`` of every file opened inside the block, in order."""
    global _OPENED
    _OPENED = paths = []
    try:
        yield paths
    finally:
        _OPENED = None


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def hostile(
    fixture_hub: FixtureHub, hub_endpoint: str, tmp_path_factory: pytest.TempPathFactory
) -> HostileHub:
    """The hostile repositories, beside the normal ones in the session mirror, and their bait."""
    return generate_hostile_hub(fixture_hub.root, bait_dir=tmp_path_factory.mktemp("bait"))


def _reasons(manifest: dict) -> dict:
    return {r["row_id"]: r["reason"] for r in manifest["diagnostics"]["rejected_rows"]}


def _nothing_outside(
    hostile: HostileHub, opened: list[tuple[str, bool]], output: Path, *, also: tuple[str, ...] = ()
) -> None:
    """Nothing under the bait folder was opened, and nothing was written outside the output's folder and
    the Hub cache (and `also`)."""
    assert not [p for p, _ in opened if p.startswith(str(hostile.bait))], opened
    assert sorted(p.name for p in hostile.bait.iterdir()) == ["leak.png", "notes.txt"]
    allowed = (str(output.parent), os.path.abspath(os.environ["HF_HOME"]), *also)
    assert not [p for p, writing in opened if writing and not p.startswith(allowed)], opened


# ------------------------------------------------------------------------------- Hub data naming local files


def test_nemotron_rows_naming_local_files_are_rejected_with_one_reason_and_nothing_local_is_read(
    hostile: HostileHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(hostile.bait)  # the relative reference "leak.png" would resolve to the bait here
    tools = tmp_path / "bin"  # a Ghostscript that leaves a mark: Pillow runs `gs` to load EPS bytes
    tools.mkdir()
    (tools / "gs").write_text(f"#!/bin/sh\ntouch {tmp_path / 'gs-ran'}\nexit 1\n")
    (tools / "gs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    spec = VlmAcquisitionSpec(
        output_dir=tmp_path / "vlm",
        subsets=("leaky", "leaky_external", "plain"),
        subset_rows=(("leaky", 4), ("leaky_external", 1), ("plain", 1)),
        num_samples=7,  # more than `leaky` has good rows: every one of its rows is read
        source=HOSTILE_NEMOTRON,
        revision=hostile.shas[HOSTILE_NEMOTRON],
    )
    start = time.monotonic()
    with _opened() as opened:
        manifest = materialize_nemotron_vlm_dataset(spec)
    assert time.monotonic() - start < 20  # the APNG bomb is refused from its header, not decoded
    assert manifest["sample_count"] == 7 and manifest["diagnostics"]["materialized_rows"]["leaky"] == 4
    reasons = _reasons(manifest)
    for row_id in NEMOTRON_LOCAL_ROWS:  # whether the file exists, is an image or not: the same reason
        assert reasons[row_id].endswith(f"image 0: {HUB_REFERENCE_REASON}") or reasons[row_id] == (
            HUB_REFERENCE_REASON
        ), (row_id, reasons[row_id])
    assert "1000 frames of 8000x8000" in reasons["apng-bomb"]
    assert "not an image in a decoded format (PNG, JPEG" in reasons["eps-postscript"]
    assert any("holds '\\ud800', a lone surrogate escape, which is not text" in r for r in reasons.values())
    assert reasons["huge-reply"] == (
        "turn 1 has 2097153 bytes of text; the bound is 2097152 (max_turn_bytes)"
    ), reasons["huge-reply"]
    assert "b'%!PS-Ado'" in reasons["eps-postscript"] and not (tmp_path / "gs-ran").exists()
    assert "field 'messages'" in reasons["messages-a-number"]
    by_reason = {reason: row_id for row_id, reason in reasons.items()}
    assert any("is not valid UTF-8" in r for r in by_reason), reasons  # that line alone, named by offset
    assert sum("nests JSON more than 64 levels" in r for r in by_reason) == 2, reasons
    _nothing_outside(hostile, opened, tmp_path / "vlm", also=(str(tools),))
    bait = hashlib.sha256((hostile.bait / BAIT_IMAGE).read_bytes()).hexdigest()
    assert bait not in {image["sha256"] for image in manifest["images"]}
    assert verify_subset(tmp_path / "vlm").ok


def test_intersyn_image_structs_with_local_paths_are_rejected_with_one_reason_and_nothing_local_is_read(
    hostile: HostileHub, fixture_hub: FixtureHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(hostile.bait)
    with _opened() as opened:
        manifest = materialize_intersyn_subset(
            tmp_path / "intersyn",
            single_turn_source=HOSTILE_INTERSYN,
            single_turn_revision=hostile.shas[HOSTILE_INTERSYN],
            multi_turn_source=INTERSYN_MULTI,
            multi_turn_revision=fixture_hub.shas[INTERSYN_MULTI],
        )
    assert manifest["sample_count"] == 16
    reasons = _reasons(manifest)
    assert {reasons[row_id].split(": ", 1)[1] for row_id in INTERSYN_LOCAL_ROWS} == {HUB_REFERENCE_REASON}
    _nothing_outside(hostile, opened, tmp_path / "intersyn")
    assert verify_subset(tmp_path / "intersyn").ok


def test_the_callers_own_samples_may_still_name_local_files(tmp_path: Path) -> None:
    local = tmp_path / "mine.png"
    local.write_bytes(png_bytes(7))
    sample = single_samples(1)[0]
    sample["conversation"][0]["content"][0]["image"] = str(local)
    manifest = materialize_normalized_conversation_samples(iter([sample]), tmp_path / "subset")
    assert manifest["images"][0]["sha256"] == hashlib.sha256(png_bytes(7)).hexdigest()
    with pytest.raises(
        ImageError, match=re.escape(HUB_REFERENCE_REASON)
    ):  # what Hub data gets for the same value
        encode_image(str(local), local_paths=False)


def test_an_animation_whose_frames_times_canvas_exceed_the_pixel_limit_is_refused_from_its_header() -> None:
    start = time.monotonic()
    with pytest.raises(ImageError, match=r"1000 frames of 8000x8000 = 64000000000 pixels"):
        encode_image(apng_bytes(8000, 8000, 1000))
    assert time.monotonic() - start < 2
    small = encode_image(apng_bytes(64, 48, 5))  # an ordinary animation still passes
    assert (small.format, small.width, small.height) == ("PNG", 64, 48)


# ------------------------------------------------------------------------------------- lying Hub metadata


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("configs-mapping", "configs: block is a dict, not a list"),
        ("configs-strings", "has a config that is not a mapping: 'default'"),
        ("entry-without-path", "data_files entry without a split and path(s)"),
        ("path-not-a-string", "data_files path that is not a string"),
        ("card-not-a-mapping", "the card's metadata is a list"),
    ],
)
def test_a_dataset_card_whose_configs_block_lies_is_one_acquisition_error(
    hostile: HostileHub, tmp_path: Path, case: str, says: str
) -> None:
    spec = TextAcquisitionSpec(
        output_dir=tmp_path / "pkd", source=HOSTILE_PUZZLE_KD, revision=hostile.revisions[case]
    )
    with pytest.raises(AcquisitionError) as exc:
        materialize_puzzle_kd_dataset(spec)
    assert says in str(exc.value) and "\n" not in str(exc.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("lone-foo-column", "no 'messages' column (columns ['foo'])"),
        ("bad-roles", "has a turn whose role is not one of system, user, assistant"),
        ("empty-messages", "has no messages"),
    ],
)
def test_puzzle_kd_rows_without_the_messages_structure_are_refused_at_materialisation(
    hostile: HostileHub, tmp_path: Path, case: str, says: str
) -> None:
    spec = TextAcquisitionSpec(
        output_dir=tmp_path / "pkd",
        source=HOSTILE_PUZZLE_KD,
        revision=hostile.revisions[case],
        train_samples=40,
        validation_samples=8,
    )
    with pytest.raises(ConversationError, match=re.escape(says)):
        materialize_puzzle_kd_dataset(spec)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("not-utf8", "its text is not valid UTF-8"),
        ("huge-reply", "turn 2 has 2097153 bytes of text; the bound is 2097152 (max_turn_bytes)"),
    ],
)
def test_a_hostile_puzzle_kd_row_is_rejected_alone_and_what_is_published_decodes(
    hostile: HostileHub, tmp_path: Path, tokenizer_dir: Path, case: str, says: str
) -> None:
    spec = {"source": HOSTILE_PUZZLE_KD, "revision": hostile.revisions[case], "validation_samples": 8}
    manifest = materialize_puzzle_kd_dataset(
        TextAcquisitionSpec(output_dir=tmp_path / "pkd", train_samples=38, **spec)
    )
    rejected = manifest["diagnostics"]["rejected_rows"]
    assert [(r["split"], r["reason"]) for r in rejected] == [("train", says)] * 2, rejected
    assert manifest["splits"] == {"train": 38, "validation": 8} and formats.verify(tmp_path / "pkd").ok
    tokenized = tokenize_conversations(load_text_split(tmp_path / "pkd"), tokenizer=tokenizer_dir)
    assert len(tokenized.samples) + tokenized.skipped == 38
    with pytest.raises(AcquisitionError, match=r"only 38/40 rows"):  # the two are not made up by others
        materialize_puzzle_kd_dataset(
            TextAcquisitionSpec(output_dir=tmp_path / "all", train_samples=40, **spec)
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkd"]


def test_the_good_commit_before_the_hostile_puzzle_kd_cases_materialises(
    hostile: HostileHub, tmp_path: Path
) -> None:
    """So each case above fails for its own reason, not for a broken repository."""
    spec = TextAcquisitionSpec(
        output_dir=tmp_path / "pkd",
        source=HOSTILE_PUZZLE_KD,
        revision=hostile.revisions["good"],
        train_samples=40,
        validation_samples=8,
    )
    assert materialize_puzzle_kd_dataset(spec)["splits"] == {"train": 40, "validation": 8}


def test_the_hostile_repositories_leave_the_normal_ones_alone_and_are_deterministic(
    hostile: HostileHub, fixture_hub: FixtureHub, tmp_path: Path
) -> None:
    for repo_id, sha in fixture_hub.shas.items():
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=fixture_hub.repo_dir(repo_id), capture_output=True, text=True
        )
        assert head.stdout.strip() == sha
    again = generate_hostile_hub(tmp_path / "again", bait_dir=hostile.bait)
    assert again.shas == hostile.shas and again.revisions == hostile.revisions


# ------------------------------------------------------------------------------------------- silent drift


def _cached(hf_home: Path, repo_id: str, path: str) -> Path:
    snapshots = hf_home / "hub" / ("datasets--" + repo_id.replace("/", "--")) / "snapshots"
    return Path(os.path.realpath(next(snapshots.iterdir()) / path))


def test_a_cached_tar_shard_truncated_at_a_member_boundary_is_fetched_again_and_nothing_drifts(
    fresh_hf_home: Path, hub_endpoint: str, tmp_path: Path
) -> None:
    spec = {"subsets": ("sparsetables",), "num_samples": 30, "max_shards_per_subset": 3}
    materialize_nemotron_vlm_dataset(VlmAcquisitionSpec(output_dir=tmp_path / "a", **spec))
    shard = _cached(fresh_hf_home, NEMOTRON_VLM, "sparsetables/media/shard_000001.tar")
    whole = shard.read_bytes()
    with tarfile.open(shard) as tar:
        last = tar.getmembers()[-1]
    shard.write_bytes(whole[: last.offset] + bytes(1024))  # still a valid tar, one member short
    with FaultProxy(hub_endpoint) as proxy:
        os.environ["HF_ENDPOINT"] = proxy.endpoint
        try:
            materialize_nemotron_vlm_dataset(VlmAcquisitionSpec(output_dir=tmp_path / "b", **spec))
        finally:
            os.environ["HF_ENDPOINT"] = hub_endpoint
    assert proxy.downloads(".tar") == ["sparsetables/media/shard_000001.tar"]  # fetched again, only it
    assert shard.read_bytes() == whole
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")


def test_a_download_that_still_differs_from_the_listing_is_an_acquisition_error(
    hub_endpoint: str, fixture_hub: FixtureHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = fixture_hub.shas[PUZZLE_KD]
    path = "data/validation-00000-of-00002.parquet"
    listing = dict(_hub._listing(PUZZLE_KD, sha))
    real = listing[path]
    listing[path] = SimpleNamespace(size=real.size, blob_id="0" * 40, lfs=None)  # the Hub says other bytes
    monkeypatch.setitem(_hub._LISTINGS, (PUZZLE_KD, sha), listing)
    with pytest.raises(AcquisitionError, match=rf"{path} as downloaded does not match the Hub: its git-sha1"):
        _hub.download(PUZZLE_KD, path, sha)


# ----------------------------------------------------------------------------------------- broken machines


def _namespace_reason() -> str | None:
    """Why mounts cannot be made here (None: `unshare -rm` works)."""
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    done = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    return None if done.returncode == 0 else f"unshare -rm fails: {done.stderr.strip()}"


def _in_namespace(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=240,
    )


_REUSE = """
import json, sys
from puzzletron.cli import main
from puzzletron.dataset import load_materialized_conversation_dataset, load_materialized_conversation_subset
for argv in json.loads(sys.argv[1]):
    assert main(argv) == 0, argv
for name in ("vlm", "intersyn"):
    path = sys.argv[2] + "/" + name
    samples = load_materialized_conversation_subset(path)
    assert len(load_materialized_conversation_dataset(path)) == len(samples) > 0
"""


def test_complete_snapshots_are_reused_and_read_on_a_read_only_file_system(
    hub_endpoint: str, fixture_hub: FixtureHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ro"
    argvs = [
        [
            "materialize",
            "puzzle-kd",
            "--output",
            f"{root}/pkd",
            "--train-samples",
            "8",
            "--validation-samples",
            "4",
        ],
        ["materialize", "nemotron-vlm", "--output", f"{root}/vlm", "--num-samples", "6"],
        [
            "materialize",
            "intersyn",
            "--output",
            f"{root}/intersyn",
            "--rows-per-source",
            "2",
            "--single-turn-revision",
            fixture_hub.shas["finyorko/single_turn"],
            "--multi-turn-revision",
            fixture_hub.shas[INTERSYN_MULTI],
        ],
    ]
    for argv in argvs:
        assert main([*argv, "--quiet"]) == 0
    capsys.readouterr()
    checks = [[*argv, "--quiet"] for argv in argvs] + [
        ["verify", f"{root}/{n}"] for n in ("pkd", "vlm", "intersyn")
    ]
    before = _tree(root)
    reason = _namespace_reason()
    if reason is None:
        done = _in_namespace(
            'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" || exit 8; '
            'if touch "$1/probe" 2>/dev/null; then exit 9; fi; exec "$2" -c "$3" "$4" "$1"',
            str(root),
            sys.executable,
            _REUSE,
            json.dumps(checks),
        )
        assert done.returncode == 0, done.stderr
        statuses = [json.loads(line)["status"] for line in done.stdout.splitlines() if line.startswith("{")]
    elif os.geteuid() != 0:  # the stand-in for a read-only mount: a tree nobody may write
        for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            folder.chmod(0o555)
        try:
            done = subprocess.run(
                [sys.executable, "-c", _REUSE, json.dumps(checks), str(root)], capture_output=True, text=True
            )
        finally:
            for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
                folder.chmod(0o755)
        assert done.returncode == 0, done.stderr
        statuses = [json.loads(line)["status"] for line in done.stdout.splitlines() if line.startswith("{")]
    else:
        pytest.skip(f"no read-only mount can be made ({reason}) and root ignores file modes")
    assert statuses == ["reused"] * 3
    assert _tree(root) == before and sorted(p.name for p in root.iterdir()) == ["intersyn", "pkd", "vlm"]


def test_a_full_hub_cache_disk_is_reported_as_such_and_not_as_a_connection_problem(
    hub_endpoint: str, tmp_path: Path
) -> None:
    reason = _namespace_reason()
    if reason is not None:
        pytest.skip(f"no tmpfs can be mounted: {reason}")
    home = tmp_path / "hf-home"
    home.mkdir()
    out = tmp_path / "pkd"
    done = _in_namespace(
        'mount -t tmpfs -o size=64k tmpfs "$1" && exec "$2" -m puzzletron.cli materialize puzzle-kd --quiet'
        ' --output "$3" --train-samples 8 --validation-samples 4',
        str(home),
        sys.executable,
        str(out),
        env={"HF_HOME": str(home), "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "cannot write the Hub cache" in last and "No space left on device" in last, done.stderr
    assert "connection failed" not in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == [home]


def test_a_full_disk_error_from_the_download_names_the_cache_not_the_connection(
    hub_endpoint: str, fixture_hub: FixtureHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: object, **kwargs: object) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_hub, "hf_hub_download", full)
    with pytest.raises(AcquisitionError, match=r"cannot write the Hub cache at .*No space left on device"):
        _hub.download(PUZZLE_KD, "README.md", fixture_hub.shas[PUZZLE_KD])


def test_ctrl_c_prints_one_line_exits_130_and_publishes_nothing(hub_endpoint: str, tmp_path: Path) -> None:
    out = tmp_path / "snap"
    argv = ["materialize", "puzzle-kd", f"--output={out}", "--train-samples=20", "--validation-samples=20"]
    with FaultProxy(hub_endpoint, mode="stall", drop_pattern="validation-") as proxy:
        env = {**os.environ, "HF_ENDPOINT": proxy.endpoint, "HF_HOME": str(tmp_path / "hf")}
        # A shell's background job (or nohup) starts with SIGINT ignored, and Python keeps an ignored SIGINT:
        # give the child the default disposition, as a terminal's foreground process has.
        child = subprocess.Popen(
            [sys.executable, "-m", "puzzletron.cli", *argv],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + 60
        while not any(m == "GET" and "validation-" in p for m, p in proxy.requests):
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        try:
            _, err = child.communicate(timeout=15)
        except subprocess.TimeoutExpired:  # a signal that landed before Python could act on it: press again
            child.send_signal(signal.SIGINT)
            _, err = child.communicate(timeout=45)
    assert child.returncode == 130
    assert err.strip().splitlines() == [
        "puzzletron-data materialize puzzle-kd: interrupted; nothing partial was published"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no snapshot, transaction or lock


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_hub_serve_on_a_port_in_use_says_so_and_exits_1(
    fixture_hub: FixtureHub, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["hub", "serve", str(fixture_hub.root), "--port", str(busy_port)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and f"cannot serve on 127.0.0.1:{busy_port}" in captured.err


@pytest.mark.parametrize("port", ["-1", "0", "65536", "http"])
def test_hub_serve_with_a_port_outside_1_to_65535_is_a_usage_error(
    fixture_hub: FixtureHub, port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["hub", "serve", str(fixture_hub.root), "--port", port])
    assert exc.value.code == 2 and "must be a TCP port 1..65535" in capsys.readouterr().err


def test_a_run_that_finds_the_snapshot_published_meanwhile_says_reused(
    hub_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["materialize", "puzzle-kd", "--train-samples", "8", "--validation-samples", "4", "--quiet"]
    assert main([*argv, "--output", str(tmp_path / "first")]) == 0
    capsys.readouterr()
    api = _hub._api

    def another_process_publishes(call):  # while this run resolves the revision, before it locks
        if not (tmp_path / "second").exists():
            shutil.copytree(tmp_path / "first", tmp_path / "second")
        return api(call)

    monkeypatch.setattr(_hub, "_api", another_process_publishes)
    assert main([*argv, "--output", str(tmp_path / "second")]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "reused"

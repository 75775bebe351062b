"""Token stores on object storage (a real S3-compatible server on loopback): built with ``output`` or
``cache_dir`` URLs into the same bytes as a local build, by gloo worlds of 1 and 2 ranks without a shared
file system or a lock; a killed build publishes no manifest and its rerun completes; a prefix holding
other objects is refused; a store overwritten after publication is refused; credentials are never
written anywhere."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as tmp_mp

from _token_store_data import ROWS_PER_SHARD, TRAIN_ROWS
from puzzletron.dataset import formats
from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.token_store import TokenStore
from puzzletron.dataset.storage.atomic import total_publications
from puzzletron.dataset.storage.objects import ObjectChanged, Objects
from puzzletron.dataset.tokenize import build_token_store
from puzzletron.dataset.tokenize import store as build_store
from puzzletron.fixtures.mirror import free_port
from puzzletron.fixtures.object_store import TEST_KEY_ID, TEST_SECRET

FORK = multiprocessing.get_context("fork")
SHARDS = -(-TRAIN_ROWS // ROWS_PER_SHARD)
OPTIONS = TokenizeOptions(rows_per_shard=ROWS_PER_SHARD)


@pytest.fixture(autouse=True)
def _serial_tokenizers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def local(snapshot: Path, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local build of the same identity: the reference bytes."""
    out = tmp_path_factory.mktemp("local") / "store"
    return build_token_store(snapshot, tokenizer=tokenizer_dir, output=out, options=OPTIONS)


def _objects(url: str) -> dict[str, bytes]:
    objects = Objects(url)
    return {rel: objects.get(rel) for rel in objects.list()}


def _local_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_store_built_at_an_url_holds_the_bytes_of_a_local_build_and_reads_the_same(
    snapshot: Path, tokenizer_dir: Path, bucket: str, local: Path
) -> None:
    url = build_token_store(snapshot, tokenizer=tokenizer_dir, output=f"{bucket}/stores/pk/", options=OPTIONS)
    assert url == "s3://bkt/stores/pk"
    assert _objects(url) == _local_files(local)  # every object, the manifest included
    assert sorted(Objects(bucket).list()) == sorted(f"stores/pk/{rel}" for rel in _local_files(local))
    remote, here = TokenStore(url), TokenStore(local)
    assert np.array_equal(remote.lengths, here.lengths) and remote.skipped_ids() == here.skipped_ids()
    picks = np.random.default_rng(1).permutation(len(here))[:40]
    for store in (remote, pickle.loads(pickle.dumps(remote))):
        got = store.read(store.offsets[picks], store.offsets[picks + 1])
        want = here.read(here.offsets[picks], here.offsets[picks + 1])
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
        assert store.sample_ids(picks) == here.sample_ids(picks)


def test_cache_dir_urls_find_a_store_anywhere_under_them_or_build_at_the_hash(
    snapshot: Path, tokenizer_dir: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    named = build_token_store(
        snapshot, tokenizer=tokenizer_dir, output=f"{bucket}/c/puzzle-kd", options=OPTIONS
    )
    calls: list[int] = []
    monkeypatch.setattr(build_store, "tokenize_rows", lambda *a, **k: calls.append(1))
    assert (
        build_token_store(snapshot, tokenizer=tokenizer_dir, cache_dir=f"{bucket}/c", options=OPTIONS)
        == named
    )
    assert calls == []
    monkeypatch.undo()
    fresh = build_token_store(snapshot, tokenizer=tokenizer_dir, cache_dir=f"{bucket}/other", options=OPTIONS)
    digest = TokenStore(named).manifest["identity_sha256"]
    assert fresh == f"{bucket}/other/{digest[:16]}"


def test_a_prefix_holding_other_objects_is_refused_before_anything_is_written(
    snapshot: Path, tokenizer_dir: Path, bucket: str
) -> None:
    Objects(f"{bucket}/data").put_bytes("notes.txt", b"mine")
    with pytest.raises(
        SnapshotError, match=r"s3://bkt/data: the prefix holds objects that are not a token store"
    ):
        build_token_store(snapshot, tokenizer=tokenizer_dir, output=f"{bucket}/data", options=OPTIONS)
    assert sorted(Objects(bucket).list()) == ["data/notes.txt"]


def _build_and_die(snapshot: Path, tokenizer_dir: Path, url: str, uploads: int) -> None:
    """Build at `url`, SIGKILLed after `uploads` shard uploads."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    real, done = build_store._remote.upload_shard, []

    def upload(*args, **kwargs):
        if len(done) == uploads:
            os.kill(os.getpid(), signal.SIGKILL)
        real(*args, **kwargs)
        done.append(1)

    build_store._remote.upload_shard = upload
    build_token_store(snapshot, tokenizer=tokenizer_dir, output=url, options=OPTIONS)
    os._exit(3)


def test_a_killed_build_publishes_no_manifest_and_its_rerun_builds_only_the_rest(
    snapshot: Path, tokenizer_dir: Path, bucket: str, local: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{bucket}/stores/pk"
    child = FORK.Process(target=_build_and_die, args=(snapshot, tokenizer_dir, url, 3))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    left = Objects(bucket).list()
    assert "stores/pk/manifest.json" not in left
    assert sum(rel.endswith("/record.json") for rel in left) == 3  # three finished shards staged
    with pytest.raises(SnapshotError, match="manifest is missing"):
        TokenStore(url)
    calls: list[int] = []
    real = build_store.tokenize_rows
    monkeypatch.setattr(
        build_store, "tokenize_rows", lambda rows, a, b, **k: calls.append(a) or real(rows, a, b, **k)
    )
    assert build_token_store(snapshot, tokenizer=tokenizer_dir, output=url, options=OPTIONS) == url
    assert sorted(calls) == [k * ROWS_PER_SHARD for k in range(3, SHARDS)]
    assert _objects(url) == _local_files(local)
    assert all(rel.startswith("stores/pk/") for rel in Objects(bucket).list())  # staging removed


def _rank_main(
    rank: int, world: int, port: int, snapshot: Path, tokenizer_dir: Path, url: str, out: Path
) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    calls: list[int] = []
    real = build_store.tokenize_rows

    def counted(rows, start, stop, **kwargs):
        calls.append(start // ROWS_PER_SHARD)
        return real(rows, start, stop, **kwargs)

    build_store.tokenize_rows = counted
    build_store.locked = None  # no lock may be taken on object storage
    try:
        path = build_token_store(snapshot, tokenizer=tokenizer_dir, output=url, options=OPTIONS)
    finally:
        dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps({"path": path, "shards": calls}))


@pytest.mark.slow
def test_gloo_worlds_of_1_and_2_ranks_write_identical_objects_each_rank_its_own_shards(
    snapshot: Path, tokenizer_dir: Path, bucket: str, local: Path, tmp_path: Path
) -> None:
    for world in (1, 2):
        url = f"{bucket}/world{world}/pk"
        args = (world, free_port(), snapshot, tokenizer_dir, url, tmp_path)
        tmp_mp.start_processes(_rank_main, args=args, nprocs=world, join=True, start_method="fork")
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
        assert [r["path"] for r in ranks] == [url] * world
        assert [r["shards"] for r in ranks] == [
            [k for k in range(SHARDS) if k % world == r] for r in range(world)
        ]
        assert _objects(url) == _local_files(local)
    assert sorted(Objects(bucket).list()) == sorted(
        f"world{w}/pk/{rel}" for w in (1, 2) for rel in _local_files(local)
    )


def test_a_store_overwritten_after_publication_is_refused(
    snapshot: Path, tokenizer_dir: Path, bucket: str
) -> None:
    url = build_token_store(snapshot, tokenizer=tokenizer_dir, output=f"{bucket}/pk", options=OPTIONS)
    objects = Objects(url)
    tokens = objects.get("shards/000002.tokens")
    store = TokenStore(url)
    a, b = int(store.manifest["shards"][2]["tokens"][0]), int(store.manifest["shards"][2]["tokens"][1])
    objects.put_bytes("shards/000002.tokens", tokens[::-1])  # same size, other bytes
    with pytest.raises(ObjectChanged, match=r"shards/000002\.tokens: the object changed after it was pinned"):
        store.read(np.array([a]), np.array([b]))  # opened before: its pinned ETag no longer matches
    reopened = TokenStore(url)  # opened after: the block checksums refuse every changed byte
    with pytest.raises(SnapshotError, match=r"shards/000002.tokens: bytes 0\.\.\d+ \(block 0\) do not match"):
        reopened.read(np.array([a]), np.array([b]))
    objects.put_bytes("shards/000002.tokens", tokens[:-2])  # another size: refused at open
    with pytest.raises(SnapshotError, match=r"shards/000002.tokens has \d+ bytes, the manifest records"):
        TokenStore(url)


def test_credentials_come_from_the_environment_and_are_written_nowhere(
    snapshot: Path, tokenizer_dir: Path, bucket: str, tmp_path: Path
) -> None:
    assert os.environ["AWS_ACCESS_KEY_ID"] == TEST_KEY_ID  # the backend's own configuration: nothing passed
    url = build_token_store(snapshot, tokenizer=tokenizer_dir, output=f"{bucket}/pk", options=OPTIONS)
    store = TokenStore(url)
    store.read(store.offsets[:5], store.offsets[1:6])
    written = [*_objects(url).values(), pickle.dumps(store)]
    cache = Path(os.environ["PUZZLETRON_OBJECT_CACHE"])
    written += [p.read_bytes() for p in cache.rglob("*") if p.is_file()]
    for secret in (TEST_KEY_ID, TEST_SECRET):
        assert not any(secret.encode() in blob for blob in written)


# ------------------------------------------------------------- one store a prefix, damage, concurrent builds

OTHER = TokenizeOptions(rows_per_shard=2 * ROWS_PER_SHARD)  # another identity


def _build_and_wait(snapshot, tokenizer_dir, url, pause_at: int, started, go, out) -> None:
    """Build at `url`, pausing inside shard `pause_at` (its scratch files being written) until `go`; put
    ``(status, url or error)`` on `out`."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    real = build_store.tokenize_rows

    def rows(table, start, stop, **kwargs):
        if start == pause_at * ROWS_PER_SHARD:
            started.set()
            go.wait(300)
        return real(table, start, stop, **kwargs)

    build_store.tokenize_rows = rows
    published = total_publications()  # what the forked parent had published
    try:
        path = build_token_store(snapshot, tokenizer=tokenizer_dir, output=url, options=OPTIONS)
    except Exception as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))
    else:
        out.put(("done" if total_publications() > published else "reused", path))


def _paused_build(snapshot, tokenizer_dir, url, pause_at: int):
    started, go, out = FORK.Event(), FORK.Event(), FORK.Queue()
    child = FORK.Process(
        target=_build_and_wait, args=(snapshot, tokenizer_dir, url, pause_at, started, go, out)
    )
    child.start()
    assert started.wait(300), "the build did not reach its pause"
    return child, go, out


def test_a_build_of_another_identity_into_a_prefix_being_built_is_refused_before_it_writes(
    snapshot: Path, tokenizer_dir: Path, bucket: str, local: Path
) -> None:
    url = f"{bucket}/stores/pk"
    child, go, out = _paused_build(snapshot, tokenizer_dir, url, 3)  # shards 0..2 uploaded
    before = Objects(bucket).list()
    holds = r"s3://bkt/stores/pk: a build of another token store holds this prefix \(s3://bkt/stores/"
    with pytest.raises(
        SnapshotError, match=holds + r"\.pk\.claim\.json: identity [0-9a-f]{16}\.\.\., claimed 20"
    ):
        build_token_store(snapshot, tokenizer=tokenizer_dir, output=url, options=OTHER)
    assert Objects(bucket).list() == before  # not one object written or overwritten (same ETags)
    go.set()
    child.join(300)
    assert out.get(timeout=10) == ("done", url)
    assert _objects(url) == _local_files(local)
    assert ".pk.claim.json" not in Objects(f"{bucket}/stores").list()  # released once published
    with pytest.raises(SnapshotError, match="existing token store was built from another identity"):
        build_token_store(snapshot, tokenizer=tokenizer_dir, output=url, options=OTHER)


def test_a_killed_builds_claim_keeps_another_identity_out_until_cleared_as_the_error_says(
    snapshot: Path, tokenizer_dir: Path, bucket: str
) -> None:
    url = f"{bucket}/stores/pk"
    child = FORK.Process(target=_build_and_die, args=(snapshot, tokenizer_dir, url, 2))
    child.start()
    child.join(240)
    assert child.exitcode == -signal.SIGKILL
    with pytest.raises(SnapshotError) as refused:
        build_token_store(snapshot, tokenizer=tokenizer_dir, output=url, options=OTHER)
    said = str(refused.value)
    assert (
        "\n" not in said
        and "if it was killed, clear its claim: `aws s3 rm s3://bkt/stores/.pk.claim.json`" in said
    )
    staged = said.split("`aws s3 rm --recursive ")[1].split("/`")[0]
    assert staged.startswith("s3://bkt/stores/.pk.build-")
    stores = Objects(f"{bucket}/stores")  # what the two commands do
    stores.delete([".pk.claim.json", *(rel for rel in stores.list() if rel.startswith(staged[16:] + "/"))])
    assert build_token_store(snapshot, tokenizer=tokenizer_dir, output=url, options=OTHER) == url
    assert formats.verify(url).ok
    assert all(rel.startswith("pk/") for rel in stores.list())  # the killed build's staging is gone


def test_an_uploaded_shard_overwritten_after_a_kill_is_built_again_not_reused(
    snapshot: Path, tokenizer_dir: Path, bucket: str, local: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{bucket}/stores/pk"
    child = FORK.Process(target=_build_and_die, args=(snapshot, tokenizer_dir, url, 3))
    child.start()
    child.join(240)
    assert child.exitcode == -signal.SIGKILL
    objects = Objects(url)
    objects.put_bytes("shards/000001.tokens", objects.get("shards/000001.tokens")[::-1])  # same size
    calls: list[int] = []
    real = build_store.tokenize_rows
    monkeypatch.setattr(
        build_store, "tokenize_rows", lambda rows, a, b, **k: calls.append(a) or real(rows, a, b, **k)
    )
    assert build_token_store(snapshot, tokenizer=tokenizer_dir, output=url, options=OPTIONS) == url
    assert sorted(calls) == [k * ROWS_PER_SHARD for k in (1, *range(3, SHARDS))]  # 0 and 2 reused
    assert _objects(url) == _local_files(local)


def test_two_builds_of_one_identity_on_one_node_never_delete_each_others_scratch(
    snapshot: Path, tokenizer_dir: Path, bucket: str, local: Path
) -> None:
    url = f"{bucket}/stores/pk"
    child, go, out = _paused_build(snapshot, tokenizer_dir, url, 2)  # paused inside shard 2's scratch
    assert build_token_store(snapshot, tokenizer=tokenizer_dir, output=url, options=OPTIONS) == url
    go.set()
    child.join(300)
    assert out.get(timeout=10) == ("reused", url)  # it found the store published and stopped
    assert _objects(url) == _local_files(local)
    assert all(rel.startswith("stores/pk/") for rel in Objects(bucket).list())  # no claim, no staging left
    scratch = Path(os.environ["PUZZLETRON_OBJECT_CACHE"]) / "builds"
    assert not scratch.exists() or list(scratch.iterdir()) == []


def _world_rank(rank, world, port, snapshot, tokenizer_dir, url, out: Path, name: str, go) -> None:
    """A rank of the gloo world `name`; with `go`, its shards from 2 on wait for it (the other world's
    build finishes meanwhile)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    real = build_store.tokenize_rows

    def rows(table, start, stop, **kwargs):
        if go is not None and start >= 2 * ROWS_PER_SHARD:
            go.wait(300)
        return real(table, start, stop, **kwargs)

    build_store.tokenize_rows = rows
    try:
        result = {"path": build_token_store(snapshot, tokenizer=tokenizer_dir, output=url, options=OPTIONS)}
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        dist.destroy_process_group()
    (out / f"{name}{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_two_torchrun_builds_of_one_identity_on_one_node_both_end_with_the_one_store(
    snapshot: Path, tokenizer_dir: Path, bucket: str, local: Path, tmp_path: Path
) -> None:
    url, go = f"{bucket}/stores/pk", FORK.Event()
    ports = [free_port()]
    while len(ports) < 2:
        ports += [p for p in [free_port()] if p != ports[0]]
    second = (2, ports[1], snapshot, tokenizer_dir, url, tmp_path, "b", go)  # paused from shard 2 on
    later = tmp_mp.start_processes(_world_rank, args=second, nprocs=2, join=False, start_method="fork")
    first = (2, ports[0], snapshot, tokenizer_dir, url, tmp_path, "a", None)
    tmp_mp.start_processes(_world_rank, args=first, nprocs=2, join=True, start_method="fork")
    go.set()
    while not later.join(300):
        pass
    results = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert results == {name: {"path": url} for name in ("a0", "a1", "b0", "b1")}, results
    assert _objects(url) == _local_files(local)
    assert all(rel.startswith("stores/pk/") for rel in Objects(bucket).list())


def test_a_build_that_fails_cleanly_releases_its_claim_so_a_fixed_rerun_of_another_identity_builds(
    snapshot: Path, tokenizer_dir: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{bucket}/stores/pk"
    real = build_store.tokenize_rows

    def failing(rows, start, stop, **kwargs):
        if start == 3 * ROWS_PER_SHARD:
            raise SnapshotError("row 96: a template that fails")
        return real(rows, start, stop, **kwargs)

    monkeypatch.setattr(build_store, "tokenize_rows", failing)
    with pytest.raises(SnapshotError, match="row 96: a template that fails"):
        build_token_store(snapshot, tokenizer=tokenizer_dir, output=url, options=OPTIONS)
    assert ".pk.claim.json" not in Objects(f"{bucket}/stores").list()
    monkeypatch.undo()
    assert build_token_store(snapshot, tokenizer=tokenizer_dir, output=url, options=OTHER) == url
    assert formats.verify(url).ok

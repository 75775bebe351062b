"""Building token stores: content-addressed identity, reuse without tokenising, the same bytes for any
``num_proc`` and any gloo world size, a build SIGKILLed at several points publishes nothing and its rerun
completes from the finished shards, and a rank's failure raises on every rank; a snapshot at an URL builds
the store of its folder (a tampered object: nothing)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as tmp_mp
from transformers import AutoTokenizer

from _token_store_data import ROWS_PER_SHARD, TRAIN_ROWS
from puzzletron.dataset import formats
from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.errors import ConfigError, ConversationError, SnapshotError, SubsetError
from puzzletron.dataset.formats.text_snapshot import open_split
from puzzletron.dataset.formats.token_store import TokenStore
from puzzletron.dataset.formats.token_store.writer import ShardWriter
from puzzletron.dataset.storage.objects import Objects
from puzzletron.dataset.tokenize import _builder, build_token_store, short_hash, store_identity
from puzzletron.dataset.tokenize import store as build_store

FORK = multiprocessing.get_context("fork")
SHARDS = -(-TRAIN_ROWS // ROWS_PER_SHARD)


@pytest.fixture(autouse=True)
def _serial_tokenizers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # forked children: no thread pool, no warning


@pytest.fixture(scope="module")
def reference(snapshot: Path, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The manifest bytes of a clean one-process build (it holds every file's SHA-256)."""
    out = tmp_path_factory.mktemp("reference") / "store"
    path = build_token_store(
        snapshot, tokenizer=tokenizer_dir, output=out, options=TokenizeOptions(rows_per_shard=ROWS_PER_SHARD)
    )
    return (path / "manifest.json").read_bytes()


def _build(snapshot: Path, tokenizer: object, **kwargs: object) -> Path:
    return build_token_store(
        snapshot, tokenizer=tokenizer, options=TokenizeOptions(rows_per_shard=ROWS_PER_SHARD), **kwargs
    )


@contextmanager
def _counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """The row ranges the builder tokenises in this process while the block runs."""
    calls: list[tuple[int, int]] = []
    real = build_store.tokenize_rows

    def counted(rows, start, stop, **kwargs):
        calls.append((start, stop))
        return real(rows, start, stop, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(build_store, "tokenize_rows", counted)
        yield calls


def _no_debris(out: Path) -> None:
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]


def test_a_store_is_reused_without_loading_the_tokenizer_or_tokenising(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: bytes
) -> None:
    cache = tmp_path / "cache"
    with _counting(monkeypatch) as calls:
        path = _build(snapshot, tokenizer_dir, cache_dir=cache)
    assert len(calls) == SHARDS and (path / "manifest.json").read_bytes() == reference
    identity = store_identity(
        open_split(snapshot), tokenizer=tokenizer_dir, options=TokenizeOptions(rows_per_shard=ROWS_PER_SHARD)
    )
    assert path == cache / short_hash(identity) and len(path.name) == 16

    def never(*args, **kwargs):
        raise AssertionError("a reused store must not load the tokenizer or tokenise")

    monkeypatch.setattr(build_store, "tokenize_rows", never)
    monkeypatch.setattr(build_store, "chat_tokenizer", never)
    assert _build(snapshot, tokenizer_dir, cache_dir=cache) == path
    assert _build(snapshot, tokenizer_dir, output=path) == path  # the same store named directly
    assert sorted(p.name for p in cache.iterdir()) == [path.name]


def test_a_template_edited_between_two_builds_in_one_process_gives_the_new_templates_tokens(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    tok = Path(shutil.copytree(tokenizer_dir, tmp_path / "tok"))
    first = TokenStore(_build(snapshot, tok, cache_dir=tmp_path / "cache", split="validation"))
    template = tok / "chat_template.jinja"
    template.write_text("{{ 'Be brief.' }}" + template.read_text())  # the same path, another template
    second = TokenStore(_build(snapshot, tok, cache_dir=tmp_path / "cache", split="validation"))
    fresh = AutoTokenizer.from_pretrained(tok)  # loaded here, not from any per-process cache
    prefix = fresh("Be brief.", add_special_tokens=False)["input_ids"]
    assert second.path != first.path
    assert list(second.tokens(0)[: len(prefix)]) == prefix
    assert list(first.tokens(0)[: len(prefix)]) != prefix


def test_a_split_rewritten_between_two_loads_in_one_process_is_loaded_again(tmp_path: Path) -> None:
    import datasets

    from puzzletron.dataset.formats.text_snapshot import load_text_split

    def save(rows: list[str]) -> None:
        shutil.rmtree(tmp_path / "split", ignore_errors=True)
        msgs = [[{"role": "user", "content": r}, {"role": "assistant", "content": r}] for r in rows]
        datasets.Dataset.from_dict({"messages": msgs}).save_to_disk(str(tmp_path / "split"))

    save(["a", "b"])
    assert load_text_split(tmp_path / "split")["messages"][0][0]["content"] == "a"
    save(["c", "d", "e"])  # the same folder, other files
    rows = load_text_split(tmp_path / "split")
    assert len(rows) == 3 and rows["messages"][0][0]["content"] == "c"


def _edited_tokenizer(tokenizer_dir: Path, out: Path, edit) -> Path:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    edit(tok)
    tok.save_pretrained(out)
    return out


def test_identity_follows_tokenizer_template_options_and_snapshot(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def ident(tokenizer=tokenizer_dir, *, rows=32, split="train", **kw):
        options = TokenizeOptions(rows_per_shard=rows, **kw)
        return short_hash(store_identity(open_split(snapshot, split), tokenizer=tokenizer, options=options))

    same = shutil.copytree(tokenizer_dir, tmp_path / "copy")
    template = _edited_tokenizer(
        tokenizer_dir, tmp_path / "template", lambda t: setattr(t, "chat_template", t.chat_template + " ")
    )
    vocab = _edited_tokenizer(tokenizer_dir, tmp_path / "vocab", lambda t: t.add_tokens(["<|new|>"]))
    hashes = {
        "base": ident(),
        "template": ident(template),
        "vocab": ident(vocab),
        "rows": ident(rows=64),
        "split": ident(split="validation"),
        "messages": ident(messages_field="conversation"),
    }
    assert ident(same) == hashes["base"] and len(set(hashes.values())) == len(hashes)
    # Tokenizer objects: their content, not their identity or encoding state, is hashed.
    one, two = AutoTokenizer.from_pretrained(tokenizer_dir), AutoTokenizer.from_pretrained(tokenizer_dir)
    two(["some text"], truncation=True, max_length=3, padding="max_length")
    assert ident(one) == ident(two) != hashes["base"]
    two.chat_template += " "
    assert ident(two) != ident(one)
    # A changed template in a cache directory: a new store, tokenised, beside the old one.
    cache = tmp_path / "cache"
    first = _build(snapshot, tokenizer_dir, cache_dir=cache)
    with _counting(monkeypatch) as calls:
        second = _build(snapshot, template, cache_dir=cache)
    assert second != first and len(calls) == SHARDS and (second / "manifest.json").is_file()
    assert (
        TokenStore(second).manifest["identity"]["tokenizer"]
        != TokenStore(first).manifest["identity"]["tokenizer"]
    )


def test_another_identity_at_output_is_an_error_naming_what_differs(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    out = _build(snapshot, tokenizer_dir, output=tmp_path / "store")
    with pytest.raises(
        SubsetError, match=r"another identity \(existing vs requested: options\.rows_per_shard: 32 vs 64"
    ):
        build_token_store(
            snapshot, tokenizer=tokenizer_dir, output=out, options=TokenizeOptions(rows_per_shard=64)
        )
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file").write_text("x")
    with pytest.raises(SubsetError, match="not empty and holds no token store"):
        _build(snapshot, tokenizer_dir, output=tmp_path / "junk")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "exactly one of output"),
    ({"output": "a", "cache_dir": "b"}, "exactly one of output"),
    ({"output": "a", "num_proc": 0}, "num_proc must be > 0"),
    ({"output": "a", "tokenizer": "/nonexistent/tok"}, "is not a directory"),
])  # fmt: skip
def test_options_are_checked(snapshot: Path, tokenizer_dir: Path, kwargs: dict, message: str) -> None:
    kwargs = {"tokenizer": tokenizer_dir, **kwargs}
    with pytest.raises(ConfigError, match=message):
        build_token_store(snapshot, **kwargs)


def test_num_proc_2_writes_the_same_bytes_as_one_process(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, reference: bytes
) -> None:
    path = _build(snapshot, tokenizer_dir, output=tmp_path / "store", num_proc=2, batch_size=10)
    assert (path / "manifest.json").read_bytes() == reference
    assert formats.verify(path).ok
    _no_debris(path)


# ---------------------------------------------------------------------------------- killed builds


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _build_and_die(snapshot: Path, tokenizer_dir: Path, out: Path, point: str) -> None:
    """In a forked child: build, SIGKILLed at `point`."""
    if point == "in shard 4":
        real_add, seen = ShardWriter.add, []

        def add(self, *args, **kwargs):
            seen.append(1)
            if len(seen) == 4:
                _die()
            return real_add(self, *args, **kwargs)

        ShardWriter.add = add
    else:
        real_staging = _builder.staging_dir

        @contextmanager
        def staging(dest):
            with real_staging(dest) as tmp:
                yield tmp
                if point == "before the rename":  # the transaction is complete, not yet renamed
                    _die()
            _die()  # published; the build directory is still there

        _builder.staging_dir = staging
    _build(snapshot, tokenizer_dir, output=out)
    os._exit(3)  # not reached: the kill comes first


@pytest.mark.parametrize(
    ("point", "left"), [("in shard 4", 4), ("before the rename", 0), ("after the rename", 0)]
)
def test_a_killed_build_publishes_nothing_and_the_rerun_reuses_finished_shards(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch, reference: bytes, point: str, left: int
) -> None:
    out = tmp_path / "out" / "store"
    child = FORK.Process(target=_build_and_die, args=(snapshot, tokenizer_dir, out, point))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert (out / "manifest.json").is_file() == (point == "after the rename")
    debris = sorted(p.name for p in out.parent.iterdir())
    assert any(name.startswith(".store.build-") for name in debris)
    with _counting(monkeypatch) as calls:
        assert _build(snapshot, tokenizer_dir, output=out) == out
    assert len(calls) == left  # only the shards the killed run had not finished
    assert (out / "manifest.json").read_bytes() == reference
    _no_debris(out)


# ---------------------------------------------------------------------------------- gloo process groups


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int, world: int, port: int, snapshot: Path, tokenizer_dir: Path, out: Path, fail: bool
) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    calls: list[list[int]] = []
    real = build_store.tokenize_rows

    def counted(rows, start, stop, **kwargs):
        if fail and rank == world - 1:
            raise ConversationError(f"row {start}: planted failure")
        calls.append([start, stop])
        return real(rows, start, stop, **kwargs)

    build_store.tokenize_rows = counted
    result: dict[str, object] = {}
    try:
        path = _build(snapshot, tokenizer_dir, output=out)
        result["built"], calls[:] = list(calls), []
        assert _build(snapshot, tokenizer_dir, output=out) == path  # a restart: collective reuse
        result |= {
            "again": calls,
            "manifest": hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest(),
        }
    except SubsetError as exc:
        result["error"] = str(exc)
    except ConversationError as exc:
        result["error"] = f"own: {exc}"
    finally:
        dist.destroy_process_group()
    (out.parent / f"rank{rank}.json").write_text(json.dumps(result))


def _run_world(
    world: int, snapshot: Path, tokenizer_dir: Path, out: Path, *, fail: bool = False
) -> list[dict]:
    out.parent.mkdir(parents=True)
    args = (world, _free_port(), snapshot, tokenizer_dir, out, fail)
    tmp_mp.start_processes(_rank_main, args=args, nprocs=world, join=True, start_method="fork")
    return [json.loads((out.parent / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_gloo_world_sizes_1_2_4_write_the_same_store_each_rank_its_own_shards(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, reference: bytes
) -> None:
    for world in (1, 2, 4):
        out = tmp_path / f"world{world}" / "store"
        ranks = _run_world(world, snapshot, tokenizer_dir, out)
        assert {r["manifest"] for r in ranks} == {hashlib.sha256(reference).hexdigest()}
        for rank, result in enumerate(ranks):
            shards = [k for k in range(SHARDS) if k % world == rank]
            assert result["built"] == [
                [k * ROWS_PER_SHARD, min((k + 1) * ROWS_PER_SHARD, TRAIN_ROWS)] for k in shards
            ]
            assert result["again"] == []
        assert sorted(p.name for p in out.parent.iterdir() if not p.name.endswith(".json")) == ["store"]


@pytest.mark.slow
def test_a_failing_rank_raises_on_every_rank_and_nothing_is_published(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, reference: bytes
) -> None:
    out = tmp_path / "failing" / "store"
    ranks = _run_world(2, snapshot, tokenizer_dir, out, fail=True)
    assert ranks[1]["error"] == "own: row 32: planted failure"
    assert (
        ranks[0]["error"] == "rank 1 failed building its shards: ConversationError: row 32: planted failure"
    )
    assert not out.exists()
    # rank 0's finished shards are kept: one process completes the store tokenising only rank 1's
    with pytest.MonkeyPatch.context() as patch, _counting(patch) as calls:
        _build(snapshot, tokenizer_dir, output=out)
    assert [a // ROWS_PER_SHARD for a, _ in calls] == [k for k in range(SHARDS) if k % 2 == 1]
    assert (out / "manifest.json").read_bytes() == reference


def test_progress_moves_with_every_batch_not_once_a_shard(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """One shard holds the whole split: progress still reports every batch of 16 rows as it is written."""
    seen: list[tuple[int, int]] = []
    build_token_store(
        snapshot,
        tokenizer=tokenizer_dir,
        output=tmp_path / "store",
        options=TokenizeOptions(rows_per_shard=TRAIN_ROWS),
        batch_size=16,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert seen == [(done, TRAIN_ROWS) for done in [*range(0, TRAIN_ROWS, 16), TRAIN_ROWS]]


def test_progress_from_worker_processes_adds_up_to_the_split(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    seen: list[tuple[int, int]] = []
    _build(
        snapshot,
        tokenizer_dir,
        output=tmp_path / "store",
        num_proc=2,
        batch_size=8,
        progress=lambda *a: seen.append(a),
    )
    done = [d for d, _ in seen]
    assert seen[0] == (0, TRAIN_ROWS) and seen[-1] == (TRAIN_ROWS, TRAIN_ROWS)
    assert done == sorted(done) and {t for _, t in seen} == {TRAIN_ROWS}


# ------------------------------------------------------------------------------------ a snapshot at an URL


def test_a_snapshot_at_an_url_builds_the_same_store_as_its_folder(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, bucket: str, reference: bytes
) -> None:
    url = f"{bucket}/snapshots/pk"
    Objects(url).upload(snapshot)
    cache = tmp_path / "cache"
    path = _build(url, tokenizer_dir, cache_dir=cache)
    assert (path / "manifest.json").read_bytes() == reference  # identity and bytes: the folder's
    assert _build(snapshot, tokenizer_dir, cache_dir=cache) == path  # the same store, reused
    assert sorted(p.name for p in cache.iterdir()) == [path.name]


def test_a_tampered_snapshot_at_an_url_builds_nothing(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, bucket: str
) -> None:
    url, arrow = f"{bucket}/snapshots/pk", "validation/data-00000-of-00001.arrow"
    Objects(url).upload(snapshot)
    data = bytearray((snapshot / arrow).read_bytes())
    data[-200] ^= 0x01
    Objects(url).put_bytes(arrow, bytes(data))
    with pytest.raises(SnapshotError, match=rf"{url}: {arrow}: SHA-256 differs from the manifest"):
        _build(url, tokenizer_dir, cache_dir=tmp_path / "cache", split="validation")
    assert not (tmp_path / "cache").exists()


def test_gloo_ranks_build_from_a_snapshot_at_an_url_the_store_of_its_folder(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, bucket: str, reference: bytes
) -> None:
    url = f"{bucket}/snapshots/pk"
    Objects(url).upload(snapshot)
    ranks = _run_world(2, url, tokenizer_dir, tmp_path / "world2" / "store")  # both ranks copy: one node
    assert {r["manifest"] for r in ranks} == {hashlib.sha256(reference).hexdigest()}

"""Media shards: a subset's images written into shards as it streams, read back by range with their
SHA-256 checked, verified and described; hostile shards (an entry outside its shard, overlapping entries,
a changed image, a truncated shard, a decompression bomb) are one clear error and serve nothing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import xxhash

from _vlm_data import vlm_samples
from puzzletron.dataset.errors import ImageError, SnapshotError
from puzzletron.dataset.formats.media_shards import MediaShards
from puzzletron.dataset.formats.media_shards._layout import ENTRY, INDEX, shard_name
from puzzletron.dataset.formats.subset import (
    SubsetReader,
    describe_subset,
    materialize_normalized_conversation_samples,
    read_manifest,
    render_subset,
    subset_manifest,
    verify_subset,
)
from puzzletron.dataset.storage.local import LocalFiles
from puzzletron.fixtures.hostile import apng_bytes

SHARD = 64 << 10


@pytest.fixture(scope="module")
def subsets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("media")
    files = root / "files"
    materialize_normalized_conversation_samples(iter(vlm_samples(40)), files)
    shards = root / "shards"
    materialize_normalized_conversation_samples(
        iter(vlm_samples(40)), shards, media="shards", shard_bytes=SHARD
    )
    return {"files": files, "shards": shards}


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _media(root: Path) -> MediaShards:
    return MediaShards(LocalFiles(root), subset_manifest(root)["media"], where=str(root))


def resign(root: Path) -> None:
    """A forger's last step: every media file's size and SHA-256 and ``media/blocks.u64`` recomputed from
    the files as they are now (and each image record from its index entry), so only the format's own
    rules can tell."""
    path = root / "manifest.json"
    manifest = json.loads(path.read_text())
    media = manifest["media"]
    entries = np.fromfile(root / INDEX, ENTRY)
    for record, entry in zip(manifest["images"], entries, strict=True):
        record.update(bytes=int(entry["length"]), sha256=bytes(entry["sha256"]).hex())
    sums = []
    for record in media["files"]:
        if record["path"] != "media/blocks.u64":
            data = (root / record["path"]).read_bytes()
            sums += [xxhash.xxh3_64_intdigest(data[a : a + 65536]) for a in range(0, len(data), 65536)]
    (root / "media/blocks.u64").write_bytes(np.asarray(sums, "<u8").tobytes())
    for record in media["files"]:
        data = (root / record["path"]).read_bytes()
        record.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def test_images_stream_into_shards_of_the_target_size_and_read_back_exactly(subsets) -> None:
    files, shards = subsets["files"], subsets["shards"]
    manifest = read_manifest(shards)
    assert manifest["version"] == 3 and manifest["media"]["images"] == manifest["image_count"]
    assert not (shards / "images").exists()
    sizes = [r["bytes"] for r in manifest["media"]["files"] if r["path"].startswith("media/shards/")]
    largest = max(r["bytes"] for r in manifest["images"])
    assert len(sizes) > 1 and max(sizes) <= max(SHARD, largest)
    # the same samples file; each image's bytes those of its file in the one-file-per-image layout
    assert (files / "samples.jsonl").read_bytes() == (shards / "samples.jsonl").read_bytes()
    data = _media(shards).read(np.arange(manifest["image_count"]))
    assert data == [(files / r["path"]).read_bytes() for r in read_manifest(files)["images"]]
    plain, sharded = SubsetReader(files), SubsetReader(shards)
    for i in range(len(plain)):
        a, b = plain[i], sharded[i]
        items = [it for t in b["conversation"] for it in t["content"] if it.get("type") == "image"]
        paths = [it for t in a["conversation"] for it in t["content"] if it.get("type") == "image"]
        assert [it["image"].size for it in items] == [_size(it["image"]) for it in paths]


def _size(path: str) -> tuple[int, int]:
    from puzzletron.dataset.conversation.images import decode_rgb

    return decode_rgb(Path(path).read_bytes()).size


def test_verify_and_inspect_understand_media_shards(subsets, tmp_path) -> None:
    report = verify_subset(subsets["shards"])
    assert report.ok and report.image_count == read_manifest(subsets["shards"])["image_count"]
    info = describe_subset(subsets["shards"])
    assert info["media"]["layout"] == "shards" and info["media"]["shard_bytes"] == SHARD
    assert any(line.startswith("media ") for line in render_subset(info))
    assert describe_subset(subsets["files"])["media"] == {"layout": "files"}
    damaged = _copy(subsets["shards"], tmp_path / "damaged")
    shard = damaged / shard_name(0)
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 1
    shard.write_bytes(bytes(raw))
    (damaged / "media" / "stray.bin").write_bytes(b"x")
    problems = verify_subset(damaged).problems
    assert any("media/shards/000000.bin: SHA-256 differs" in p for p in problems)
    assert any("unexpected file media/stray.bin" in p for p in problems)


def _tamper_index(root: Path, change) -> None:
    entries = np.fromfile(root / INDEX, ENTRY)
    change(entries)
    entries.tofile(root / INDEX)
    resign(root)


def _outside(e: np.ndarray) -> None:
    e[1]["length"] += 10_000_000  # past its shard's end


def _overlap(e: np.ndarray) -> None:
    e[2]["offset"] = e[1]["offset"]  # two entries on the same bytes


@pytest.mark.parametrize(("change", "pattern"), [(_outside, "entry 1 "), (_overlap, "entry 2 ")])
def test_an_index_entry_outside_its_shard_or_over_another_is_refused(
    subsets, tmp_path, change, pattern
) -> None:
    root = _copy(subsets["shards"], tmp_path / "hostile")
    _tamper_index(root, change)
    with pytest.raises(SnapshotError, match=rf"media/index.bin: {pattern}.*the index is damaged"):
        _media(root).read(np.array([0]))
    with pytest.raises(SnapshotError, match="the index is damaged"):
        SubsetReader(root)[0 if change is _outside else 1]
    assert any("the index is damaged" in p for p in verify_subset(root).problems)


def test_an_image_that_does_not_match_its_sha256_is_never_served(subsets, tmp_path) -> None:
    root = _copy(subsets["shards"], tmp_path / "changed")
    entry = np.fromfile(root / INDEX, ENTRY)[3]
    shard = root / shard_name(int(entry["shard"]))
    raw = bytearray(shard.read_bytes())
    raw[int(entry["offset"]) + 5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    resign(root)  # files and block checksums re-signed; the index keeps the image's true SHA-256
    media = _media(root)
    assert media.read(np.array([2]))  # its neighbours are fine
    with pytest.raises(SnapshotError, match=r"media image 3 .* does not match its SHA-256.*nothing of it"):
        media.read(np.array([2, 3]))
    assert any("image 3" in p and "SHA-256" in p for p in verify_subset(root).problems)


def test_a_truncated_shard_is_refused_before_a_byte_is_served(subsets, tmp_path) -> None:
    root = _copy(subsets["shards"], tmp_path / "short")
    shard = root / shard_name(1)
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(SnapshotError, match=r"media/shards/000001.bin has \d+ bytes, the manifest records"):
        _media(root)
    with pytest.raises(SnapshotError, match=r"media file 'media/shards/000001\.bin' has"):
        read_manifest(root)
    assert not verify_subset(root).ok


def test_a_decompression_bomb_inside_a_shard_is_one_clear_error(tmp_path) -> None:
    samples = list(vlm_samples(3))
    bomb = apng_bytes(20_000, 20_000, 1)  # 400 M pixels in a few hundred bytes
    root = tmp_path / "bomb"
    materialize_normalized_conversation_samples(iter(samples), root, media="shards", shard_bytes=SHARD)
    manifest = read_manifest(root)
    first = next(i for i, r in enumerate(manifest["images"]) if r["sample_index"] == 0)
    entries = np.fromfile(root / INDEX, ENTRY)
    rel = shard_name(int(entries[first]["shard"]))
    raw = bytearray((root / rel).read_bytes())
    a, n = int(entries[first]["offset"]), int(entries[first]["length"])
    raw[a : a + n] = bomb
    (root / rel).write_bytes(bytes(raw))
    shift = len(bomb) - n
    same = (entries["shard"] == entries[first]["shard"]) & (np.arange(len(entries)) > first)
    entries["offset"][same] += shift
    entries[first]["length"], entries[first]["sha256"] = (
        len(bomb),
        np.frombuffer(hashlib.sha256(bomb).digest(), np.uint8),
    )
    entries.tofile(root / INDEX)
    resign(root)
    problems = verify_subset(root).problems  # every byte is what the manifest says: its header tells
    assert len(problems) == 1 and "image of sample 0" in problems[0] and "decompression bomb" in problems[0]
    with pytest.raises(ImageError, match=r"sample 0 .*image 0: cannot decode the image.*(?i:bomb)"):
        SubsetReader(root)[0]


def test_a_failed_materialisation_publishes_no_shards(tmp_path) -> None:
    def samples():
        yield from vlm_samples(5)
        raise RuntimeError("the source broke")

    with pytest.raises(RuntimeError, match="the source broke"):
        materialize_normalized_conversation_samples(
            samples(), tmp_path / "out", media="shards", shard_bytes=SHARD
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _materialize_and_die(dest: Path, kill_at: int | None, trace: Path | None) -> None:
    """Child: materialise with media shards, SIGKILLed before the `kill_at`-th file operation under the
    destination's parent (PEP 578 audit events: `open`, `os.mkdir`, `os.rename`, ...)."""
    import os
    import signal
    import sys

    parent, seen = str(dest.parent), []

    def hook(event: str, args: tuple) -> None:
        if (
            event.split(".")[0] not in ("open", "os")
            or not args
            or not isinstance(args[0], str | os.PathLike)
        ):
            return
        if not os.fspath(args[0]).startswith(parent):
            return
        seen.append(event)
        if len(seen) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    materialize_normalized_conversation_samples(iter(vlm_samples(8)), dest, media="shards", shard_bytes=SHARD)
    if trace is not None:
        trace.write_text(json.dumps(seen))


@pytest.mark.slow
def test_a_kill_at_any_file_operation_leaves_no_subset_or_a_complete_one_and_no_debris(tmp_path) -> None:
    import multiprocessing
    import signal

    fork = multiprocessing.get_context("fork")
    trace = tmp_path / "trace.json"
    probe = fork.Process(target=_materialize_and_die, args=(tmp_path / "probe" / "dest", None, trace))
    probe.start()
    probe.join(60)
    events = json.loads(trace.read_text())
    outcomes = set()
    for k in sorted({*range(1, len(events) + 1, max(1, len(events) // 12)), len(events)}):
        dest = tmp_path / f"kill{k}" / "dest"
        child = fork.Process(target=_materialize_and_die, args=(dest, k, None))
        child.start()
        child.join(60)
        assert child.exitcode == -signal.SIGKILL
        outcomes.add("complete" if dest.exists() else "absent")
        assert not dest.exists() or verify_subset(dest).ok  # never a half-written subset
        materialize_normalized_conversation_samples(
            iter(vlm_samples(8)), dest, media="shards", shard_bytes=SHARD
        )
        assert verify_subset(dest).ok and sorted(p.name for p in dest.parent.iterdir()) == ["dest"]
    assert "absent" in outcomes

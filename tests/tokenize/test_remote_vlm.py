"""VLM stores and subsets (with their media shards) on object storage (a real S3-compatible server on
loopback): a store built at an URL from a subset at an URL holds the bytes of a local build, for gloo
worlds of 1 and 2 ranks (each its own shards, no shared file system, no lock) and from the command line;
its batches are byte for byte those of the local one-file-per-image path; a killed build publishes no
store and its rerun completes it; a media shard overwritten after its subset was opened is refused; a rank
fetches only the media of its own packs."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as tmp_mp

from _vlm_data import vlm_samples
from puzzletron.dataset.config import PuzzletronDataSpec
from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.subset import materialize_normalized_conversation_samples
from puzzletron.dataset.formats.vlm_store import VlmStore
from puzzletron.dataset.pipelines.vlm import build_vlm_batches
from puzzletron.dataset.storage.objects import ObjectChanged, Objects
from puzzletron.dataset.tokenize import build_vlm_store
from puzzletron.dataset.tokenize import vlm_store as build_module
from puzzletron.fixtures.mirror import free_port

ROWS = 16  # 40 rows: 3 shards, the last one partial
SPEC = PuzzletronDataSpec.from_mapping(
    {
        "modality": "multimodal",
        "layout": "packed_varlen",
        "max_sample_length": 512,
        "packing": {"pack_size": 512},
    }
)


@pytest.fixture(autouse=True)
def _serial_tokenizers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded") / "subset"
    materialize_normalized_conversation_samples(
        iter(vlm_samples(40)), out, media="shards", shard_bytes=64 << 10
    )
    return out


@pytest.fixture(scope="module")
def local(sharded: Path, processor_dirs: dict[str, Path], tmp_path_factory) -> Path:
    """The local build of the sharded subset: the reference bytes."""
    out = tmp_path_factory.mktemp("local") / "store"
    return build_vlm_store(sharded, processor=processor_dirs["qwen2_5_vl"], output=out, rows_per_shard=ROWS)


@pytest.fixture(scope="module")
def reference(vlm_stores, vlm_subset, processor_dirs) -> list[str]:
    """The fingerprints of the local one-file-per-image path (the same samples)."""
    batches = build_vlm_batches(vlm_stores["qwen2_5_vl"], processor=processor_dirs["qwen2_5_vl"],
                                subset=vlm_subset, spec=SPEC, batch_size=2, seed=1)  # fmt: skip
    return [b.fingerprint for b in batches]


def _upload(folder: Path, url: str) -> str:
    objects = Objects(url)
    objects.upload(folder, last="manifest.json")
    objects.put_file("manifest.json", folder / "manifest.json")  # published last, as a writer does
    return url


def _objects(url: str) -> dict[str, bytes]:
    objects = Objects(url)
    return {rel: objects.get(rel) for rel in objects.list()}


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _same_store(url: str, subset: str, local: Path) -> bool:
    """The objects at `url` are the local build's bytes, the manifest's ``subset_path`` (where the subset
    was: the URL it was read from) alone apart."""
    got, want = _objects(url), _files(local)
    recorded = json.loads(got["manifest.json"])
    assert recorded.pop("subset_path") == subset
    reference = json.loads(want["manifest.json"])
    reference.pop("subset_path")
    return recorded == reference and {k: v for k, v in got.items() if k != "manifest.json"} == {
        k: v for k, v in want.items() if k != "manifest.json"
    }


def test_a_store_built_at_an_url_from_an_url_subset_is_a_local_build_and_gives_its_batches(
    sharded, local, reference, bucket, processor_dirs
) -> None:
    subset = _upload(sharded, f"{bucket}/subsets/vlm")
    processor = processor_dirs["qwen2_5_vl"]
    url = build_vlm_store(subset, processor=processor, output=f"{bucket}/stores/vlm/", rows_per_shard=ROWS)
    assert url == f"{bucket}/stores/vlm" and _same_store(url, subset, local)
    assert len(VlmStore(url)) == len(VlmStore(local))
    batches = build_vlm_batches(url, processor=processor, subset=subset, spec=SPEC, batch_size=2, seed=1)
    assert [b.fingerprint for b in batches] == reference
    assert [b.fingerprint for b in batches.loader(num_workers=2)] == reference
    with pytest.raises(SnapshotError, match="is not the subset the VLM store"):
        build_vlm_batches(url, processor=processor, subset=f"{bucket}/nothing", spec=SPEC, batch_size=2)


def test_the_command_line_tokenises_an_url_subset_into_an_url_store(
    sharded, local, bucket, processor_dirs, capsys
) -> None:
    from puzzletron.cli import main

    subset = _upload(sharded, f"{bucket}/cli/subset")
    url = f"{bucket}/cli/store"
    code = main(["tokenize", subset, "--processor", str(processor_dirs["qwen2_5_vl"]), "--output", url,
                 "--rows-per-shard", str(ROWS), "--json"])  # fmt: skip
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and line["status"] == "done" and line["path"] == url
    assert _same_store(url, subset, local)


def _build_and_die(subset: str, processor: Path, url: str, uploads: int) -> None:
    """Build at `url`, SIGKILLed after `uploads` shard uploads."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    real, done = build_module.RemoteVlmStore.upload, []

    def upload(self, *args, **kwargs):
        if len(done) == uploads:
            os.kill(os.getpid(), signal.SIGKILL)
        real(self, *args, **kwargs)
        done.append(1)

    build_module.RemoteVlmStore.upload = upload
    build_vlm_store(subset, processor=processor, output=url, rows_per_shard=ROWS)
    os._exit(3)


def test_a_killed_build_publishes_no_store_and_its_rerun_completes_it(
    sharded, local, bucket, processor_dirs
) -> None:
    import multiprocessing

    subset, url = _upload(sharded, f"{bucket}/k/subset"), f"{bucket}/k/store"
    child = multiprocessing.get_context("fork").Process(
        target=_build_and_die, args=(subset, processor_dirs["qwen2_5_vl"], url, 2)
    )
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    left = Objects(f"{bucket}/k").list()
    assert "store/manifest.json" not in left and sum(rel.endswith("/record.json") and "tokens" not in rel
                                                     for rel in left) == 2  # fmt: skip
    with pytest.raises(SnapshotError, match="manifest is missing"):
        VlmStore(url)
    assert (
        build_vlm_store(subset, processor=processor_dirs["qwen2_5_vl"], output=url, rows_per_shard=ROWS)
        == url
    )
    assert _same_store(url, subset, local)
    assert all(rel.startswith(("store/", "subset/")) for rel in Objects(f"{bucket}/k").list())  # no staging


def _rank_main(rank: int, world: int, port: int, subset: str, processor: Path, url: str, out: Path) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    built: list[int] = []
    real = build_module._VlmBuild.write_shard

    def counted(self, facts, shard, directory):
        built.append(shard)
        return real(self, facts, shard, directory)

    build_module._VlmBuild.write_shard = counted
    try:
        path = build_vlm_store(subset, processor=processor, output=url, rows_per_shard=ROWS)
    finally:
        dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps({"path": path, "shards": built}))


@pytest.mark.slow
def test_gloo_worlds_of_1_and_2_ranks_build_the_same_objects_each_rank_its_own_shards(
    sharded, local, bucket, processor_dirs, tmp_path
) -> None:
    subset = _upload(sharded, f"{bucket}/g/subset")
    for world in (1, 2):
        url = f"{bucket}/g/world{world}"
        args = (world, free_port(), subset, processor_dirs["qwen2_5_vl"], url, tmp_path)
        tmp_mp.start_processes(_rank_main, args=args, nprocs=world, join=True, start_method="fork")
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
        assert [r["path"] for r in ranks] == [url] * world
        assert [sorted(r["shards"]) for r in ranks] == [
            [k for k in range(3) if k % world == r] for r in range(world)
        ]
        assert _same_store(url, subset, local)


def test_a_media_shard_overwritten_after_the_subset_was_opened_is_refused(
    sharded, local, bucket, processor_dirs
) -> None:
    subset = _upload(sharded, f"{bucket}/o/subset")
    batches = build_vlm_batches(local, processor=processor_dirs["qwen2_5_vl"], subset=subset, spec=SPEC,
                                batch_size=2, seed=1)  # fmt: skip
    media = batches.dataset.media
    media.blobs(np.arange(2))  # the subset is open: every object pinned by its ETag
    objects = Objects(subset)
    shards = sorted(rel for rel in objects.list() if rel.startswith("media/shards/"))
    for rel in shards:
        data = objects.get(rel)
        objects.put_bytes(rel, data[::-1])  # the same size, other bytes
    with pytest.raises(ObjectChanged, match=r"media/shards/\d+\.bin: the object changed after it was pinned"):
        media.blobs(np.arange(len(batches.store.grid)))


def test_a_rank_fetches_only_the_media_of_its_own_packs(
    sharded, local, bucket, processor_dirs, monkeypatch
) -> None:
    from puzzletron.dataset.pipelines import _vlm_media

    chunk = 16 << 10  # the fixture's images are a few KiB: a small cache chunk shows what is read
    monkeypatch.setattr(_vlm_media, "MEDIA_CHUNK", chunk)
    subset = _upload(sharded, f"{bucket}/r/subset")
    total = sum(len(v) for k, v in _objects(subset).items() if k.startswith("media/shards/"))
    fetched: list[int] = []
    real = Objects.get_ranges

    def counting(self, rel, spans, **kwargs):
        if rel.startswith("media/shards/"):
            fetched.extend(b - a for a, b in spans)
        return real(self, rel, spans, **kwargs)

    monkeypatch.setattr(Objects, "get_ranges", counting)
    batches = build_vlm_batches(local, processor=processor_dirs["qwen2_5_vl"], subset=subset, spec=SPEC,
                                batch_size=1, dp_rank=0, dp_size=4, seed=1)  # fmt: skip
    for _ in batches:
        pass
    got = sum(fetched)
    mine = sorted({i for key in batches.sampler for row in batches.dataset.rows(key) for i in row})
    rows = {int(name.split(":", 1)[0]) for name in batches.store.sample_ids(mine)}
    records = [
        r for r in json.loads((sharded / "manifest.json").read_text())["images"] if r["sample_index"] in rows
    ]
    needed = sum(r["bytes"] for r in records)
    assert needed <= got <= needed + len(records) * 2 * chunk  # its images, a cache chunk either side at most
    assert got < total / 2  # a quarter of the packs: never the whole subset


def test_the_automodel_factory_reads_a_subset_and_its_store_at_urls(sharded, local, bucket) -> None:
    from puzzletron.dataset import load_materialized_conversation_dataset

    subset = _upload(sharded, f"{bucket}/a/subset")
    store = _upload(local, f"{bucket}/a/store")
    here = load_materialized_conversation_dataset(sharded, vlm_store=local)
    there = load_materialized_conversation_dataset(subset, vlm_store=store)
    assert len(there) == len(here)
    for i in range(len(here)):
        a, b = here[i], there[i]
        assert a.get("_text_tokens") == b.get("_text_tokens") and a["mm_inputs_meta"] == b["mm_inputs_meta"]
        pictures = [[np.asarray(it["image"]) for t in x["conversation"] for it in t["content"]
                     if it.get("type") == "image"] for x in (a, b)]  # fmt: skip
        assert all(np.array_equal(p, q) for p, q in zip(*pictures, strict=True))


def test_verify_and_inspect_read_a_sharded_subset_and_a_vlm_store_at_urls(sharded, local, bucket) -> None:
    from puzzletron.dataset import formats

    subset = _upload(sharded, f"{bucket}/v/subset")
    store = _upload(local, f"{bucket}/v/store")
    assert formats.verify(subset).ok and formats.verify(store).ok
    assert formats.describe(subset)["media"]["layout"] == "shards"
    assert formats.describe(store)["format"] == "puzzletron-vlm-store"
    objects = Objects(subset)
    rel = sorted(r for r in objects.list() if r.startswith("media/shards/"))[0]
    objects.put_bytes(rel, objects.get(rel)[::-1])  # the same size, other bytes
    assert any(f"{rel}: SHA-256 differs" in p for p in formats.verify(subset).problems)

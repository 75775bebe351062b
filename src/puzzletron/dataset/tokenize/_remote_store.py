"""Building a token store on object storage (``output="s3://bucket/stores/puzzle-kd"``): no shared file
system, no lock; `puzzletron.dataset.tokenize.store` calls these where a local build renames and locks.

Publication (``docs/object-storage.md``):

1. Each rank (or worker process) tokenises its shards into a local scratch folder and uploads each
   finished one: the token and mask files to their final names (``<store>/shards/<k>.tokens``, ``.mask``),
   its index parts to the staging prefix ``<parent>/.<name>.build-<16 hex of the identity>/shard-<k>/``,
   and its ``record.json`` there last: a shard with a record is finished (a rerun skips it).
2. One process (rank 0) downloads the index parts (not the tokens), assembles the index and the block
   checksums locally (`formats.token_store.assemble_store`), uploads them, checks every shard object is
   there with its recorded size, and writes ``manifest.json`` once (``If-None-Match: *``). A reader looks
   for the manifest first, so it sees a complete store or none.
3. The staging prefix is removed.

A build killed at any point leaves no manifest; its rerun (any world size) finds the finished shards by
their records and builds the rest. Two builds of one identity racing to one prefix write the same bytes;
the second's manifest write fails and it reuses the first's. The bytes, the manifest included, are those
of a local build of the same identity.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.manifest import MANIFEST, parse_json
from puzzletron.dataset.formats.token_store import RECORD, assemble_store, read_complete_manifest
from puzzletron.dataset.storage.atomic import note_publication
from puzzletron.dataset.storage.object_cache import ObjectCache
from puzzletron.dataset.storage.objects import Objects, join_url, url_name, url_parent
from puzzletron.dataset.storage.remote import RemoteFiles

__all__ = ["finished_shards", "publish", "published_manifest", "scratch_dir", "upload_shard"]

_PARTS = ("blocks.u64", "lengths.u32", "ids.bin", "ids.i64", "skipped.bin", "skipped.i64")
_LAYOUT = re.compile(
    r"(shards/\d{6}\.(tokens|mask)|index/[a-z]+\.(i64|u32|u64|bin)|skipped/ids\.(bin|i64)|manifest\.json)"
)


def _shard_file(k: int, part: str) -> str:
    return f"shards/{k:06d}.{part}"


def staging(dest: str, digest: str) -> Objects:
    """The staging prefix of a build of `dest` (beside it, like a local build directory)."""
    return Objects(join_url(url_parent(dest), f".{url_name(dest)}.build-{digest[:16]}"))


def scratch_dir(digest: str) -> Path:
    """The local folder this node tokenises shards in before uploading them (under the object cache)."""
    return ObjectCache.default().root / "builds" / digest[:16]


def published_manifest(dest: str) -> dict[str, Any] | None:
    """The complete store's manifest at `dest`, or None when nothing is published there; `SnapshotError`
    when the prefix holds objects that are neither a store nor a killed build's shards."""
    source = RemoteFiles(dest, cache=None)
    listing = source.listing()
    if MANIFEST not in listing:
        strangers = [rel for rel in listing if not _LAYOUT.fullmatch(rel)]
        if strangers:
            raise SnapshotError(
                f"{dest}: the prefix holds objects that are not a token store's ({strangers[:3]}); choose "
                "another output"
            )
        return None
    return read_complete_manifest(dest, source)


def upload_shard(dest: str, digest: str, k: int, folder: Path, record: Mapping[str, Any]) -> None:
    """Upload finished shard `k` from its local `folder`: data to the store, index parts to staging, the
    record last."""
    store, stage = Objects(dest), staging(dest, digest)
    for part in ("tokens", "mask"):
        store.put_file(_shard_file(k, part), folder / part)
    for part in _PARTS:
        stage.put_file(f"shard-{k:06d}/{part}", folder / part)
    stage.put_bytes(f"shard-{k:06d}/{RECORD}", json.dumps(record, sort_keys=True).encode())


def _records(dest: str, digest: str, rows: Mapping[int, tuple[int, int]]) -> dict[int, dict[str, Any]]:
    """The records of the finished shards among `rows` (shard -> its row range) whose objects are all
    there with their recorded sizes (two listings, one small read a finished shard)."""
    stage = staging(dest, digest)
    staged, stored = stage.list(), Objects(dest).list("shards")
    out = {}
    for k, span in rows.items():
        raw = stage.get(f"shard-{k:06d}/{RECORD}") if f"shard-{k:06d}/{RECORD}" in staged else None
        try:
            record = parse_json(raw, "a shard record") if raw is not None else None
        except ValueError:
            record = None
        if not isinstance(record, dict) or record.get("rows") != list(span):
            continue
        files = record.get("files", {})
        sizes_ok = all(
            (info := stored.get(_shard_file(k, part))) is not None
            and info.size == (files.get(part) or {}).get("bytes")
            for part in ("tokens", "mask")
        )
        if sizes_ok and all(f"shard-{k:06d}/{part}" in staged for part in _PARTS):
            out[k] = record
    return out


def finished_shards(dest: str, digest: str, rows: Mapping[int, tuple[int, int]]) -> set[int]:
    """Which shards of `rows` an earlier run finished and uploaded."""
    return set(_records(dest, digest, rows))


def publish(
    dest: str, digest: str, rows: Sequence[tuple[int, int]], *, fields: Mapping[str, Any], scratch: Path
) -> None:
    """Assemble the index of the uploaded shards (``rows[k]``: shard k's row range), upload it, write the
    manifest once and remove the staging prefix. `SnapshotError` when a shard is missing or another store
    was published at `dest` meanwhile."""
    records = _records(dest, digest, dict(enumerate(rows)))
    missing = [k for k in range(len(rows)) if k not in records]
    if missing:
        raise SnapshotError(f"{dest}: shards {missing[:8]} are missing after every rank built its own")
    store, stage = Objects(dest), staging(dest, digest)
    scratch.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"publish-{secrets.token_hex(4)}-", dir=scratch))
    try:
        dirs = []
        for k in range(len(rows)):
            folder = work / f"shard-{k:06d}"
            folder.mkdir()
            for part in _PARTS:
                data = stage.get(f"shard-{k:06d}/{part}")
                if data is None:
                    raise SnapshotError(f"{stage.url}: shard {k}'s {part} is gone")
                (folder / part).write_bytes(data)
            dirs.append(folder)
        out = work / "store"
        out.mkdir()
        manifest = assemble_store(out, dirs, [records[k] for k in range(len(rows))], fields=fields,
                                  link_shards=False)  # fmt: skip
        for record in manifest["files"]:
            if not record["path"].startswith("shards/"):
                store.put_file(record["path"], out / record["path"])
        listed = store.list()
        for record in manifest["files"]:
            info = listed.get(record["path"])
            if info is None or info.size != record["bytes"]:
                raise SnapshotError(
                    f"{store.url_of(record['path'])}: missing or of another size before publication"
                )
        data = (out / MANIFEST).read_bytes()
        if store.create_once(MANIFEST, data):
            note_publication(dest)
        elif store.get(MANIFEST) != data:
            raise SnapshotError(f"{dest}: another store was published there while this one was built")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stage.delete(stage.list())

"""Building a token store on object storage (``output="s3://bucket/stores/puzzle-kd"``): no shared file
system, no lock; `puzzletron.dataset.tokenize.store` calls these where a local build renames and locks.

Publication (``docs/object-storage.md``):

0. Rank 0 claims the prefix (`storage.claims`: a create-once object naming the identity) before anything
   is written: a build of another identity is refused, one of the same identity goes on with it.
1. Each rank (or worker process) tokenises its shards into a scratch folder of its own
   (`storage.scratch`) and uploads each finished one: the token and mask files to their final names
   (``<store>/shards/<k>.tokens``, ``.mask``), its index parts and ``record.json`` to the staging prefix
   ``<parent>/.<name>.build-<16 hex of the identity>/shard-<k>/``, and its ``seal.json`` there last:
   every file's size and xxh3_128 (`storage.seals`) and the ETag each object got. A shard with a seal is
   finished; a rerun reuses it only when every object is there with its sealed size and ETag (an object
   overwritten since, damaged or not, is built again); a backend without ETags rehashes the bytes.
2. One process (rank 0) downloads the index parts (not the tokens), checks them against the seals,
   assembles the index and the block checksums locally (`formats.token_store.assemble_store`), uploads
   them, checks every object is there with its recorded size and every shard with its sealed ETag, and
   writes ``manifest.json`` once (``If-None-Match: *``). A reader looks for the manifest first, so it sees a
   complete store or none. The claim and the staging prefix are removed.

A build killed at any point leaves no manifest; its rerun (any world size) reuses the sealed shards and
builds the rest. Two builds of one identity racing to one prefix write the same bytes: the one that finds
the manifest written (before an upload, before or while publishing) stops and reuses it. The bytes, the
manifest included, are those of a local build of the same identity.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.manifest import MANIFEST, parse_json, read_bounded
from puzzletron.dataset.formats.token_store import RECORD, assemble_store, read_complete_manifest
from puzzletron.dataset.storage.atomic import note_publication
from puzzletron.dataset.storage.claims import release_claim, staging_url, take_claim
from puzzletron.dataset.storage.object_cache import ObjectCache
from puzzletron.dataset.storage.objects import ObjectInfo, Objects
from puzzletron.dataset.storage.remote import RemoteFiles
from puzzletron.dataset.storage.seals import SEAL, parse_seal, read_seal

__all__ = [
    "claim",
    "finished_shards",
    "publish",
    "published_manifest",
    "release",
    "scratch_dir",
    "upload_shard",
]

_LOG = logging.getLogger(__name__)
_PARTS = ("blocks.u64", "lengths.u32", "ids.bin", "ids.i64", "skipped.bin", "skipped.i64", RECORD)
_DATA = ("tokens", "mask")
_MAX_STAGED_BYTES = 1 << 20  # a record or a seal
_LAYOUT = re.compile(
    r"(shards/\d{6}\.(tokens|mask)|index/[a-z]+\.(i64|u32|u64|bin)|skipped/ids\.(bin|i64)|manifest\.json)"
)


def _shard_file(k: int, part: str) -> str:
    return f"shards/{k:06d}.{part}"


def staging(dest: str, digest: str) -> Objects:
    """The staging prefix of a build of `dest` (beside it, like a local build directory)."""
    return Objects(staging_url(dest, digest))


def scratch_dir(digest: str, token: str) -> Path:
    """This build's own local folder for tokenising shards before they are uploaded (under the node's
    object cache; `storage.scratch` holds it while the build runs and sweeps dead builds' folders)."""
    return ObjectCache.default().root / "builds" / f"{digest[:16]}-{token}"


def claim(dest: str, digest: str, owner: str) -> None:
    """Claim `dest` for this identity before any shard is written (`storage.claims.take_claim`)."""
    take_claim(dest, digest, owner, what="token store")


def release(dest: str, digest: str, owner: str) -> None:
    """Release the claim on `dest` this build took (a clean failure: another identity may build there)."""
    release_claim(dest, digest, owner=owner)


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


def _published_here(dest: str, digest: str) -> bool:
    """Whether a store of this identity is published at `dest` (another build of it won the race)."""
    manifest = published_manifest(dest)
    return manifest is not None and manifest.get("identity_sha256") == digest


def _where(dest: str, digest: str, k: int, name: str) -> tuple[Objects, str]:
    """Where a shard's file lives: its data in the store, the rest in staging."""
    if name in _DATA:
        return Objects(dest), _shard_file(k, name)
    return staging(dest, digest), f"shard-{k:06d}/{name}"


def upload_shard(dest: str, digest: str, k: int, folder: Path, record: Mapping[str, Any]) -> None:
    """Upload finished shard `k` from its sealed local `folder`: data to the store, index parts and the
    record to staging, then the seal with the ETags the objects got. Nothing when a store of this identity
    was published meanwhile (the upload would only rewrite its bytes)."""
    store, stage = Objects(dest), staging(dest, digest)
    seal = read_seal(folder)
    if seal is None or set(seal) != {*_DATA, *_PARTS}:
        raise SnapshotError(f"{folder}: shard {k} is not sealed with its files; build it again")
    if store.info(MANIFEST) is not None and _published_here(dest, digest):
        return
    for name in (*_DATA, *_PARTS):
        objects, rel = _where(dest, digest, k, name)
        objects.put_file(rel, folder / name)
    staged = stage.list(f"shard-{k:06d}")
    etags = {name: (store.info(_shard_file(k, name)) or ObjectInfo(-1, None)).etag for name in _DATA}
    etags |= {name: staged[f"shard-{k:06d}/{name}"].etag for name in _PARTS}
    body = {"files": seal, "etags": etags, "rows": record["rows"]}
    stage.put_bytes(f"shard-{k:06d}/{SEAL}", json.dumps(body, sort_keys=True).encode())


def _staged_json(stage: Objects, staged: Mapping[str, ObjectInfo], rel: str) -> Any:
    info = staged.get(rel)
    if info is None or info.size > _MAX_STAGED_BYTES:
        return None
    try:
        return parse_json(stage.get(rel) or b"", rel)
    except ValueError:
        return None


def _object_digest(objects: Objects, rel: str, size: int) -> str:
    """The xxh3_128 of an object's bytes, streamed (a backend that gives no ETag)."""
    digest, step = xxhash.xxh3_128(), 32 << 20
    for start in range(0, size, step):
        digest.update(objects.get_range(rel, start, min(size, start + step)))
    return digest.hexdigest()


def _sealed_problem(dest: str, digest: str, k: int, body: Any, listings: Mapping[str, Any]) -> str | None:
    """What differs between shard `k`'s objects and its seal, or None."""
    if not isinstance(body, dict) or not isinstance(body.get("etags"), dict):
        return "no seal"
    seal = parse_seal(json.dumps(body.get("files")).encode())
    if seal is None or set(seal) != {*_DATA, *_PARTS}:
        return "a seal of other files"
    for name, entry in sorted(seal.items()):
        objects, rel = _where(dest, digest, k, name)
        info = listings[objects.url].get(rel)
        sealed_etag = body["etags"].get(name)
        if info is None or info.size != entry["bytes"]:
            return f"{objects.url_of(rel)} is missing or of another size"
        if sealed_etag and info.etag:
            if info.etag != sealed_etag:
                return f"{objects.url_of(rel)} was overwritten since it was uploaded (ETag {info.etag})"
        elif _object_digest(objects, rel, info.size) != entry["xxh3_128"]:
            return f"{objects.url_of(rel)}: its bytes changed since it was uploaded"
    return None


def _records(dest: str, digest: str, rows: Mapping[int, tuple[int, int]]) -> dict[int, dict[str, Any]]:
    """The records of the finished shards among `rows` (shard -> its row range) whose objects are all
    there as sealed (two listings, two small reads a finished shard); each with its ``seal``."""
    stage, store = staging(dest, digest), Objects(dest)
    staged = stage.list()
    listings = {stage.url: staged, store.url: store.list("shards")}
    out = {}
    for k, span in rows.items():
        body = _staged_json(stage, staged, f"shard-{k:06d}/{SEAL}")
        record = _staged_json(stage, staged, f"shard-{k:06d}/{RECORD}")
        if body is None or not isinstance(record, dict) or record.get("rows") != list(span):
            continue
        problem = _sealed_problem(dest, digest, k, body, listings)
        if problem is not None:
            _LOG.warning("shard %d of %s: %s; building it again", k, dest, problem)
            continue
        out[k] = {**record, "seal": body}
    return out


def finished_shards(dest: str, digest: str, rows: Mapping[int, tuple[int, int]]) -> set[int]:
    """Which shards of `rows` an earlier run finished and uploaded, unchanged since."""
    return set(_records(dest, digest, rows))


def publish(
    dest: str, digest: str, rows: Sequence[tuple[int, int]], *, fields: Mapping[str, Any], scratch: Path
) -> None:
    """Assemble the index of the uploaded shards (``rows[k]``: shard k's row range), upload it, write the
    manifest once, release the claim and remove the staging prefix; nothing but the tidying when another
    build of this identity published first. `SnapshotError` when a shard is missing or changed, or
    another store was published at `dest` meanwhile."""
    stage = staging(dest, digest)
    try:
        if not _published_here(dest, digest):
            _publish(dest, digest, rows, fields=fields, scratch=scratch)
    except SnapshotError:
        if not _published_here(dest, digest):  # not the race to the same bytes
            raise
    release_claim(dest, digest)
    stage.delete(stage.list())


def _publish(
    dest: str, digest: str, rows: Sequence[tuple[int, int]], *, fields: Mapping[str, Any], scratch: Path
) -> None:
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
            seal = records[k]["seal"]["files"]
            for part in _PARTS:
                data = stage.get(f"shard-{k:06d}/{part}")
                if data is None or xxhash.xxh3_128_hexdigest(data) != seal[part]["xxh3_128"]:
                    raise SnapshotError(f"{stage.url}: shard {k}'s {part} is gone or changed")
                (folder / part).write_bytes(data)
            dirs.append(folder)
        out = work / "store"
        out.mkdir()
        manifest = assemble_store(out, dirs, [records[k] for k in range(len(rows))], fields=fields,
                                  link_shards=False)  # fmt: skip
        for record in manifest["files"]:
            if not record["path"].startswith("shards/"):
                store.put_file(record["path"], out / record["path"])
        _check_uploaded(store, manifest, records)
        data = (out / MANIFEST).read_bytes()
        if store.create_once(MANIFEST, data):
            note_publication(dest)
        elif read_bounded(RemoteFiles(dest, cache=None), MANIFEST, "the manifest") != data:
            raise SnapshotError(f"{dest}: another store was published there while this one was built")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_uploaded(store: Objects, manifest: Mapping[str, Any], records: Mapping[int, Any]) -> None:
    """Every file of the manifest there with its size, every shard's data with its sealed ETag."""
    listed = store.list()
    sealed = {
        _shard_file(k, name): record["seal"]["etags"].get(name)
        for k, record in records.items()
        for name in _DATA
    }
    for record in manifest["files"]:
        info = listed.get(record["path"])
        etag = sealed.get(record["path"])
        if info is None or info.size != record["bytes"] or (etag and info.etag and etag != info.etag):
            raise SnapshotError(
                f"{store.url_of(record['path'])}: missing, of another size or overwritten before publication"
            )

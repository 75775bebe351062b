"""Building a VLM store on object storage (``output="s3://bucket/stores/vlm"``): the token store's
publication (`tokenize._remote_store`, ``docs/object-storage.md``) for a VLM store's shards.

Each rank builds its shards in the node's scratch folder and uploads each finished one: its token and mask
files to their final names (``<store>/tokens/shards/<k>.tokens``, ``.mask``), the rest of the shard folder
(the token shard's index parts and record, the image table parts) to the staging prefix
``<parent>/.<name>.build-<16 hex>/shard-<k>/``, its ``record.json`` last. Rank 0 downloads the staged parts
(not the tokens), assembles the store's index, image table and manifests locally exactly as a local build
(`formats.vlm_store.assemble_vlm_store`, its token files left where they are), uploads them, checks every
file of both manifests is there with its size, and writes ``manifest.json`` once (``If-None-Match: *``).
A reader looks for it first, so it sees a complete store or none; a killed build leaves none and its rerun
(any world size) keeps the shards whose records are staged. The bytes are a local build's.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.manifest import MANIFEST, parse_json
from puzzletron.dataset.formats.token_store import RECORD
from puzzletron.dataset.formats.vlm_store import assemble_vlm_store, read_complete_manifest
from puzzletron.dataset.storage.atomic import note_publication
from puzzletron.dataset.storage.claims import release_claim, take_claim
from puzzletron.dataset.storage.objects import Objects
from puzzletron.dataset.storage.remote import RemoteFiles
from puzzletron.dataset.tokenize._remote_store import scratch_dir, staging

__all__ = ["RemoteVlmStore", "scratch_dir"]

_ETAGS = "etags.json"

_DATA = {"tokens/tokens": "tokens", "tokens/mask": "mask"}  # shard files uploaded to their final names
_LAYOUT = re.compile(
    r"manifest\.json|media/[a-z_0-9]+\.(i64|u32|u64|u8|bin)|tokens/(manifest\.json|shards/\d{6}\.(tokens|mask)"
    r"|index/[a-z]+\.(i64|u32|u64|bin)|skipped/ids\.(bin|i64))"
)


def _final(k: int, part: str) -> str:
    return f"tokens/shards/{k:06d}.{part}"


class RemoteVlmStore:
    """The object-storage steps of one VLM store build at the URL `dest` (identity hash `digest`)."""

    def __init__(self, dest: str, digest: str) -> None:
        self.dest, self.digest = dest, digest
        self.store, self.stage = Objects(dest), staging(dest, digest)

    def published(self) -> dict[str, Any] | None:
        """The complete store's manifest at `dest`, None when nothing is published; `SnapshotError` when
        the prefix holds objects that are neither a VLM store's nor a killed build's shards."""
        source = RemoteFiles(self.dest, cache=None)
        listing = source.listing()
        if MANIFEST in listing:
            return read_complete_manifest(self.dest, source)
        strangers = [rel for rel in listing if not _LAYOUT.fullmatch(rel)]
        if strangers:
            raise SnapshotError(f"{self.dest}: the prefix holds objects that are not a VLM store's "
                                f"({strangers[:3]}); choose another output")  # fmt: skip
        return None

    def claim(self, owner: str) -> None:
        """Claim `dest` for this identity before any shard is written (`storage.claims.take_claim`)."""
        take_claim(self.dest, self.digest, owner, what="VLM store")

    def release(self, owner: str) -> None:
        """Release the claim this build took (after a clean failure)."""
        release_claim(self.dest, self.digest, owner=owner)

    def upload(self, k: int, folder: Path) -> None:
        """Upload finished shard `k` from `folder`: its token data to the store, the rest to staging, the
        ETags its token objects got, the record last."""
        for rel, part in _DATA.items():
            self.store.put_file(_final(k, part), folder / rel)
        parts = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        for rel in [p for p in parts if p not in _DATA and p != RECORD]:
            self.stage.put_file(f"shard-{k:06d}/{rel}", folder / rel)
        etags = {part: getattr(self.store.info(_final(k, part)), "etag", None) for part in _DATA.values()}
        self.stage.put_bytes(f"shard-{k:06d}/{_ETAGS}", json.dumps(etags, sort_keys=True).encode())
        self.stage.put_file(f"shard-{k:06d}/{RECORD}", folder / RECORD)

    def records(self, rows: Mapping[int, tuple[int, int]]) -> dict[int, dict[str, Any]]:
        """The records (a VLM shard's, its token shard's under ``tokens``) of the shards among `rows`
        (shard -> its row range) an earlier run finished: staged record, parts and token objects there."""
        staged, stored = self.stage.list(), self.store.list("tokens/shards")
        out = {}
        for k, span in rows.items():
            top, inner = self._record(staged, k, RECORD), self._record(staged, k, f"tokens/{RECORD}")
            if top is None or inner is None or [top.get("rows"), inner.get("rows")] != [list(span)] * 2:
                continue
            etags = self._record(staged, k, _ETAGS) or {}
            files = inner.get("files") or {}
            for part in _DATA.values():
                info, want = stored.get(_final(k, part)), (files.get(part) or {}).get("bytes")
                if (
                    info is None
                    or info.size != want
                    or (etags.get(part) and info.etag not in (None, etags[part]))
                ):
                    break  # missing, cut, or overwritten since it was uploaded (another ETag): built again
            else:
                out[k] = top | {"tokens": inner}
        return out

    def _record(self, staged: Mapping[str, Any], k: int, rel: str) -> dict[str, Any] | None:
        name = f"shard-{k:06d}/{rel}"
        try:
            value = parse_json(self.stage.get(name), name) if name in staged else None
        except (ValueError, TypeError):
            return None
        return value if isinstance(value, dict) else None

    def publish(
        self, rows: Sequence[tuple[int, int]], *, fields: Mapping[str, Any], token_fields: Mapping[str, Any],
        scratch: Path,
    ) -> None:  # fmt: skip
        """Assemble the uploaded shards' index and image table, upload them, write the manifest once and
        remove the staging prefix; `SnapshotError` for a missing shard or another store published here."""
        records = self.records(dict(enumerate(rows)))
        missing = [k for k in range(len(rows)) if k not in records]
        if missing:
            raise SnapshotError(
                f"{self.dest}: shards {missing[:8]} are missing after every rank built its own"
            )
        scratch.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="publish-", dir=scratch))
        try:
            staged, dirs = self.stage.list(), []
            for k in range(len(rows)):
                prefix = f"shard-{k:06d}/"
                for name in (n for n in staged if n.startswith(prefix)):
                    target = work / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(self.stage.get(name) or b"")
                dirs.append(work / prefix.rstrip("/"))
            out = work / "store"
            out.mkdir()
            manifest = assemble_vlm_store(out, dirs, [records[k] for k in range(len(rows))], fields=fields,
                                          token_fields=token_fields, link_shards=False)  # fmt: skip
            self._upload_and_publish(out, manifest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        release_claim(self.dest, self.digest)
        self.stage.delete(self.stage.list())

    def _upload_and_publish(self, out: Path, manifest: Mapping[str, Any]) -> None:
        inner = json.loads((out / "tokens" / MANIFEST).read_text())
        files = {r["path"]: r["bytes"] for r in manifest["files"]}
        files |= {f"tokens/{r['path']}": r["bytes"] for r in inner["files"]}
        for rel in files:
            if not rel.startswith("tokens/shards/"):
                self.store.put_file(rel, out / rel)
        listed = self.store.list()
        wrong = [rel for rel, size in files.items() if listed.get(rel) is None or listed[rel].size != size]
        if wrong:
            raise SnapshotError(f"{self.dest}: {wrong[:3]} missing or of another size before publication")
        data = (out / MANIFEST).read_bytes()
        if self.store.create_once(MANIFEST, data):
            note_publication(self.dest)
        elif self.store.get(MANIFEST) != data:
            raise SnapshotError(f"{self.dest}: another store was published there while this one was built")

"""Build (or reuse) the VLM store of a conversation subset under a processor: on one machine and on many.

    path = build_vlm_store("subsets/vlm", processor="qwen2_5_vl/", cache_dir="stores", num_proc=8)
    store = VlmStore(path)           # puzzletron.dataset.formats.vlm_store

Every sample is rendered with the processor's chat template and tokenised without opening an image (the
tokenizer renders one ``<|image_pad|>`` per image); each placeholder is then repeated by the image's token
count, from the grid its size gives (`GridConfig.grids`, exactly the image processor's ``smart_resize``),
so the ids, the assistant mask and the image tokens equal ``processor.apply_chat_template(...,
tokenize=True, return_assistant_tokens_mask=True)`` of the sample. Image sizes and SHA-256s come from the
subset's manifest; no pixel is decoded and none is stored.

A row is skipped and counted (with its reason, ``SKIP_REASONS``) when it has no supervised label, when its
text holds a literal image or video placeholder (``<|image_pad|>`` typed by a user would become an image
token the processor then miscounts), or when an image's aspect ratio is over 200 (the image processor
refuses it). A template that renders another number of placeholders than a sample has images is an error
naming the row.

Identity (`vlm_store_identity`): the subset's manifest (which holds every file's SHA-256), the processor's
files (tokenizer, chat template, image-processor config with its pixel limits) and ``rows_per_shard``.
Building, reuse, the lock, resuming after a kill, worker processes and `torch.distributed` ranks (rank
``r`` builds shards ``k % world == r``, the same bytes for any world size) are the token store's:
`puzzletron.dataset.tokenize._builder`.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset._checks import require_positive
from puzzletron.dataset.errors import ConfigError, ConversationError, SnapshotError
from puzzletron.dataset.formats.binary import ragged_arange
from puzzletron.dataset.formats.subset import SubsetReader, image_items, manifest_sha256, read_manifest
from puzzletron.dataset.formats.vlm_store import (
    SUBSET_PATH,
    VlmShardWriter,
    assemble_vlm_store,
    read_complete_manifest,
    read_vlm_shard_record,
    token_identity,
)
from puzzletron.dataset.storage.objects import is_url
from puzzletron.dataset.tokenize._builder import ShardedBuild, StoreFacts, run_build
from puzzletron.dataset.tokenize._chat_template import tokenize_batch
from puzzletron.dataset.tokenize._remote_vlm import RemoteVlmStore, scratch_dir
from puzzletron.dataset.tokenize._workers import advance
from puzzletron.dataset.tokenize.cache import cache_path
from puzzletron.dataset.tokenize.conversations import pad_token_id, select_rows
from puzzletron.dataset.tokenize.identity import identity_sha256, vlm_store_identity
from puzzletron.dataset.tokenize.processor import IMAGE_TOKEN, VIDEO_TOKEN, VlmProcessor, vlm_processor

__all__ = ["DEFAULT_ROWS_PER_SHARD", "build_vlm_store"]

DEFAULT_ROWS_PER_SHARD = 8192
_PLACEHOLDER, _ASPECT = 1, 2  # skip reasons (formats.vlm_store.SKIP_REASONS; 0: no supervised label)
# Per-process cache: (subset, SHA-256 of its manifest, which the store identity records) -> its image table;
# a manifest edited between two builds is read again.
_IMAGES: dict[tuple[str, str], _ImageTable] = {}


@dataclass(frozen=True)
class _ImageTable:
    """The subset manifest's images as arrays: sample ``i``'s are ``start[i] .. start[i + 1]``."""

    start: np.ndarray
    width: np.ndarray
    height: np.ndarray
    sha256: np.ndarray  # [m, 32] uint8
    paths: tuple[str, ...]


def _image_table(root: Path | str) -> _ImageTable:
    key = (str(root), str(manifest_sha256(root)))  # a folder or an URL
    if key not in _IMAGES:
        manifest = read_manifest(root)  # every image file there with its recorded size
        records = sorted(manifest["images"], key=lambda r: (r["sample_index"], r["image_index"]))
        sample = np.fromiter((r["sample_index"] for r in records), np.int64, len(records))
        counts = np.bincount(sample, minlength=manifest["sample_count"])[: manifest["sample_count"]]
        digests = b"".join(bytes.fromhex(str(r.get("sha256") or "0" * 64)) for r in records)
        _IMAGES[key] = _ImageTable(
            start=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            width=np.fromiter((int(r["width"]) for r in records), np.int64, len(records)),
            height=np.fromiter((int(r["height"]) for r in records), np.int64, len(records)),
            sha256=np.frombuffer(digests, np.uint8).reshape(-1, 32),
            paths=tuple(str(r["path"]) for r in records),
        )
    return _IMAGES[key]


def _sample_id(index: int, sample: Mapping[str, Any]) -> str:
    source = sample.get("source")
    row = source.get("row_id") if isinstance(source, Mapping) else None
    return f"{index}:{row}" if row is not None else str(index)


def _has_placeholder(sample: Mapping[str, Any]) -> bool:
    """Whether any text of the conversation holds a literal image or video placeholder."""
    for turn in sample.get("conversation") or ():
        content = turn.get("content") if isinstance(turn, Mapping) else None
        texts = [content] if isinstance(content, str) else [
            item.get("text") for item in content or () if isinstance(item, Mapping)
        ]  # fmt: skip
        if any(isinstance(t, str) and (IMAGE_TOKEN in t or VIDEO_TOKEN in t) for t in texts):
            return True
    return False


@dataclass(frozen=True)
class _VlmBuild(ShardedBuild):
    subset: Path | str  # a folder or an URL
    dest: Path | str  # a folder or an URL (object storage: `_remote_vlm`)
    identity: dict[str, Any]
    digest: str
    processor: Any  # a directory path (workers load it once) or a processor object
    rows_per_shard: int
    batch_size: int
    what: str = "VLM store"
    token: str = field(default_factory=lambda: secrets.token_hex(6))  # this build's scratch and claim (URL)

    def complete(self) -> dict[str, Any]:
        return read_complete_manifest(self.dest)

    def prepare(self) -> StoreFacts:
        parts = vlm_processor(self.processor)
        table = _image_table(self.subset)  # checks the subset; cached for forked workers
        return StoreFacts(len(table.start) - 1, len(parts.tokenizer), pad_token_id(parts.tokenizer))

    def shard_record(self, directory: Path, rows: tuple[int, int]) -> dict[str, Any] | None:
        return read_vlm_shard_record(directory, rows)

    def write_shard(self, facts: StoreFacts, shard: int, directory: Path) -> dict[str, Any]:
        start, stop = self.shard_rows(facts)[shard]
        writer = VlmShardWriter(directory, facts.dtype)
        parts, table = vlm_processor(self.processor), _image_table(self.subset)
        with SubsetReader(self.subset) as reader:
            for a in range(start, stop, self.batch_size):
                _add_rows(writer, reader, table, parts, a, min(a + self.batch_size, stop))
                advance(min(a + self.batch_size, stop) - a)  # rows, as each batch is written
        return writer.finish(rows=(start, stop))

    def manifest_fields(self, facts: StoreFacts) -> dict[str, Any]:
        """The VLM manifest's fields, and (``tokens``) those of the token store in ``tokens/``."""
        processor = vlm_processor(self.processor).facts()
        tokens = super().manifest_fields(facts)
        inner = token_identity(self.identity)
        tokens |= {"identity": inner, "identity_sha256": identity_sha256(inner)}
        return {
            "identity": self.identity,
            "identity_sha256": self.digest,
            SUBSET_PATH: str(self.subset),  # where batches read its images by default (checked by SHA-256)
            "processor": processor,
            "built_with": tokens["built_with"],
            "tokens": tokens,
        }

    def assemble(
        self, tmp: Path, shard_dirs: list[Path], records: list[dict[str, Any]], fields: Mapping[str, Any]
    ) -> None:
        vlm = {k: v for k, v in fields.items() if k != "tokens"}
        assemble_vlm_store(tmp, shard_dirs, records, fields=vlm, token_fields=fields["tokens"])

    # object storage (`_remote_vlm`): shards uploaded as they finish, the manifest written once
    @property
    def _remote(self) -> RemoteVlmStore:
        return RemoteVlmStore(str(self.dest), self.digest)

    @property
    def build_dir(self) -> Path:
        return scratch_dir(self.digest, self.token) if self.remote else super().build_dir

    def claim(self) -> None:
        if self.remote:
            self._remote.claim(self.token)

    def release(self) -> None:
        if self.remote:
            self._remote.release(self.token)

    def keep_shard(self, shard: int, tmp: Path, record: Mapping[str, Any]) -> None:
        if not self.remote:
            return super().keep_shard(shard, tmp, record)
        self._remote.upload(shard, tmp)
        shutil.rmtree(tmp, ignore_errors=True)

    def finished_shards(self, facts: Any, shards: Sequence[int]) -> set[int]:
        rows = self.shard_rows(facts)
        if not self.remote:
            return super().finished_shards(facts, shards)
        return set(self._remote.records({k: rows[k] for k in shards}))

    def existing_identity(self) -> dict[str, Any] | None:
        found = self._remote.published() if self.remote else None
        return (found or {}).get("identity") if self.remote else super().existing_identity()

    def publish(self, facts: StoreFacts) -> None:
        if not self.remote:
            return super().publish(facts)
        fields = self.manifest_fields(facts)
        vlm = {k: v for k, v in fields.items() if k != "tokens"}
        self._remote.publish(
            self.shard_rows(facts), fields=vlm, token_fields=fields["tokens"], scratch=self.build_dir
        )


def _add_rows(
    writer: VlmShardWriter, reader: SubsetReader, table: _ImageTable, parts: VlmProcessor, a: int, b: int
) -> None:
    """Tokenise rows ``[a, b)`` of the subset and hand every row (kept or skipped, with its reason) to
    `writer`."""
    names, rows, convs = [], [], []
    reason = np.full(b - a, -1, dtype=np.int64)  # per row: -1 kept, else its SKIP_REASONS index
    for i in range(a, b):
        sample = reader.raw(i)
        names.append(_sample_id(i, sample))
        items = [item for _, item in image_items(sample)]
        first, stop = int(table.start[i]), int(table.start[i + 1])
        if [item.get("image") for item in items] != list(table.paths[first:stop]):
            raise SnapshotError(f"{reader.root}: sample {i}: its image items are not the manifest's images")
        if _has_placeholder(sample):
            reason[i - a] = _PLACEHOLDER
            continue
        rows.append(i)
        convs.append(sample.get("conversation") or [])
    rows_arr = np.asarray(rows, dtype=np.int64)
    img_first, img_stop = table.start[rows_arr], table.start[rows_arr + 1]
    n_images = img_stop - img_first
    image_idx = ragged_arange(img_first, n_images)  # [m] the rows' images, in order
    grid, refused = parts.grid.grids(table.width[image_idx], table.height[image_idx])
    ids, mask, offsets = tokenize_batch(convs, parts.tokenizer, first_row=a) if convs else (
        np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(1, np.int64)
    )  # fmt: skip
    lengths = np.diff(offsets)
    row_of = np.repeat(np.arange(len(rows)), lengths)
    is_pad = ids == parts.image_token_id
    rendered = np.bincount(row_of[is_pad], minlength=len(rows))
    if not np.array_equal(rendered, n_images):
        r = int(np.flatnonzero(rendered != n_images)[0])
        raise ConversationError(
            f"row {rows[r]}: the chat template renders {int(rendered[r])} {IMAGE_TOKEN} placeholders for "
            f"{int(n_images[r])} images; the VLM store needs one placeholder per image item"
        )
    reps = np.ones(ids.size, dtype=np.int64)
    reps[is_pad] = parts.grid.tokens(grid)
    ids, mask, row_of = np.repeat(ids, reps), np.repeat(mask, reps), np.repeat(row_of, reps)
    lengths = np.bincount(row_of, minlength=len(rows)).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    seen = np.concatenate([np.zeros(1, np.int64), np.cumsum(mask, dtype=np.int64)])
    supervised = seen[offsets[1:]] - seen[np.minimum(offsets[:-1] + 1, offsets[1:])]
    image_rows = np.repeat(np.arange(len(rows)), n_images)
    aspect = np.bincount(image_rows[refused], minlength=len(rows)) > 0
    keep = (supervised > 0) & ~aspect
    reason[rows_arr - a] = np.where(aspect, _ASPECT, np.where(keep, -1, 0))
    kept = np.flatnonzero(keep)
    every = np.zeros(b - a, dtype=np.int64)  # every row's supervised labels (0: skipped)
    every[rows_arr[kept] - a] = supervised[kept]
    media_end = np.zeros(len(rows), dtype=np.int64)
    where = np.flatnonzero(ids == parts.image_token_id)
    media_end[row_of[where]] = where - offsets[row_of[where]] + 1  # ascending: the last image token wins
    (kept_ids, kept_mask), _ = select_rows((ids, mask), offsets, kept)
    kept_images = keep[image_rows]
    writer.add(
        kept_ids,
        kept_mask,
        lengths=lengths[kept],
        sample_ids=names,
        supervised=every,
        reasons=reason[reason >= 0],
        images=n_images[kept],
        media_end=media_end[kept],
        grid=grid[kept_images],
        image_tokens=parts.grid.tokens(grid[kept_images]),
        paths=[table.paths[j] for j in image_idx[kept_images].tolist()],
        sha256=table.sha256[image_idx[kept_images]],
    )


def build_vlm_store(
    subset: str | Path,
    *,
    processor: str | Path | Any,
    output: str | Path | None = None,
    cache_dir: str | Path | None = None,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    num_proc: int = 1,
    batch_size: int = 256,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Build or reuse the VLM store of the subset at `subset` under `processor` (an HF processor object or
    a local processor directory); its path (see the module docstring).

    Exactly one of ``output`` (the store directory) and ``cache_dir`` (the store goes to
    ``cache_dir/<first 16 hex digits of its identity hash>`` unless a store of this identity is found
    anywhere under it: `puzzletron.dataset.tokenize.cache`). ``rows_per_shard`` (part of the identity);
    ``num_proc`` worker processes per rank; ``batch_size`` rows rendered at a time; ``progress(done,
    total)`` with rows of this rank's shards as they finish. A complete store of the same identity is
    reused without loading the processor or reading a sample.
    """
    if (output is None) == (cache_dir is None):
        raise ConfigError("give exactly one of output (the store directory) and cache_dir")
    num_proc = require_positive(num_proc, "num_proc", error=ConfigError)
    batch_size = require_positive(batch_size, "batch_size", error=ConfigError)
    rows_per_shard = require_positive(rows_per_shard, "rows_per_shard", error=ConfigError)
    root: Path | str = str(subset).rstrip("/") if is_url(subset) else Path(os.path.abspath(subset))
    identity = vlm_store_identity(root, processor=processor, rows_per_shard=rows_per_shard)
    digest = identity_sha256(identity)
    dest: Path | str
    if output is not None:
        dest = str(output).rstrip("/") if is_url(output) else Path(os.path.abspath(output))
    else:  # a VLM store of this identity anywhere under the cache directory, else at its hash
        found = cache_path(cache_dir, identity, complete=read_complete_manifest)
        dest = found if isinstance(found, str) else Path(found)
    proc = str(processor) if isinstance(processor, str | Path) else processor  # workers load a path once
    build = _VlmBuild(root, dest, identity, digest, proc, rows_per_shard, batch_size)
    run_build(build, num_proc=num_proc, progress=progress)
    return dest  # type: ignore[return-value]

"""Write an offline conversation subset: stream samples into a transaction directory, publish atomically.

The format: ``docs/subset-format.md``. Writes go through `_atomic`: a destination either does not exist or
holds a complete subset; a complete subset already there is reused.
"""

from __future__ import annotations

import array
import copy
import hashlib
import json
import logging
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from puzzletron.dataset._checks import require_int
from puzzletron.dataset.conversation import validate_conversation
from puzzletron.dataset.conversation.images import encode_image
from puzzletron.dataset.errors import ConfigError, SnapshotError
from puzzletron.dataset.formats.manifest import MANIFEST, require_same_acquisition, sha256_file
from puzzletron.dataset.formats.media_shards import (
    DEFAULT_SHARD_BYTES,
    MAX_SHARD_BYTES,
    MIN_SHARD_BYTES,
    MediaShardWriter,
)
from puzzletron.dataset.formats.subset._layout import (
    IDX_HEADER,
    IDX_MAGIC,
    IMAGES,
    INDEX,
    SAMPLES,
    SUBSET_FORMAT,
    SUBSET_FORMAT_VERSION,
    SUBSET_SHARDED_VERSION,
    canonical,
    dumps_line,
    label,
    little_endian,
)
from puzzletron.dataset.formats.subset.reader import read_manifest
from puzzletron.dataset.storage.atomic import check_destination, locked, staging_dir, tidy

__all__ = ["materialize_normalized_conversation_samples", "materialize_normalized_intersyn_samples"]

logger = logging.getLogger(__name__)


def _store_sample(
    tmp: Path, index: int, sample: Mapping[str, Any], table: IO[str], shards: MediaShardWriter | None
) -> tuple[bytes, int]:
    """Write sample `index`'s images under `tmp/images` (or into the media `shards`) and their manifest
    records (one JSON line each) to `table`; return the sample's `samples.jsonl` line (image items now hold
    relative paths: in shards, the images' names) and its image count. The caller's sample is not
    modified."""
    name = label(index, sample)
    validate_conversation(sample, where=name)
    stored = copy.deepcopy({key: v for key, v in sample.items() if key != "conversation"})
    stored["conversation"], k = [], 0
    for t, turn in enumerate(sample["conversation"]):
        content = []
        for c, item in enumerate(turn["content"]):
            if item.get("type") != "image":
                content.append(copy.deepcopy(dict(item)))
                continue
            encoded = encode_image(
                item["image"], where=f"{name} image {k} (conversation[{t}].content[{c}].image)"
            )
            rel = f"{IMAGES}/{index:06d}_{k:02d}{encoded.extension}"
            if shards is not None:
                shards.add(encoded.data, encoded.sha256)
            else:
                with open(tmp / rel, "xb") as fh:
                    fh.write(encoded.data)
            record = {
                "bytes": encoded.size,
                "format": encoded.format,
                "height": encoded.height,
                "image_index": k,
                "path": rel,
                "row_id": sample["source"]["row_id"],
                "sample_index": index,
                "sha256": encoded.sha256,
                "width": encoded.width,
            }
            table.write(dumps_line(canonical(record, f"{name} source.row_id")) + "\n")
            content.append({**copy.deepcopy({a: b for a, b in item.items() if a != "image"}), "image": rel})
            k += 1
        rest = copy.deepcopy({a: b for a, b in turn.items() if a != "content"})
        stored["conversation"].append({**rest, "content": content})
    try:
        return (dumps_line(stored) + "\n").encode("utf-8"), k
    except (TypeError, ValueError) as exc:
        raise SnapshotError(f"{name}: not JSON-serialisable apart from its images: {exc}") from exc


def _write_manifest(tmp: Path, manifest: Mapping[str, Any], image_table: Path) -> None:
    """Write `manifest` with sorted keys, splicing the image records of `image_table` in as ``images``
    (one record per line), without holding them all in memory."""
    placeholder = f"@images-{secrets.token_hex(16)}@"
    text = json.dumps({**manifest, "images": placeholder}, sort_keys=True, indent=2, ensure_ascii=False)
    head, tail = text.split(json.dumps(placeholder))
    with open(tmp / MANIFEST, "x", encoding="utf-8") as fh, open(image_table, encoding="utf-8") as table:
        fh.write(head)
        first = True
        for line in table:
            fh.write(("[\n    " if first else ",\n    ") + line.rstrip("\n"))
            first = False
        fh.write("[]" if first else "\n  ]")
        fh.write(tail + "\n")


def _write_subset(
    tmp: Path,
    samples: Iterable[Mapping[str, Any]],
    *,
    acquisition: Any,
    diagnostics: Mapping[str, Any] | None,
    expected_count: int | None,
    output_dir: Path,
    shard_bytes: int | None,
) -> None:
    """Stream `samples` into the transaction directory `tmp` (the images into media shards of
    `shard_bytes` when it is given).

    One sample at a time: its images go to `images/`, its line to `samples.jsonl`, its image records to a
    temporary table (spliced into the manifest at the end), its line offset and source group to arrays that
    become `samples.idx`. Memory is O(samples) for the two arrays (12 bytes a sample), never the samples.
    """
    shards = MediaShardWriter(tmp, shard_bytes) if shard_bytes is not None else None
    if shards is None:
        (tmp / IMAGES).mkdir()
    offsets = array.array("Q", [0])
    group_ids: dict[tuple[str, str], int] = {}
    groups = array.array("I")
    image_count = 0
    samples_digest = hashlib.sha256()
    image_table = tmp / f".images-{secrets.token_hex(4)}.jsonl"
    with open(tmp / SAMPLES, "xb") as out, open(image_table, "x", encoding="utf-8") as table:
        for index, sample in enumerate(samples):
            line, images = _store_sample(tmp, index, sample, table, shards)
            if shards is not None:
                shards.end_sample()
            out.write(line)
            samples_digest.update(line)
            offsets.append(offsets[-1] + len(line))
            key = (sample["source"]["dataset"], sample["source"]["revision"])
            groups.append(group_ids.setdefault(key, len(group_ids)))
            image_count += images
    sample_count = len(groups)
    if expected_count is not None and sample_count < expected_count:
        raise SnapshotError(
            f"{output_dir}: the samples ran out after {sample_count} of the expected {expected_count}; "
            "nothing was published"
        )
    # Read only now: the caller's generator fills `diagnostics` while we stream.
    diagnostics = canonical(diagnostics, "diagnostics")
    with open(tmp / INDEX, "xb") as fh:
        fh.write(IDX_HEADER.pack(IDX_MAGIC, sample_count, len(group_ids)))
        fh.write(little_endian(offsets).tobytes())
        fh.write(little_endian(groups).tobytes())
    manifest: dict[str, Any] = {
        "format": SUBSET_FORMAT,
        "version": SUBSET_FORMAT_VERSION if shards is None else SUBSET_SHARDED_VERSION,
        "sample_count": sample_count,
        "image_count": image_count,
        "sources": [{"dataset": d, "revision": r} for d, r in sorted(group_ids)],
        "samples": {"path": SAMPLES, "bytes": offsets[-1], "sha256": samples_digest.hexdigest()},
        "index": {"path": INDEX, "bytes": (tmp / INDEX).stat().st_size, "sha256": sha256_file(tmp / INDEX)},
    }
    if shards is not None:
        manifest["media"] = shards.finish()
    if acquisition is not None:
        manifest["acquisition"] = acquisition
    if diagnostics is not None:
        manifest["diagnostics"] = diagnostics
    _write_manifest(tmp, manifest, image_table)
    image_table.unlink()


def _reuse(destination: Path, wanted: Any, expected_count: int | None) -> dict[str, Any]:
    """The manifest of the complete subset at `destination`, if it is what the caller asks for."""
    try:
        manifest = read_manifest(destination)
    except SnapshotError as exc:
        raise SnapshotError(f"{destination} is not empty and holds no complete subset: {exc}") from exc
    if wanted is not None:
        require_same_acquisition(destination, manifest.get("acquisition"), wanted)
    if expected_count is not None and manifest["sample_count"] < expected_count:
        raise SnapshotError(
            f"{destination} holds {manifest['sample_count']} samples, "
            f"fewer than the expected {expected_count}"
        )
    logger.info("reusing the complete subset at %s", destination)
    tidy(destination)
    return manifest


def _occupied(destination: Path) -> bool:
    """Anything at `destination` but an empty directory (which a publication may replace)."""
    return destination.exists() and not (destination.is_dir() and not any(destination.iterdir()))


def materialize_normalized_conversation_samples(
    samples: Iterable[Mapping[str, Any]],
    output_dir: str | Path,
    *,
    acquisition: Mapping[str, Any] | None = None,
    diagnostics: Mapping[str, Any] | None = None,
    expected_count: int | None = None,
    media: str = "files",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> dict[str, Any]:
    """Stream normalized conversations into an atomically published offline subset.

    ``media="files"`` writes one file per image (version 2); ``"shards"`` writes the images into media
    shards of about `shard_bytes` (version 3, ``docs/media-shard-format.md``): what object storage and
    parallel file systems want at scale.

    Returns the manifest. `output_dir` ends up absent or complete: a failure (bad sample, shortfall against
    `expected_count`, a kill) publishes nothing. A complete subset already there is reused (its manifest is
    returned) unless `acquisition` is given and differs; a non-empty directory holding no complete subset is
    an error. Concurrent callers serialise on a lock: one writes, the others reuse. Reusing takes no lock and
    writes nothing, so a complete subset on a read-only file system is reused. The samples are the caller's:
    their local image paths are read (``docs/trust-model.md``).
    """
    if expected_count is not None:
        require_int(expected_count, "expected_count", minimum=1, error=SnapshotError)
    if media not in ("files", "shards"):
        raise ConfigError(f"media must be 'files' or 'shards'; got {media!r}")
    shard_bytes = require_int(shard_bytes, "shard_bytes", minimum=MIN_SHARD_BYTES, maximum=MAX_SHARD_BYTES,
                              error=ConfigError)  # fmt: skip
    destination = check_destination(output_dir)  # absolute: "." is replaced by the rename; read it by name
    wanted = canonical(acquisition, "acquisition")
    if _occupied(destination):  # published subsets are complete: reading one needs no lock (read-only mounts)
        return _reuse(destination, wanted, expected_count)
    with locked(destination):
        if _occupied(destination):  # another writer published it while we waited
            return _reuse(destination, wanted, expected_count)
        with staging_dir(destination) as tmp:
            _write_subset(
                tmp,
                samples,
                acquisition=wanted,
                diagnostics=diagnostics,
                expected_count=expected_count,
                output_dir=destination,
                shard_bytes=shard_bytes if media == "shards" else None,
            )
        logger.info("published subset at %s", destination)
        return read_manifest(destination)


def materialize_normalized_intersyn_samples(
    samples: Sequence[Mapping[str, Any]], output_dir: str | Path
) -> dict[str, Any]:
    """Compatibility wrapper for the original InterSyn materializer."""
    return materialize_normalized_conversation_samples(samples, output_dir)

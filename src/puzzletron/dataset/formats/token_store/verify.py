"""Verify and describe a token store (``puzzletron-data verify`` / ``inspect`` dispatch here).

`verify_token_store` reads every byte: every file's size and SHA-256, every token id against the
vocabulary, every sample's supervision (at least one label) from the mask bits, and the index's
consistency (offsets from 0 by the lengths, shard ranges tiling samples, tokens and rows, id offsets, the
counts). It reports every problem and never raises for a damaged store. Memory: one shard's mask and one
chunk of the index at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from puzzletron.dataset.formats.manifest import VerifyReport, bytes_on_disk, human_size
from puzzletron.dataset.formats.shard_verify import verify_sharded
from puzzletron.dataset.formats.token_store import _layout as layout

__all__ = ["describe_token_store", "render_token_store", "verify_token_store"]


def verify_token_store(path: str | Path) -> VerifyReport:
    """Check a token store against its manifest, reading every byte (see the module docstring);
    ``sample_count`` is the manifest's samples, ``image_count`` is 0."""
    return verify_sharded(
        path,
        fmt=layout.TOKEN_STORE_FORMAT,
        what="token store",
        load=layout.load_store_manifest,
        expected_sizes=layout.expected_sizes,
        unsized={layout.IDS_BIN, layout.SKIPPED_BIN},
        within=layout.WITHIN,
    )


def describe_token_store(path: str | Path) -> dict[str, Any]:
    """What a token store's manifest says (counts, dtype, identity) and its size on disk."""
    root = Path(path).absolute()
    manifest = layout.load_store_manifest(root)
    return {
        "path": str(root),
        "format": layout.TOKEN_STORE_FORMAT,
        "format_version": manifest.get("version"),
        "counts": manifest.get("counts"),
        "token_dtype": manifest.get("token_dtype"),
        "vocab_size": manifest.get("vocab_size"),
        "pad_token_id": manifest.get("pad_token_id"),
        "rows_per_shard": manifest.get("rows_per_shard"),
        "identity": manifest.get("identity"),
        "identity_sha256": manifest.get("identity_sha256"),
        "bytes_on_disk": bytes_on_disk(root),
    }


def render_token_store(info: Mapping[str, Any]) -> list[str]:
    """`describe_token_store`'s summary as lines of text."""
    counts = info["counts"] if isinstance(info["counts"], Mapping) else {}
    snapshot = (info.get("identity") or {}).get("snapshot") or {}
    lines = [f"token store {info['path']} (format {info['format_version']})"]
    lines.append(
        f"samples      {counts.get('samples')} ({counts.get('skipped')} rows skipped of {counts.get('rows')})"
    )
    supervised = counts.get("supervised_tokens")
    lines.append(
        f"tokens       {counts.get('tokens')} {info['token_dtype']} ({supervised} supervised labels)"
    )
    lines.append(f"shards       {counts.get('shards')} of {info['rows_per_shard']} rows")
    if snapshot.get("source"):
        lines.append(
            f"source       {snapshot['source']} @ {snapshot.get('revision')} [{snapshot.get('split')}]"
        )
    lines.append(f"identity     {info['identity_sha256']}")
    lines.append(f"on disk      {human_size(info['bytes_on_disk'])} ({info['bytes_on_disk']} bytes)")
    return lines

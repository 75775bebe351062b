"""The text snapshot (``docs/text-snapshot-format.md``): Puzzle-KD splits saved by `datasets` plus a
manifest of every file's SHA-256. `snapshot` writes, checks and verifies one; `splits.open_split` is the one
place a split is found and opened."""

from __future__ import annotations

from puzzletron.dataset.formats.text_snapshot.snapshot import (
    TEXT_SNAPSHOT_FORMAT,
    TEXT_SNAPSHOT_KIND,
    TEXT_SNAPSHOT_VERSION,
    describe_text_snapshot,
    is_unnamed_text_snapshot,
    read_text_snapshot,
    render_text_snapshot,
    verify_text_snapshot,
    write_text_snapshot,
)
from puzzletron.dataset.formats.text_snapshot.splits import TextSplit, load_text_split, open_split

__all__ = [
    "TEXT_SNAPSHOT_FORMAT",
    "TEXT_SNAPSHOT_KIND",
    "TEXT_SNAPSHOT_VERSION",
    "TextSplit",
    "describe_text_snapshot",
    "is_unnamed_text_snapshot",
    "load_text_split",
    "open_split",
    "read_text_snapshot",
    "render_text_snapshot",
    "verify_text_snapshot",
    "write_text_snapshot",
]

"""Every error `puzzletron.dataset` raises, in one small hierarchy.

Each is a `PuzzletronDataError` and also the builtin a caller would naturally catch: `ValueError` for bad
input (batches, configs, rows, snapshots, packing), `RuntimeError` for a Hub or mirror that fails to serve.
A command line catches `PuzzletronDataError` (plus `OSError`) and nothing broader.
"""

from __future__ import annotations

__all__ = [
    "AcquisitionError",
    "BatchValidationError",
    "ConfigError",
    "ConversationError",
    "ImageError",
    "PackingError",
    "PuzzletronDataError",
    "SnapshotError",
    "SubsetError",
]


class PuzzletronDataError(Exception):
    """Root of every error raised by `puzzletron.dataset`."""


class BatchValidationError(PuzzletronDataError, ValueError):
    """A `PuzzletronBatch` (or an operation on one) got tensors that break the batch contract."""


class ConfigError(PuzzletronDataError, ValueError):
    """A `data:` config block, a spec or an option has a missing, unknown or out-of-range field."""


class ConversationError(PuzzletronDataError, ValueError):
    """A source row cannot be normalised into a conversation; the message names the row and field."""


class ImageError(ConversationError):
    """An image value cannot be decoded, is too large, or is a reference we may not fetch (URLs)."""


class SnapshotError(PuzzletronDataError, ValueError):
    """Something on disk (a conversation subset, a text snapshot, a token store) is missing, incomplete,
    tampered with, of an unknown format or version, or does not match the request."""


SubsetError = SnapshotError  # the name before every on-disk format shared one error


class PackingError(PuzzletronDataError, ValueError):
    """A sample cannot be packed or batched as asked (too long, empty, or a malformed length or row)."""


class AcquisitionError(PuzzletronDataError, RuntimeError):
    """Fetching from the Hub (or a mirror) failed; the message names source, revision and the fix."""

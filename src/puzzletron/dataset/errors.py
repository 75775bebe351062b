"""One small error hierarchy: every library error is a `PuzzletronDataError`, and the subclasses also
inherit the builtin a caller would naturally catch: `ValueError` for bad input (batches, configs, rows,
subsets), `RuntimeError` for a Hub or mirror that fails to serve. `packing.PackingError` (a `ValueError`)
joins the hierarchy from its own module."""

from __future__ import annotations

__all__ = [
    "AcquisitionError",
    "BatchValidationError",
    "ConfigError",
    "ConversationError",
    "ImageError",
    "PuzzletronDataError",
    "SubsetError",
]


class PuzzletronDataError(Exception):
    """Root of every error raised by `puzzletron.dataset`."""


class BatchValidationError(PuzzletronDataError, ValueError):
    """A `PuzzletronBatch` (or an operation on one) got tensors that break the batch contract."""


class ConfigError(PuzzletronDataError, ValueError):
    """A `data:` config block or a spec has a missing, unknown or out-of-range field."""


class ConversationError(PuzzletronDataError, ValueError):
    """A source row cannot be normalised into a conversation; the message names the row and field."""


class ImageError(ConversationError):
    """An image value cannot be decoded, is too large, or is a reference we may not fetch (URLs)."""


class SubsetError(PuzzletronDataError, ValueError):
    """An on-disk subset is missing, incomplete, tampered with or does not match the request."""


class AcquisitionError(PuzzletronDataError, RuntimeError):
    """Fetching from the Hub (or a mirror) failed; the message names source, revision and the fix."""

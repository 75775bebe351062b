"""Reuse of a snapshot published at an URL, decided from its manifest alone (no Hub request, no data read).

A materialiser writes local folders; ``materialize --output s3://...`` builds one in scratch and publishes it
(`storage.publish`). Before that, the manifest at the URL is compared with the request exactly as a local
reuse compares it (`_common.check_reusable`: with no revision asked for, the pinned one is kept, with no
network): the same acquisition is reused, another is refused, naming both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from puzzletron.dataset.errors import SnapshotError
from puzzletron.dataset.formats.manifest import parse_json, require_same_acquisition
from puzzletron.dataset.sources import hub as _hub
from puzzletron.dataset.sources._common import check_reusable
from puzzletron.dataset.sources.specs import TextAcquisitionSpec, VlmAcquisitionSpec
from puzzletron.dataset.storage.publish import published_manifest

__all__ = ["check_published", "published_snapshot"]


def published_snapshot(url: str) -> dict[str, Any] | None:
    """The manifest of the snapshot published at `url`, None when none is (no manifest there)."""
    data = published_manifest(url)
    if data is None:
        return None
    try:
        manifest = parse_json(data, "the manifest")
    except ValueError as exc:
        raise SnapshotError(f"{url}/manifest.json: {exc}") from exc
    if not isinstance(manifest, dict):
        raise SnapshotError(f"{url}/manifest.json: not a JSON object; no snapshot is published there")
    return manifest


def check_published(
    url: str,
    manifest: Mapping[str, Any],
    wanted: TextAcquisitionSpec | VlmAcquisitionSpec | Mapping[str, Any],
    *,
    revision_resolver: Callable[[str, str | None], str] = _hub.resolve_revision,
) -> None:
    """Raise `SnapshotError` unless the snapshot whose `manifest` is at `url` is what `wanted` asks for: a
    spec (compared as a local reuse compares it) or an acquisition mapping (InterSyn: compared whole)."""
    recorded = manifest.get("acquisition") or {}
    if isinstance(wanted, Mapping):
        require_same_acquisition(url, recorded, dict(wanted))
    else:
        check_reusable(recorded, wanted, revision_resolver, url)

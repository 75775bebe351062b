"""Nemotron-VLM: a bounded, row-proportional image-conversation subset over several subsets.

Per subset, rows come from ``<subset>/<subset>.jsonl`` in a seeded order and their images from the
``media/*.tar`` shards, joined by exact member name (``docs/sources.md``). Quotas by largest remainder
(`quotas`); rows round-robin, one per subset per pass; a subset that runs dry hands its deficit to the
others. The snapshot is a conversation subset (``docs/subset-format.md``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from puzzletron.dataset.conversation import normalize_nemotron_vlm_sample
from puzzletron.dataset.conversation.images import HUB_REFERENCE_REASON
from puzzletron.dataset.errors import AcquisitionError, ConfigError, ConversationError, SnapshotError
from puzzletron.dataset.formats.manifest import parse_json
from puzzletron.dataset.formats.subset.reader import read_manifest
from puzzletron.dataset.formats.subset.writer import materialize_normalized_conversation_samples
from puzzletron.dataset.sources import hub as _hub
from puzzletron.dataset.sources._common import RejectedRow, check_reusable, nonempty, progress, screen
from puzzletron.dataset.sources.quotas import largest_remainder_quotas, redistribute_deficit
from puzzletron.dataset.sources.specs import VlmAcquisitionSpec

__all__ = ["MAX_LINE_BYTES", "hub_vlm_rows", "materialize_nemotron_vlm_dataset"]

logger = logging.getLogger(__name__)

MAX_LINE_BYTES = 64 * 2**20  # a JSONL line longer than this is rejected unread (rows are bounded far below)


def _image_refs(row: Mapping[str, Any]) -> list[str]:
    refs: list[str] = []
    messages = row.get("messages")
    for turn in messages if isinstance(messages, list) else ():
        content = turn.get("content") if isinstance(turn, Mapping) else None
        if isinstance(content, str) or not isinstance(content, Sequence):
            continue
        for item in content:
            if isinstance(item, Mapping) and item.get("type") == "image":
                ref = item.get("image")
                if isinstance(ref, str):
                    refs.append(ref)
    return refs


def _jsonl_offsets(path: Path) -> list[int]:
    offsets, position = [], 0
    with open(path, "rb") as handle:
        for line in handle:
            if line.strip():
                offsets.append(position)
            position += len(line)
    return offsets


def _escapes(ref: str) -> bool:
    """A reference shaped like a path out of the download (absolute, ``..``, a NUL byte): Hub data naming
    local files. It gets the one uniform reason, like any other Hub image reference that does not resolve
    inside what was downloaded (``docs/trust-model.md``)."""
    return ref.startswith(("/", "\\")) or ".." in ref.replace("\\", "/").split("/") or "\x00" in ref


def _missing_images(missing: list[str], shards: int) -> str:
    """Why a row whose images are not in the media shards is rejected (stored in manifests: keep stable)."""
    if any(_escapes(ref) for ref in missing):
        return HUB_REFERENCE_REASON
    if shards:
        return f"image(s) {missing} not found in any of the {shards} tar shards"
    return (
        f"image(s) {missing} are external: the subset has no media shards "
        "(a JSONL-only subset whose references need the upstream media)"
    )


def check_subsets(source: str, revision: str, subsets: Sequence[str]) -> None:
    """`ConfigError` naming the subsets of ``source`` at ``revision`` (a ``<name>/<name>.jsonl`` each) when
    one of ``subsets`` is not among them (one listing of the repository, cached per commit)."""
    paths = [p.split("/") for p in _hub.list_files(source, revision, "*/*.jsonl")]
    known = sorted(parts[0] for parts in paths if len(parts) == 2 and parts[1] == f"{parts[0]}.jsonl")
    unknown = [name for name in subsets if name not in known]
    if unknown:
        raise ConfigError(
            f"unknown subset(s) {unknown} of {source}@{revision}; known: {', '.join(known) or 'none'}"
        )


def hub_vlm_rows(
    subset: str,
    *,
    source: str,
    revision: str,
    seed: int,
    quota: int,
    max_shards: int,
) -> Iterator[dict[str, Any] | RejectedRow]:
    """Rows of one Nemotron-VLM subset with their image joined (``row["image"] = {"bytes", "path"}``).

    Rows come in a seeded order (``random.Random(f"{seed}:{subset}")``). The subset's tar shards are
    taken in a seeded order, at most `max_shards`, and downloaded one at a time, only when the rows
    already reachable are used up; a row is yielded once every image it names is a member (exact name) of
    a shard read so far. Rows without image references are yielded as they come (the normaliser rejects
    them); once *every* shard of the subset has been read, a row whose image is still missing is a
    `RejectedRow`, and so is a line that is not a JSON object. `quota` is what the caller expects to take;
    the caller pulls lazily.
    """
    rng = random.Random(f"{seed}:{subset}")
    jsonl = _hub.download(source, f"{subset}/{subset}.jsonl", revision)
    shards = _hub.list_files(source, revision, f"{subset}/media/*.tar")
    all_shards = len(shards)
    rng.shuffle(shards)
    shards = shards[:max_shards]
    logger.info(
        "%s/%s: quota %d, reading up to %d of %d shard(s)", source, subset, quota, len(shards), all_shards
    )
    offsets = _jsonl_offsets(jsonl)
    rng.shuffle(offsets)
    members: dict[str, tuple[Path, tuple[int, int]]] = {}
    with open(jsonl, "rb") as handle:

        def parse(offset: int) -> dict[str, Any] | RejectedRow:
            handle.seek(offset)
            line = handle.readline(MAX_LINE_BYTES + 1)
            if len(line) > MAX_LINE_BYTES:  # not read further: far past any row's size bound
                return RejectedRow(f"{subset}@{offset}", f"the line is more than {MAX_LINE_BYTES} bytes")
            try:  # not UTF-8, not JSON, nested too deep: that row is rejected, the others go on
                row = parse_json(line, f"the line at byte {offset}")
            except ValueError as exc:
                return RejectedRow(f"{subset}@{offset}", str(exc))
            return row if isinstance(row, dict) else RejectedRow(f"{subset}@{offset}", "not a JSON object")

        pending: list[tuple[int, list[str] | None]] = [(offset, None) for offset in offsets]
        phases = max(len(shards), 1)
        for phase in range(phases):
            if phase < len(shards):
                local = _hub.download(source, shards[phase], revision)
                for name, span in _hub.tar_members(local).items():
                    members.setdefault(name, (local, span))
            final = phase == phases - 1 and len(shards) == all_shards
            waiting = []
            for offset, refs in pending:
                if refs is not None and not final and not all(ref in members for ref in refs):
                    waiting.append((offset, refs))  # still waiting: no need to parse the line again
                    continue
                row = parse(offset)
                if isinstance(row, RejectedRow):
                    yield row
                    continue
                refs = _image_refs(row) if refs is None else refs
                if refs and not all(ref in members for ref in refs):
                    if not final:
                        waiting.append((offset, refs))
                        continue
                    missing = [ref for ref in refs if ref not in members]
                    yield RejectedRow(row.get("id"), _missing_images(missing, all_shards))
                    continue
                if refs:
                    path, span = members[refs[0]]
                    row["image"] = {"bytes": _hub.read_member(path, span), "path": refs[0]}
                yield row
            pending = waiting


@dataclass
class _RoundRobin:
    """Round-robin over subsets, one accepted row per subset per pass, with deficit redistribution."""

    spec: VlmAcquisitionSpec
    revision: str
    loader: Callable[..., Iterable[Mapping[str, Any] | RejectedRow]]
    diagnostics: dict[str, Any]
    quotas: dict[str, int] = field(default_factory=dict)

    def _next_sample(self, subset: str, rows: Iterator[Any]) -> dict[str, Any] | None:
        def normalize(row: Any) -> dict[str, Any]:
            if not isinstance(row, Mapping):
                raise ConversationError(f"expected a row mapping, got {type(row).__name__}")
            return normalize_nemotron_vlm_sample(
                row, subset=subset, revision=self.revision, source=self.spec.source
            )

        for row in rows:
            sample, row_id, reason = screen(
                row, normalize, max_turn_bytes=self.spec.max_turn_bytes, max_row_bytes=self.spec.max_row_bytes
            )
            if sample is not None:
                return sample
            self.diagnostics["rejected_rows"].append({"subset": subset, "row_id": row_id, "reason": reason})
            logger.info("rejected %s row %r: %s", subset, row_id, reason)
        return None

    def _stream(self, subset: str, quota: int) -> Iterator[Any]:
        spec = self.spec
        return iter(
            self.loader(
                subset,
                source=spec.source,
                revision=self.revision,
                seed=spec.seed,
                quota=quota,
                max_shards=spec.max_shards_per_subset,
            )
        )

    def _run_dry(self, subset: str, targets: dict[str, int], taken: dict[str, int], dry: set[str]) -> None:
        """`subset` has no more usable rows: hand what it still owes to the live subsets."""
        dry.add(subset)
        deficit = targets[subset] - taken[subset]
        targets[subset] = taken[subset]
        live = [s for s in self.spec.subsets if s not in dry]
        extra = redistribute_deficit(dict(self.spec.subset_rows), taken, live, deficit)
        logger.info("%s ran dry %d row(s) short; redistributed %s", subset, deficit, extra)
        for name, rows in extra.items():
            targets[name] += rows
            self.diagnostics["redistributed_rows"][name] += rows

    def __iter__(self) -> Iterator[dict[str, Any]]:
        spec = self.spec
        targets = dict(self.quotas)
        taken = dict.fromkeys(spec.subsets, 0)
        dry: set[str] = set()
        streams: dict[str, Iterator[Any]] = {}
        total = spec.num_samples
        while sum(taken.values()) < total:
            progressed = False
            for subset in spec.subsets:
                if subset in dry or taken[subset] >= targets[subset]:
                    continue
                if subset not in streams:
                    streams[subset] = self._stream(subset, targets[subset])
                sample = self._next_sample(subset, streams[subset])
                progressed = True
                if sample is None:
                    self._run_dry(subset, targets, taken, dry)
                    continue
                taken[subset] += 1
                self.diagnostics["materialized_rows"][subset] += 1
                progress("samples", 1, total)
                yield sample  # the caller writes it before asking for the next one
            if not progressed or len(dry) == len(spec.subsets):
                break
        have = sum(taken.values())
        if have < total:
            raise AcquisitionError(
                f"{spec.source}@{self.revision}: only {have}/{total} usable rows across subsets "
                f"{list(spec.subsets)} (materialized {taken}, "
                f"{len(self.diagnostics['rejected_rows'])} rejected); "
                "raise max_shards_per_subset, add subsets, or ask for fewer samples"
            )


def _subset_acquisition(out: Path) -> dict[str, Any] | None:
    """The recorded acquisition of the complete conversation subset at `out`; None where there is nothing
    (absent or empty directory); `SnapshotError` for a non-empty directory without a complete subset."""
    if not nonempty(out):
        return None
    try:
        manifest = read_manifest(out)
    except SnapshotError as exc:
        raise SnapshotError(f"{out} is not empty and holds no complete subset: {exc}") from exc
    return dict(manifest.get("acquisition") or {})


def materialize_nemotron_vlm_dataset(
    spec: VlmAcquisitionSpec,
    *,
    sample_loader: Callable[..., Iterable[Mapping[str, Any] | RejectedRow]] | None = None,
    revision_resolver: Callable[[str, str | None], str] = _hub.resolve_revision,
    media: str = "files",
) -> dict[str, Any]:
    """Materialize a bounded, row-proportional Nemotron image-conversation subset.

    Quotas by largest remainder over `spec.subset_rows`; rows round-robin, one per subset per pass; a
    subset that runs dry hands its deficit to the others (`redistribute_deficit`); rows that fail
    normalisation, and `RejectedRow`s, are recorded and skipped. `sample_loader(subset, *, source,
    revision, seed, quota, max_shards)` yields raw rows with their ``image`` joined (or a `RejectedRow` in
    place of a row); the default is `hub_vlm_rows`. Returns the subset manifest, whose ``diagnostics``
    hold ``rejected_rows, requested_quotas, materialized_rows, redistributed_rows``. ``media="shards"``
    writes the images into media shards as they stream (``docs/media-shard-format.md``).
    """
    out = Path(spec.output_dir)
    recorded = _subset_acquisition(out)
    if recorded is not None:  # a complete subset is there: no network unless a revision must be resolved
        check_reusable(recorded, spec, revision_resolver, out)
        revision = str(recorded["revision"])
    else:
        revision = revision_resolver(spec.source, spec.revision)
    identity = spec.identity(revision=revision)
    quotas = largest_remainder_quotas(dict(spec.subset_rows), spec.num_samples)
    diagnostics: dict[str, Any] = {
        "requested_quotas": dict(quotas),
        "rejected_rows": [],
        "materialized_rows": dict.fromkeys(spec.subsets, 0),
        "redistributed_rows": dict.fromkeys(spec.subsets, 0),
    }
    if sample_loader is None and recorded is None:  # reuse makes no request: the subset names were checked
        check_subsets(spec.source, revision, spec.subsets)
    samples = _RoundRobin(spec, revision, sample_loader or hub_vlm_rows, diagnostics, quotas)
    return materialize_normalized_conversation_samples(
        iter(samples), out, acquisition=identity, diagnostics=diagnostics, expected_count=spec.num_samples,
        media=media,
    )  # fmt: skip

"""Bounded, pinned, offline snapshots of the Hub datasets the data stage trains on.

Three materialisers, one protocol:

1. If the output directory already holds a snapshot, compare identities (the spec's fields minus
   ``output_dir``, the adapter name and the pinned revision): identical -> return it as is; different ->
   ``ValueError("... does not match requested acquisition ...")``. With ``revision=None`` the snapshot's
   pinned revision is reused without any network call.
2. Otherwise resolve the revision to a commit sha (``None``/``"main"``/``"latest"`` -> current ``main``),
   then stream rows from the pinned revision, one whole shard at a time in a seeded order (mirrors ignore
   HTTP Range), stopping as soon as there are enough rows.
3. Write into a transaction directory and publish it with one rename: a failed or killed run leaves
   nothing at ``output_dir``.

Reuse is cheap (files present with their sizes); `verify_text_snapshot` (Puzzle-KD) and
`subset.verify_subset` (the image subsets) read every byte and check every SHA-256 and count. Two runs of
one spec give byte-identical trees; ``docs/acquisition.md`` says what that rests on.

Quotas (Nemotron-VLM) are a pure largest-remainder split of the sample count over the subset weights::

    largest_remainder_quotas({"a": 10, "b": 30}, 7)       == {"a": 2, "b": 5}
    largest_remainder_quotas({"a": 1, "b": 1, "c": 1}, 2) == {"a": 1, "b": 1, "c": 0}
"""

from __future__ import annotations

import fnmatch
import hashlib
import itertools
import json
import logging
import random
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import pyarrow as pa

from puzzletron.dataset import _hub
from puzzletron.dataset._atomic import locked, staging_dir
from puzzletron.dataset._images import encode_image
from puzzletron.dataset.conversation import (
    normalize_intersyn_multi,
    normalize_intersyn_single,
    normalize_nemotron_vlm_sample,
)
from puzzletron.dataset.errors import AcquisitionError, ConfigError, ConversationError, SubsetError
from puzzletron.dataset.subset import (
    VerifyReport,
    materialize_normalized_conversation_samples,
    read_manifest,
)

__all__ = [
    "INTERSYN_MULTI_REVISION",
    "INTERSYN_SINGLE_REVISION",
    "MANIFEST_NAME",
    "NEMOTRON_VLM_ADAPTER",
    "PUZZLE_KD_ADAPTER",
    "TextAcquisitionSpec",
    "VlmAcquisitionSpec",
    "hub_vlm_rows",
    "largest_remainder_quotas",
    "materialize_intersyn_subset",
    "materialize_nemotron_vlm_dataset",
    "materialize_puzzle_kd_dataset",
    "redistribute_deficit",
    "verify_text_snapshot",
]

logger = logging.getLogger(__name__)
_progress_logger = logging.getLogger(f"{__name__}.progress")

PUZZLE_KD_ADAPTER = "puzzle_kd_v2"
NEMOTRON_VLM_ADAPTER = "nemotron_vlm_v2"
INTERSYN_ADAPTER = "intersyn_v1"
INTERSYN_SINGLE_SOURCE = "finyorko/single_turn"
INTERSYN_SINGLE_REVISION = "59acf6773cd2bf5b485f37296e862216aa99516b"
INTERSYN_MULTI_SOURCE = "finyorko/multi-turn"
INTERSYN_MULTI_REVISION = "728987eff962e9df6f3da5ad5824a4accdd62bd2"
MANIFEST_NAME = "manifest.json"  # the Puzzle-KD snapshot manifest, written last
FORMAT_VERSION = 1


def _progress(stage: str, advance: int, total: int) -> None:
    """A DEBUG record a progress display may follow (the CLI turns these into tqdm bars)."""
    _progress_logger.debug(
        "%s: +%d of %d", stage, advance, total, extra={"progress": (stage, advance, total)}
    )


# ----------------------------------------------------------------------------------------------- specs


def _positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{owner}.{name} must be a positive integer, got {value!r}")


def _common_checks(spec: Any) -> None:
    owner = type(spec).__name__
    if not isinstance(spec.output_dir, str | Path) or not str(spec.output_dir):
        raise ConfigError(f"{owner}.output_dir must be a path, got {spec.output_dir!r}")
    object.__setattr__(spec, "output_dir", Path(spec.output_dir))
    if isinstance(spec.seed, bool) or not isinstance(spec.seed, int):
        raise ConfigError(f"{owner}.seed must be an integer, got {spec.seed!r}")
    if spec.revision is not None and (not isinstance(spec.revision, str) or not spec.revision.strip()):
        raise ConfigError(f"{owner}.revision must be None or a non-empty string, got {spec.revision!r}")
    if not isinstance(spec.source, str) or spec.source.count("/") != 1 or not all(spec.source.split("/")):
        raise ConfigError(f"{owner}.source must be a Hub dataset id 'org/name', got {spec.source!r}")


def _identity(spec: Any, adapter: str, revision: str) -> dict[str, Any]:
    if not isinstance(revision, str) or not revision:
        raise ConfigError(
            f"{type(spec).__name__}.identity: revision must be a resolved string, got {revision!r}"
        )
    out: dict[str, Any] = {"adapter": adapter}
    for f in fields(spec):
        if f.name != "output_dir":
            out[f.name] = getattr(spec, f.name)
    out["revision"] = revision
    return out


@dataclass(frozen=True, kw_only=True)
class TextAcquisitionSpec:
    """A bounded local snapshot of Puzzle-KD's two canonical splits."""

    output_dir: Path
    train_samples: int = 8192
    validation_samples: int = 1024
    seed: int = 408
    revision: str | None = None
    source: str = "nvidia/Puzzle-KD-Nemotron-Post-Training-Dataset-v2"

    def __post_init__(self) -> None:
        _common_checks(self)
        _positive_int("TextAcquisitionSpec", "train_samples", self.train_samples)
        _positive_int("TextAcquisitionSpec", "validation_samples", self.validation_samples)

    def identity(self, *, revision: str) -> dict[str, Any]:
        """The fields minus `output_dir`, plus ``adapter`` and the resolved `revision` (JSON-ready)."""
        return _identity(self, PUZZLE_KD_ADAPTER, revision)


@dataclass(frozen=True, kw_only=True)
class VlmAcquisitionSpec:
    """A bounded local image-conversation snapshot of Nemotron-VLM v2."""

    output_dir: Path
    subsets: tuple[str, ...] = ("sparsetables", "plotqa_cot", "wiki_en")
    subset_rows: tuple[tuple[str, int], ...] = ()
    num_samples: int = 512
    seed: int = 42
    max_shards_per_subset: int = 1
    revision: str | None = None
    source: str = "nvidia/Nemotron-VLM-Dataset-v2"

    def __post_init__(self) -> None:
        owner = "VlmAcquisitionSpec"
        _common_checks(self)
        _positive_int(owner, "num_samples", self.num_samples)
        _positive_int(owner, "max_shards_per_subset", self.max_shards_per_subset)
        if isinstance(self.subsets, str) or not isinstance(self.subsets, Sequence) or not self.subsets:
            raise ConfigError(f"{owner}.subsets must be a non-empty sequence of names, got {self.subsets!r}")
        subsets = []
        for name in self.subsets:
            if not isinstance(name, str) or not name.strip():
                raise ConfigError(f"{owner}.subsets: expected non-empty names, got {name!r}")
            if name.strip() in subsets:
                raise ConfigError(f"{owner}.subsets: {name.strip()!r} is listed twice")
            subsets.append(name.strip())
        object.__setattr__(self, "subsets", tuple(subsets))
        raw = self.subset_rows
        pairs = list(raw.items()) if isinstance(raw, Mapping) else list(raw)
        if not pairs:
            pairs = [(name, 1) for name in subsets]
        rows = []
        for pair in pairs:
            if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise ConfigError(f"{owner}.subset_rows: expected (name, weight) pairs, got {pair!r}")
            name, weight = pair
            _positive_int(owner, f"subset_rows[{name!r}]", weight)
            rows.append((str(name).strip(), weight))
        if [name for name, _ in rows] != subsets:
            raise ConfigError(
                f"{owner}.subset_rows must name exactly the subsets, in order: expected {subsets}, "
                f"got {[name for name, _ in rows]}"
            )
        object.__setattr__(self, "subset_rows", tuple(rows))

    def identity(self, *, revision: str) -> dict[str, Any]:
        """The fields minus `output_dir`, plus ``adapter`` and the resolved `revision` (JSON-ready:
        ``subsets`` as a list, ``subset_rows`` as a mapping)."""
        out = _identity(self, NEMOTRON_VLM_ADAPTER, revision)
        out["subsets"] = list(self.subsets)
        out["subset_rows"] = dict(self.subset_rows)
        return out


# ---------------------------------------------------------------------------------------------- quotas


def largest_remainder_quotas(weights: Mapping[str, int], total: int) -> dict[str, int]:
    """Split `total` over `weights` proportionally with integer parts, by largest remainder.

    Exact integer arithmetic (no floats); ties go to the earlier key. Every weight must be positive.

    >>> largest_remainder_quotas({"a": 10, "b": 30}, 7)
    {'a': 2, 'b': 5}
    >>> largest_remainder_quotas({"a": 1, "b": 1, "c": 1}, 2)
    {'a': 1, 'b': 1, 'c': 0}
    """
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ConfigError(f"total must be a non-negative integer, got {total!r}")
    names = list(weights)
    if not names:
        raise ConfigError("weights must name at least one key")
    if any(isinstance(w, bool) or not isinstance(w, int) or w <= 0 for w in weights.values()):
        raise ConfigError(f"weights must be positive integers, got {dict(weights)}")
    whole = sum(weights.values())
    quotas = {name: total * weights[name] // whole for name in names}
    left = total - sum(quotas.values())
    # remainder of name i is (total * w_i) mod W; sort by it descending, then by position
    order = sorted(range(len(names)), key=lambda i: (-(total * weights[names[i]] % whole), i))
    for i in order[:left]:
        quotas[names[i]] += 1
    return quotas


def redistribute_deficit(
    weights: Mapping[str, int], taken: Mapping[str, int], live: Sequence[str], deficit: int
) -> dict[str, int]:
    """Extra rows each `live` subset takes over when another runs dry `deficit` rows short: largest
    remainder over ``max(weight - taken, 1)`` so subsets furthest below their weight take the most."""
    if not live:
        return {}
    return largest_remainder_quotas({name: max(weights[name] - taken[name], 1) for name in live}, deficit)


# ------------------------------------------------------------------------------------ snapshot reuse


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SubsetError(f"{path}: unreadable snapshot manifest ({exc})") from exc


def _check_reusable(
    acquisition: Mapping[str, Any],
    spec: Any,
    identity_of: Callable[[str], dict[str, Any]],
    revision_resolver: Callable[[str, str | None], str],
    where: Path,
) -> None:
    """Raise unless the snapshot at `where` (recorded `acquisition`) is what `spec` asks for."""
    pinned = acquisition.get("revision")
    wanted = identity_of(str(pinned))
    differs = sorted(
        k for k in set(wanted) | set(acquisition) if k != "revision" and wanted.get(k) != acquisition.get(k)
    )
    if not differs and spec.revision is not None:
        revision = revision_resolver(spec.source, spec.revision)
        if revision != pinned:
            differs = ["revision"]
            wanted = identity_of(revision)
    if differs:
        detail = ", ".join(
            f"{k}: existing {acquisition.get(k)!r} vs requested {wanted.get(k)!r}" for k in differs
        )
        raise SubsetError(
            f"{where}: the existing snapshot does not match requested acquisition ({detail}); "
            "choose another output directory or delete this one"
        )


def _nonempty(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _resolve_revision(source: str, revision: str | None) -> str:
    """A commit sha for `revision` of the dataset `source` (see `_hub.resolve_revision`)."""
    return _hub.resolve_revision(source, revision)


# -------------------------------------------------------------------------------------------- Puzzle-KD


def _parquet_shards(source: str, revision: str, split: str) -> list[str]:
    patterns = _hub.split_patterns(source, revision).get(split) or [f"data/{split}-*.parquet"]
    files = _hub.list_files(source, revision)
    shards = sorted({f for f in files for p in patterns if _glob(f, p)})
    if not shards:
        raise AcquisitionError(
            f"{source}@{revision} on {_hub.endpoint()}: no parquet files for split {split!r} "
            f"(patterns {patterns}); check the source and revision"
        )
    return shards


def _glob(path: str, pattern: str) -> bool:
    """Whether the parquet file `path` is named by a ``data_files`` entry (a glob or a folder)."""
    if not path.endswith(".parquet"):
        return False
    return fnmatch.fnmatchcase(path, pattern) or path.startswith(pattern.rstrip("/") + "/")


def _hub_split_table(source: str, split: str, revision: str, seed: int, count: int) -> Any:
    """`count` rows of `split`, shuffled with `seed`: shards in a seeded order, row groups in a seeded
    order, rows shuffled within each; only the shards needed are downloaded."""
    rng = random.Random(seed)
    shards = _parquet_shards(source, revision, split)
    rng.shuffle(shards)
    parts, have = [], 0
    for shard in shards:
        path = _hub.download(source, shard, revision)
        for table in _hub.iter_parquet_tables(path, rng=rng):
            take = min(table.num_rows, count - have)
            parts.append(table.slice(0, take))
            have += take
            _progress(split, take, count)
            if have == count:
                return pa.concat_tables(parts).combine_chunks()
    raise AcquisitionError(
        f"{source}@{revision} split {split!r}: only {have}/{count} rows in {len(shards)} shard(s); "
        "ask for fewer samples"
    )


def _loader_table(
    loader: Callable[..., Iterable[Mapping[str, Any]]],
    source: str,
    split: str,
    revision: str,
    seed: int,
    count: int,
) -> Any:
    rows = [
        dict(r)
        for r in itertools.islice(iter(loader(source, split=split, revision=revision, seed=seed)), count)
    ]
    if len(rows) < count:
        raise AcquisitionError(
            f"{source}@{revision} split {split!r}: only {len(rows)}/{count} rows; ask for fewer samples"
        )
    return pa.Table.from_pylist(rows)


def _file_records(root: Path) -> list[dict[str, Any]]:
    """``[{path, bytes, sha256}]`` of every file under `root` but the manifest, sorted by path (POSIX)."""
    records = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
        rel = path.relative_to(root).as_posix()
        records.append({"path": rel, "bytes": path.stat().st_size, "sha256": _sha256_file(path)})
    return records


def _recorded_file(root: Path, record: Any) -> tuple[Path | None, str | None]:
    """The local path of one manifest file record, or a problem: malformed, outside `root`, missing or
    of another size. Cheap (no hashing): what reuse checks."""
    if not isinstance(record, Mapping) or not isinstance(record.get("path"), str):
        return None, f"{root / MANIFEST_NAME}: file record {record!r}; expected {{path, bytes, sha256}}"
    rel = record["path"]
    if rel.startswith("/") or ".." in rel.split("/"):
        return None, f"{root / MANIFEST_NAME}: file path {rel!r} leaves the snapshot"
    path = root / rel
    if not path.is_file():
        return None, f"{root}: {rel} is missing"
    size = path.stat().st_size
    if size != record.get("bytes"):
        return None, f"{root}: {rel} has {size} bytes, the manifest says {record.get('bytes')}"
    return path, None


def _split_files(root: Path, split: str) -> list[Path]:
    """The Arrow data files `datasets` listed in ``<split>/state.json``."""
    state = root / split / "state.json"
    try:
        return [root / split / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SubsetError(f"{state} is missing or unreadable ({exc})") from exc


def _check_complete_puzzle_kd(out: Path, manifest: Mapping[str, Any]) -> None:
    """Raise unless every file the manifest lists is there with its size (snapshots written before the
    manifest listed files: every split's data files are there)."""
    problems = []
    if "files" in manifest:
        for record in manifest["files"] or ():
            problems.append(_recorded_file(out, record)[1])
    else:
        for split in manifest.get("splits") or {}:
            try:
                problems += [f"{f} is missing" for f in _split_files(out, split) if not f.is_file()]
            except ValueError as exc:
                problems.append(str(exc))
    problems = [p for p in problems if p]
    if problems:
        raise SubsetError(f"{out}: incomplete Puzzle-KD snapshot: {'; '.join(problems[:5])}")


def _arrow_rows(path: Path) -> int:
    """Rows in one `datasets` Arrow file (an Arrow IPC stream), reading every record batch."""
    with pa.memory_map(str(path)) as source:
        return sum(batch.num_rows for batch in pa.ipc.open_stream(source))


def verify_text_snapshot(path: str | Path) -> VerifyReport:
    """Check a Puzzle-KD snapshot against its manifest: every file's size and SHA-256, and every split's
    row count (read from its Arrow files).

    Reads every byte; reports every problem (not just the first). ``sample_count`` is the rows found
    over all splits, ``image_count`` is 0 (a text snapshot). Never raises for a damaged snapshot.
    """
    root = Path(path).absolute()
    try:
        manifest = json.loads((root / MANIFEST_NAME).read_text())
    except (OSError, ValueError) as exc:
        return VerifyReport(str(root), 0, 0, (f"{root / MANIFEST_NAME}: unreadable ({exc})",))
    if not isinstance(manifest, dict) or not isinstance(manifest.get("splits"), dict):
        return VerifyReport(str(root), 0, 0, (f"{root / MANIFEST_NAME}: not a Puzzle-KD snapshot manifest",))
    problems: list[str] = []
    if "files" not in manifest:
        problems.append(
            f"{root / MANIFEST_NAME}: lists no files (written by an older version); rematerialise"
        )
    for record in manifest.get("files") or ():
        local, problem = _recorded_file(root, record)
        if problem:
            problems.append(problem)
        elif _sha256_file(local) != record.get("sha256"):  # type: ignore[arg-type]
            problems.append(f"{root}: {record['path']}: SHA-256 differs from the manifest")
    rows = 0
    for split, expected in manifest["splits"].items():
        try:
            found = sum(_arrow_rows(f) for f in _split_files(root, split))
        except (ValueError, OSError, pa.ArrowException) as exc:
            problems.append(f"{root}: split {split!r} unreadable: {exc}")
            continue
        rows += found
        if found != expected:
            problems.append(f"{root}: split {split!r} has {found} rows, the manifest says {expected}")
    return VerifyReport(str(root), rows, 0, tuple(problems))


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fingerprint(identity: Mapping[str, Any], split: str) -> str:
    blob = json.dumps({"identity": identity, "split": split}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def materialize_puzzle_kd_dataset(
    spec: TextAcquisitionSpec,
    *,
    dataset_loader: Callable[..., Iterable[Mapping[str, Any]]] | None = None,
    revision_resolver: Callable[[str, str | None], str] = _resolve_revision,
) -> dict[str, Any]:
    """Materialize bounded Puzzle-KD train/validation splits for offline tokenization.

    Writes ``output_dir/{train,validation}/`` (``datasets.save_to_disk``; ``datasets.load_from_disk``
    reads it back as a ``DatasetDict``) and ``output_dir/manifest.json`` =
    ``{version, acquisition, splits: {train: N, validation: M}, files: [{path, bytes, sha256}, ...]}``
    (every file of the ``save_to_disk`` output, sorted by path); returns the manifest. Reuse checks
    that the listed files are there with their sizes; `verify_text_snapshot` checks every SHA-256.
    ``train`` is shuffled with ``seed``, ``validation`` with ``seed + 1``. `dataset_loader(source, *,
    split, revision, seed)` may replace the Hub reader; it yields row mappings already in the order to
    keep.
    """
    out = Path(spec.output_dir)
    manifest_path = out / MANIFEST_NAME
    if manifest_path.is_file():
        manifest = _read_json(manifest_path)
        _check_complete_puzzle_kd(out, manifest)
        _check_reusable(
            manifest.get("acquisition", {}), spec, lambda r: spec.identity(revision=r), revision_resolver, out
        )
        logger.info("reusing Puzzle-KD snapshot at %s", out)
        return manifest
    if _nonempty(out):
        raise SubsetError(
            f"{out}: directory is not empty and holds no complete Puzzle-KD snapshot ({MANIFEST_NAME})"
        )
    revision = revision_resolver(spec.source, spec.revision)
    identity = spec.identity(revision=revision)
    with locked(out):
        if manifest_path.is_file():  # another process published it while we resolved
            return materialize_puzzle_kd_dataset(
                spec, dataset_loader=dataset_loader, revision_resolver=revision_resolver
            )
        import datasets

        with staging_dir(out) as tmp:
            splits = {}
            for split, count, seed in (
                ("train", spec.train_samples, spec.seed),
                ("validation", spec.validation_samples, spec.seed + 1),
            ):
                if dataset_loader is None:
                    table = _hub_split_table(spec.source, split, revision, seed, count)
                else:
                    table = _loader_table(dataset_loader, spec.source, split, revision, seed, count)
                ds = datasets.Dataset(
                    datasets.table.InMemoryTable(table), fingerprint=_fingerprint(identity, split)
                )
                splits[split] = ds
            quiet = not datasets.utils.are_progress_bars_disabled()
            if quiet:  # the library logs; progress bars are the CLI's business
                datasets.utils.disable_progress_bars()
            try:
                datasets.DatasetDict(splits).save_to_disk(str(tmp))
            finally:
                if quiet:
                    datasets.utils.enable_progress_bars()
            manifest = {
                "version": FORMAT_VERSION,
                "acquisition": identity,
                "splits": {name: len(ds) for name, ds in splits.items()},
                "files": _file_records(tmp),
            }
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    logger.info("published Puzzle-KD snapshot %s@%s at %s", spec.source, revision, out)
    return manifest


# ------------------------------------------------------------------------------------------ Nemotron-VLM


def _image_refs(row: Mapping[str, Any]) -> list[str]:
    refs = []
    for turn in row.get("messages") or []:
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


def hub_vlm_rows(
    subset: str,
    *,
    source: str,
    revision: str,
    seed: int,
    quota: int,
    max_shards: int,
) -> Iterator[dict[str, Any]]:
    """Rows of one Nemotron-VLM subset with their image joined (``row["image"] = {"bytes", "path"}``).

    Rows come in a seeded order (``random.Random(f"{seed}:{subset}")``). The subset's tar shards are
    taken in a seeded order, at most `max_shards`, and downloaded one at a time, only when the rows
    already reachable are used up; a row is yielded once every image it names is a member (exact name) of
    a shard read so far. Rows without image references are yielded as they come (the normaliser rejects
    them); once *every* shard of the subset has been read, rows whose image is still missing are yielded
    without ``image``. `quota` is what the caller expects to take; the caller pulls lazily.
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

        def parse(offset: int) -> dict[str, Any]:
            handle.seek(offset)
            line = handle.readline()
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                return {"id": f"{subset}@{offset}", "_error": f"invalid JSON at byte {offset}: {exc}"}
            return (
                row if isinstance(row, dict) else {"id": f"{subset}@{offset}", "_error": "not a JSON object"}
            )

        pending = [(offset, None) for offset in offsets]
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
                refs = _image_refs(row) if refs is None else refs
                if refs and not all(ref in members for ref in refs):
                    if not final:
                        waiting.append((offset, refs))
                        continue
                    row["_missing"] = [ref for ref in refs if ref not in members]
                    row["_shards"] = all_shards
                elif refs:
                    path, span = members[refs[0]]
                    row["image"] = {"bytes": _hub.read_member(path, span), "path": refs[0]}
                yield row
            pending = waiting


@dataclass
class _RoundRobin:
    """Round-robin over subsets, one accepted row per subset per pass, with deficit redistribution."""

    spec: VlmAcquisitionSpec
    revision: str
    loader: Callable[..., Iterable[Mapping[str, Any]]]
    diagnostics: dict[str, Any]
    quotas: dict[str, int] = field(default_factory=dict)

    def _next_sample(self, subset: str, rows: Iterator[Mapping[str, Any]]) -> dict[str, Any] | None:
        for row in rows:
            row_id = row.get("id") if isinstance(row, Mapping) else None
            reason = None
            if not isinstance(row, Mapping):
                reason = f"expected a row mapping, got {type(row).__name__}"
            elif row.get("_error"):
                reason = row["_error"]
            elif row.get("_missing"):
                if row.get("_shards"):
                    reason = f"image(s) {row['_missing']} not found in any of the {row['_shards']} tar shards"
                else:
                    reason = (
                        f"image(s) {row['_missing']} are external: the subset has no media shards "
                        "(a JSONL-only subset whose references need the upstream media)"
                    )
            if reason is None:
                try:
                    clean = {k: v for k, v in row.items() if k not in ("_missing", "_error", "_shards")}
                    sample = normalize_nemotron_vlm_sample(
                        clean, subset=subset, revision=self.revision, source=self.spec.source
                    )
                    _check_images(sample)
                    return sample
                except ConversationError as exc:
                    reason = _reason(exc)
            self.diagnostics["rejected_rows"].append({"subset": subset, "row_id": row_id, "reason": reason})
            logger.info("rejected %s row %r: %s", subset, row_id, reason)
        return None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        spec = self.spec
        weights = dict(spec.subset_rows)
        targets = dict(self.quotas)
        taken = dict.fromkeys(spec.subsets, 0)
        dry: set[str] = set()
        streams: dict[str, Iterator[Mapping[str, Any]]] = {}
        total = spec.num_samples
        while sum(taken.values()) < total:
            progressed = False
            for subset in spec.subsets:
                if subset in dry or taken[subset] >= targets[subset]:
                    continue
                if subset not in streams:
                    streams[subset] = iter(
                        self.loader(
                            subset,
                            source=spec.source,
                            revision=self.revision,
                            seed=spec.seed,
                            quota=targets[subset],
                            max_shards=spec.max_shards_per_subset,
                        )
                    )
                sample = self._next_sample(subset, streams[subset])
                if sample is None:
                    dry.add(subset)
                    deficit = targets[subset] - taken[subset]
                    targets[subset] = taken[subset]
                    live = [s for s in spec.subsets if s not in dry]
                    extra = redistribute_deficit(weights, taken, live, deficit)
                    logger.info("%s ran dry %d row(s) short; redistributed %s", subset, deficit, extra)
                    for name, rows in extra.items():
                        targets[name] += rows
                        self.diagnostics["redistributed_rows"][name] += rows
                    progressed = True
                    continue
                taken[subset] += 1
                self.diagnostics["materialized_rows"][subset] += 1
                progressed = True
                _progress("samples", 1, total)
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
    (absent or empty directory); `SubsetError` for a non-empty directory without a complete subset."""
    if not _nonempty(out):
        return None
    try:
        manifest = read_manifest(out)
    except SubsetError as exc:
        raise SubsetError(f"{out} is not empty and holds no complete subset: {exc}") from exc
    return dict(manifest.get("acquisition") or {})


def materialize_nemotron_vlm_dataset(
    spec: VlmAcquisitionSpec,
    *,
    sample_loader: Callable[..., Iterable[Mapping[str, Any]]] | None = None,
    revision_resolver: Callable[[str, str | None], str] = _resolve_revision,
) -> dict[str, Any]:
    """Materialize a bounded, row-proportional Nemotron image-conversation subset.

    Quotas by largest remainder over `spec.subset_rows`; rows round-robin, one per subset per pass; a
    subset that runs dry hands its deficit to the others (`redistribute_deficit`); rows that fail
    normalisation are recorded and skipped. `sample_loader(subset, *, source, revision, seed, quota,
    max_shards)` yields raw rows with their ``image`` joined; the default is `hub_vlm_rows`. Returns the
    subset manifest, whose ``diagnostics`` hold ``rejected_rows, requested_quotas, materialized_rows,
    redistributed_rows``.
    """
    out = Path(spec.output_dir)
    recorded = _subset_acquisition(out)
    if recorded is not None:  # a complete subset is there: no network unless a revision must be resolved
        _check_reusable(recorded, spec, lambda r: spec.identity(revision=r), revision_resolver, out)
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
    samples = _RoundRobin(spec, revision, sample_loader or hub_vlm_rows, diagnostics, quotas)
    return materialize_normalized_conversation_samples(
        iter(samples), out, acquisition=identity, diagnostics=diagnostics, expected_count=spec.num_samples
    )


# ---------------------------------------------------------------------------------------------- InterSyn


def _hub_parquet_rows(source: str, *, split: str, revision: str) -> Iterator[dict[str, Any]]:
    """Rows of `split` in file order (shards sorted, row groups in order); one shard downloaded at a time."""
    for shard in _parquet_shards(source, revision, split):
        path = _hub.download(source, shard, revision)
        for table in _hub.iter_parquet_tables(path):
            yield from table.to_pylist()


def _reason(exc: BaseException) -> str:
    """An error message fit for a manifest: no memory addresses (they would break byte-identical reruns)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(exc))


def _check_images(sample: dict[str, Any]) -> None:
    """Decode every image of `sample` fully, replacing each item's value with its `EncodedImage` (the
    materialiser stores that as it is, without decoding the image a second time); raise `ImageError` (a
    `ConversationError`) naming the row and image on the first defect."""
    where = f"{sample['source']['dataset']} row {sample['source'].get('row_id')!r}"
    index = 0
    for turn in sample["conversation"]:
        for item in turn["content"]:
            if item.get("type") == "image":
                item["image"] = encode_image(item["image"], where=f"{where} image {index}")
                index += 1


def _intersyn_samples(
    sources: Sequence[tuple[str, str, str, Callable[[Mapping[str, Any]], dict[str, Any]]]],
    rows_per_source: int,
    loader: Callable[..., Iterable[Mapping[str, Any]]],
    diagnostics: dict[str, Any],
) -> Iterator[dict[str, Any]]:
    for source, split, revision, normalize in sources:
        kept = 0
        for row in loader(source, split=split, revision=revision):
            row_id = row.get("id") if isinstance(row, Mapping) else None
            try:
                sample = normalize(row)
                _check_images(sample)
                reason = None
            except ConversationError as exc:
                reason = _reason(exc)
            if reason is not None:
                diagnostics["rejected_rows"].append({"dataset": source, "row_id": row_id, "reason": reason})
                continue
            sample["source"]["dataset"] = source
            sample["source"]["revision"] = revision
            kept += 1
            diagnostics["materialized_rows"][source] = kept
            _progress("samples", 1, 2 * rows_per_source)
            yield sample
            if kept == rows_per_source:
                break
        if kept < rows_per_source:
            raise AcquisitionError(
                f"{source}@{revision} split {split!r}: only {kept}/{rows_per_source} valid rows "
                f"({sum(r['dataset'] == source for r in diagnostics['rejected_rows'])} rejected); "
                "ask for fewer rows_per_source"
            )


def materialize_intersyn_subset(
    output_dir: str | Path,
    *,
    rows_per_source: int = 8,
    dataset_loader: Callable[..., Iterable[Mapping[str, Any]]] | None = None,
    single_turn_source: str = INTERSYN_SINGLE_SOURCE,
    single_turn_revision: str = INTERSYN_SINGLE_REVISION,
    multi_turn_source: str = INTERSYN_MULTI_SOURCE,
    multi_turn_revision: str = INTERSYN_MULTI_REVISION,
) -> dict[str, Any]:
    """Download once, validate, and cache the pinned 8+8 InterSyn acceptance set.

    Keeps the first `rows_per_source` rows of ``single_turn`` (split ``train``) and then of
    ``multi-turn`` (split ``multi``) that normalise and whose images decode; rejected rows go to the
    manifest's ``diagnostics``. A subset built with another `rows_per_source` (or other sources or
    revisions) is never returned: that is a ``ValueError``. `dataset_loader(source, *, split, revision)`
    may replace the Hub reader.
    """
    _positive_int("materialize_intersyn_subset", "rows_per_source", rows_per_source)
    sources = [
        (single_turn_source, "train", single_turn_revision, normalize_intersyn_single),
        (multi_turn_source, "multi", multi_turn_revision, normalize_intersyn_multi),
    ]
    acquisition = {
        "adapter": INTERSYN_ADAPTER,
        "rows_per_source": rows_per_source,
        "sources": [{"dataset": s, "split": sp, "revision": r} for s, sp, r, _ in sources],
    }
    out = Path(output_dir)
    recorded = _subset_acquisition(out)
    if recorded is not None and recorded != acquisition:
        raise SubsetError(
            f"{out}: the existing InterSyn subset does not match requested acquisition "
            f"(existing {recorded}, requested {acquisition}); choose another output directory"
        )
    diagnostics: dict[str, Any] = {
        "rejected_rows": [],
        "materialized_rows": {s: 0 for s, *_ in sources},
    }
    samples = _intersyn_samples(sources, rows_per_source, dataset_loader or _hub_parquet_rows, diagnostics)
    return materialize_normalized_conversation_samples(
        samples, out, acquisition=acquisition, diagnostics=diagnostics, expected_count=2 * rows_per_source
    )

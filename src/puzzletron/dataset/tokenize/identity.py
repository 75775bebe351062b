"""What a token store is built from (its identity) and the hash that names it.

The identity is a JSON-ready mapping of everything the tokens depend on, and nothing else (no path, no
time): the snapshot split's content (the SHA-256 of each of its files: from the text snapshot's manifest
when it has one, else hashed here), the tokenizer (the SHA-256 of each tokenizer file of a directory; for a
tokenizer object, of its backend JSON, chat template and special tokens), the tokenisation options and the
format version. Its SHA-256 (`identity_sha256`, over sorted compact JSON) names a store in a cache
directory (the first 16 hex digits); the same inputs always give the same hash, a changed tokenizer,
template, option or snapshot another.

>>> short_hash({"a": 1}) == short_hash({"a": 1}) != short_hash({"a": 2})
True
>>> identity_differences({"tokenizer": {"files": {"t.json": "ab"}}}, {"tokenizer": {"files": {"t.json": 1}}})
["tokenizer.files.t.json: 'ab' vs 1"]
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.formats.manifest import MANIFEST, canonical_sha256, sha256_file
from puzzletron.dataset.formats.subset import LEGACY_SAMPLES, SUBSET_FORMAT, manifest_sha256, subset_manifest
from puzzletron.dataset.formats.text_snapshot import TEXT_SNAPSHOT_FORMAT, TextSplit
from puzzletron.dataset.formats.token_store import TOKEN_STORE_FORMAT, TOKEN_STORE_VERSION
from puzzletron.dataset.formats.vlm_store import VLM_STORE_FORMAT, VLM_STORE_VERSION
from puzzletron.dataset.storage.objects import is_url
from puzzletron.dataset.storage.sources import open_source
from puzzletron.dataset.tokenize._chat_template import PINNED_DATE, uses_clock
from puzzletron.dataset.tokenize._content import directory_files
from puzzletron.dataset.tokenize.processor import VlmProcessor

__all__ = [
    "identity_differences",
    "identity_sha256",
    "processor_identity",
    "short_hash",
    "snapshot_identity",
    "store_identity",
    "subset_identity",
    "tokenizer_identity",
    "vlm_store_identity",
]


def identity_sha256(identity: Mapping[str, Any]) -> str:
    """The hex SHA-256 of `identity` as sorted, compact JSON (`formats.manifest.canonical_sha256`: what a
    store's reader checks ``identity_sha256`` against)."""
    return canonical_sha256(identity)


def short_hash(identity: Mapping[str, Any]) -> str:
    """The first 16 hex digits of `identity_sha256`: a store's directory name in a cache directory."""
    return identity_sha256(identity)[:16]


def snapshot_identity(split: TextSplit) -> dict[str, Any]:
    """The snapshot part of an identity: source, revision, split and the SHA-256 of each file of the split
    (a text snapshot's manifest supplies them after its completeness check; a plain ``save_to_disk``
    folder is hashed here)."""
    out: dict[str, Any] = {"split": split.split, "source": None, "revision": None}
    if split.manifest is not None and "files" in split.manifest:
        acquisition = split.manifest.get("acquisition") or {}
        out |= {"format": TEXT_SNAPSHOT_FORMAT, "rows": split.rows}
        out |= {"source": acquisition.get("source"), "revision": acquisition.get("revision")}
    out["files"] = split.file_hashes()
    return out


def _object_sha256(tokenizer: Any) -> str:
    """A stable hash of a tokenizer object: backend JSON (without its truncation and padding state, which
    encoding changes), chat template, special tokens and class."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec: Any = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
    else:
        spec = sorted(tokenizer.get_vocab().items())
    blob = {
        "class": type(tokenizer).__name__,
        "backend": spec,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special_tokens": tokenizer.special_tokens_map,
        "split_special_tokens": getattr(tokenizer, "split_special_tokens", False),
    }
    return identity_sha256(blob)


def tokenizer_identity(tokenizer: str | Path | Any) -> dict[str, Any]:
    """The tokenizer part of an identity: ``{"files": {name: sha256}}`` of a tokenizer directory's files
    (tokenizer JSON, configs, special tokens, chat templates, vocabularies), or ``{"object_sha256": ...}``
    of a tokenizer object; with ``"pinned_date"`` when its chat template calls ``strftime_now`` (rendered
    with that date, `_chat_template.PINNED_DATE`)."""
    if not isinstance(tokenizer, str | Path):
        out = {"class": type(tokenizer).__name__, "object_sha256": _object_sha256(tokenizer)}
        if uses_clock(getattr(tokenizer, "chat_template", None)):
            out["pinned_date"] = PINNED_DATE.isoformat()
        return out
    root = Path(tokenizer)
    if not root.is_dir():
        raise ConfigError(f"tokenizer {root} is not a directory (give a local tokenizer directory)")
    files = directory_files(root)
    if not files or set(files) == {"config.json"}:
        raise ConfigError(f"tokenizer directory {root} holds no tokenizer files (tokenizer.json, ...)")
    templates = (root / p for p in files if Path(p).name.startswith(("chat_template", "tokenizer_config")))
    if any(b"strftime_now" in p.read_bytes() for p in templates):
        return {"files": files, "pinned_date": PINNED_DATE.isoformat()}
    return {"files": files}


def processor_identity(processor: str | Path | Any) -> dict[str, Any]:
    """The processor part of a VLM store's identity: ``{"files": {name: sha256}}`` of a processor
    directory's tokenizer and processor files (tokenizer JSON and config, chat templates, the image
    processor's ``preprocessor_config.json`` with its pixel limits), or, for an object, the class and the
    hashes of its tokenizer (`tokenizer_identity`), chat template and image processor config."""
    if isinstance(processor, str | Path):
        root = Path(processor)
        if not root.is_dir():
            raise ConfigError(f"processor {root} is not a directory (give a local processor directory)")
        files = directory_files(root, processor=True)
        if "preprocessor_config.json" not in files:
            raise ConfigError(
                f"processor directory {root} has no preprocessor_config.json (the image processor)"
            )
        return {"files": files}
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None:
        raise ConfigError(f"processor {type(processor).__name__} has no tokenizer")
    image_processor = getattr(processor, "image_processor", None)
    template = getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
    config = image_processor.to_dict() if image_processor is not None else None
    return {
        "class": processor.name if isinstance(processor, VlmProcessor) else type(processor).__name__,
        "tokenizer": tokenizer_identity(tokenizer)["object_sha256"],
        "chat_template": identity_sha256({"template": template}),
        "image_processor": identity_sha256({"config": config}),
    }


def subset_identity(root: Path | str) -> dict[str, Any]:
    """The subset part of a VLM store's identity: the SHA-256 of its ``manifest.json`` (which records every
    file's SHA-256; an original-layout subset's ``samples.json`` is hashed too) and its counts. An URL's
    manifest is read through the object layer."""
    if is_url(root):
        source = open_source(str(root))
        manifest = subset_manifest(str(root), records=False, source=source)
        if "format" not in manifest:
            raise ConfigError(f"{root}: a subset of the original layout is read from a folder, not an URL")
        return {"format": SUBSET_FORMAT, "manifest_sha256": manifest_sha256(str(root)),
                "sample_count": manifest["sample_count"], "image_count": manifest["image_count"]}  # fmt: skip
    root = Path(root)
    manifest = subset_manifest(root, records=False)
    out = {
        "format": SUBSET_FORMAT,
        "manifest_sha256": sha256_file(root / MANIFEST),
        "sample_count": manifest["sample_count"],
        "image_count": manifest["image_count"],
    }
    if "format" not in manifest:
        out["samples_sha256"] = sha256_file(root / LEGACY_SAMPLES)
    return out


def vlm_store_identity(subset: Path | str, *, processor: Any, rows_per_shard: int) -> dict[str, Any]:
    """The identity of the VLM store of the subset at `subset` under `processor`."""
    return {
        "format": VLM_STORE_FORMAT,
        "version": VLM_STORE_VERSION,
        "subset": subset_identity(subset),
        "processor": processor_identity(processor),
        "options": {"rows_per_shard": int(rows_per_shard)},
    }


def store_identity(
    split: TextSplit, *, tokenizer: str | Path | Any, options: TokenizeOptions = TokenizeOptions()
) -> dict[str, Any]:
    """The identity of the token store of `split` (`open_split`) under `tokenizer` (see the module doc)."""
    return {
        "format": TOKEN_STORE_FORMAT,
        "version": TOKEN_STORE_VERSION,
        "snapshot": snapshot_identity(split),
        "tokenizer": tokenizer_identity(tokenizer),
        "options": options.identity(),
    }


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(value, Mapping):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out |= _flat(item, f"{prefix}.{key}" if prefix else str(key))
    return out


def identity_differences(recorded: Any, wanted: Any) -> list[str]:
    """``"key.path: recorded vs wanted"`` for every leaf that differs, sorted."""
    old, new = _flat(recorded), _flat(wanted)
    return [
        f"{k}: {old.get(k)!r} vs {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]

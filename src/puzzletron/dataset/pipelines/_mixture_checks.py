"""What a mixture checks before it plans: one tokenizer for every component, and where its plans live."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.formats.vlm_store import VlmStore
from puzzletron.dataset.pipelines._core import Component
from puzzletron.dataset.storage.object_cache import ObjectCache
from puzzletron.dataset.storage.objects import is_url
from puzzletron.dataset.tokenize.identity import identity_differences, tokenizer_identity

__all__ = ["check_tokenizers", "plan_folder", "tokenizer_facts"]

# What a tokenizer's ids depend on among a tokenizer or processor directory's files: the vocabulary, merges,
# special tokens, configuration and chat templates; not a model's config.json, not an image processor's.
_NOT_TOKENIZER = ("config.json", "preprocessor_config.json", "processor_config.json")


def tokenizer_facts(component: Component, tokenizer: Any = None) -> dict[str, Any]:
    """What a component's token ids depend on: vocabulary size, pad id and the tokenizer's files (or its
    object hash), from its store's manifest (``tokenizer``: what an in-memory component was tokenised
    with)."""
    store = component.store
    if store is None:
        return {"pad_token_id": component.pad_token_id, "tokenizer": _files(tokenizer_identity(tokenizer))}
    manifest = store.tokens.manifest if isinstance(store, VlmStore) else store.manifest
    identity = store.manifest["identity"]
    recorded = identity.get("processor" if isinstance(store, VlmStore) else "tokenizer") or {}
    if "files" not in recorded and "tokenizer" in recorded:  # a processor object's tokenizer hash
        recorded = {"object_sha256": recorded["tokenizer"]}
    return {
        "vocab_size": manifest["vocab_size"],
        "pad_token_id": manifest["pad_token_id"],
        "tokenizer": _files(recorded),
    }


def _files(identity: Mapping[str, Any]) -> dict[str, Any]:
    if "files" in identity:
        return {k: v for k, v in identity["files"].items() if k not in _NOT_TOKENIZER}
    return {"object_sha256": identity.get("object_sha256")}


def _where(name: str, component: Component) -> str:
    return f"{name!r} ({component.store.path})" if component.store is not None else f"{name!r} (in memory)"


def check_tokenizers(components: Mapping[str, Component], *, tokenizer: Any = None) -> None:
    """`ConfigError` naming both components unless every one was tokenised by the same tokenizer (the same
    vocabulary, special tokens and chat template: the same tokenizer files)."""
    items = list(components.items())
    first_name, first = items[0]
    want = tokenizer_facts(first, tokenizer)
    for name, component in items[1:]:
        got = tokenizer_facts(component, tokenizer)
        if "vocab_size" not in want or "vocab_size" not in got:
            want, got = ({k: v for k, v in f.items() if k != "vocab_size"} for f in (want, got))
        differences = identity_differences(want, got)
        if differences:
            raise ConfigError(
                f"components {_where(first_name, first)} and {_where(name, component)} were tokenised with "
                f"different tokenizers ({'; '.join(differences[:4])}); a mixture's components share one "
                "tokenizer: build every store with the same tokenizer (a multimodal mixture: the processor's)"
            )


def plan_folder(plan_cache: Any, cache_dir: Any, stores: Sequence[Any]) -> Path | None:
    """Where a mixture's epochs are cached: ``plan_cache``, else this node's object cache (a store or cache
    directory at an URL), else ``cache_dir/.plans``, else beside the first store (None: held in memory
    only, every rank computes them)."""
    if plan_cache is not None:
        return Path(plan_cache)
    if is_url(cache_dir) or any(is_url(getattr(s, "path", None)) for s in stores):
        return ObjectCache.default().root / "plans"
    if cache_dir is not None:
        return Path(cache_dir, ".plans")
    for store in stores:
        path = getattr(store, "path", None)
        if path is not None:
            return Path(path).with_name(f".{Path(path).name}.plans")
    return None

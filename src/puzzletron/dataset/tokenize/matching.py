"""Whether a token store is the one a call asks for: its split and tokenizer against the caller's
(``docs/trust-model.md``, "A store is the call's").

`build_batches(STORE, split="validation")` on the train split's store, or `tokenizer="other/"` on a store
another tokenizer made, would train on data the caller did not ask for. `store_for_call` compares what the
caller said (a split given explicitly, a tokenizer given at all) with the store's identity:

- the same: the store itself;
- another tokenizer of the same split, with ``cache_dir``: the complete store of the wanted identity (the
  store's, with the given tokenizer's identity) found anywhere under it (`cache.find_store`);
- otherwise a `ConfigError` naming both (the store's split or tokenizer, and the one asked for).

"Not said" is told apart from an explicit ``"train"`` by `UNSAID_SPLIT`, the default of ``split`` in
`build_batches` and the AutoModel factory: a string equal to ``"train"`` that is not the caller's literal.
A tokenizer directory is compared by the SHA-256 of its files (`identity.tokenizer_identity`), a tokenizer
object with a store built from an object by its content hash; an object against a store built from a
directory (two descriptions that cannot be compared byte for byte) by its vocabulary size and pad id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.tokenize.cache import find_store
from puzzletron.dataset.tokenize.conversations import pad_token_id
from puzzletron.dataset.tokenize.identity import identity_differences, tokenizer_identity

__all__ = ["UNSAID_SPLIT", "store_for_call"]


class _Unsaid(str):
    """The default split: ``"train"``, and recognisably not the caller's own ``"train"``."""

    __slots__ = ()


UNSAID_SPLIT: str = _Unsaid("train")


def _identity(tokenizer: Any, store: Any) -> dict[str, Any]:
    try:
        return tokenizer_identity(tokenizer)
    except ConfigError as exc:  # not a directory, no tokenizer files: say it is about the store's check
        raise ConfigError(
            f"{exc}: the token store {store.path}'s tokenizer cannot be compared with it"
        ) from None


def _tokenizer_differs(store: Any, tokenizer: Any) -> list[str]:
    """What differs between the store's tokenizer identity and `tokenizer` (empty: the same)."""
    recorded, manifest = store.manifest["identity"]["tokenizer"], store.manifest
    wanted = _identity(tokenizer, store)
    if ("files" in recorded) == ("files" in wanted):
        return identity_differences(recorded, wanted)
    facts = {"vocab_size": len(tokenizer), "pad_token_id": pad_token_id(tokenizer)}
    return [f"{k}: {manifest.get(k)!r} vs {v!r}" for k, v in facts.items() if manifest.get(k) != v]


def store_for_call(store: Any, *, split: str | None, tokenizer: Any, cache_dir: str | Path | None) -> Any:
    """`store` (a `TokenStore`) when it is the split and tokenizer the caller asked for (``split``
    `UNSAID_SPLIT` or None and ``tokenizer`` None: not asked), else the right store found through
    ``cache_dir``, else a `ConfigError` naming both (module docstring)."""
    from puzzletron.dataset.formats.token_store import TokenStore

    identity = store.manifest["identity"]
    recorded_split = identity["snapshot"].get("split")
    if split is not None and not isinstance(split, _Unsaid) and split != recorded_split:
        raise ConfigError(
            f"the token store {store.path} holds split {recorded_split!r}, not the split {split!r} asked "
            "for; pass that split's store, or the snapshot with split= and cache_dir= (its store is built or "
            "found there)"
        )
    if tokenizer is None:
        return store
    differs = _tokenizer_differs(store, tokenizer)
    if not differs:
        return store
    if cache_dir is not None and "files" in (wanted := _identity(tokenizer, store)):
        found = find_store(cache_dir, {**identity, "tokenizer": wanted})
        if found is not None:
            return TokenStore(found)
    name = tokenizer if isinstance(tokenizer, str | Path) else type(tokenizer).__name__
    raise ConfigError(
        f"the token store {store.path} was built with another tokenizer than {name} "
        f"({'; '.join(differs[:3])}: store vs given); pass the store of this tokenizer, or the snapshot with "
        "cache_dir= (its store is built or found there)"
    )

"""`PackingSpec` and `PuzzletronDataSpec`: the canonical ``data:`` block of a Puzzletron (Hydra) config;
`TokenizeOptions`: what tokenising a text split depends on besides the tokenizer.

::

    data:
      modality: text                 # text | multimodal
      layout: packed_varlen          # fixed | padded_varlen | packed_varlen
      max_sample_length: 4096        # longest sample, tokens
      packing:                       # present iff layout is packed_varlen (null otherwise)
        pack_size: 4096              # hard row length, tokens
        packing_ratio: 0.9           # share of pack_size a planner may fill with *estimated* lengths
        drop_long_samples: true      # drop (and count) samples > pack_size; false raises naming the sample
        long_samples: drop           # drop | raise | truncate | split; named, it wins over the default above
      path: /data/subset             # anything else is passed through in `spec.extras` for other stages

Every message names the config key (``data.packing.pack_size`` ...) and what was expected.
"""

from __future__ import annotations

import math
import os
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from puzzletron.dataset._checks import (
    coerce_enum,
    did_you_mean,
    plain_mapping,
    require_bool,
    require_int,
    require_positive,
)
from puzzletron.dataset._enums import DataLayout, Modality
from puzzletron.dataset.errors import ConfigError

__all__ = [
    "CACHE_DIR_ENV",
    "LONG_SAMPLE_POLICIES",
    "MAX_ROW_BYTES",
    "MAX_TURN_BYTES",
    "PackingSpec",
    "PuzzletronDataSpec",
    "TokenizeOptions",
    "as_spec",
    "check_size_limits",
    "default_cache_dir",
]

# Size bounds of Hub text (docs/trust-model.md, "Size bounds"): the UTF-8 bytes of one turn's text, and of
# a whole row's. Far above any real conversation (2 MiB is ~500k tokens), far below what blows up memory.
MAX_TURN_BYTES = 2 * 2**20
MAX_ROW_BYTES = 4 * 2**20

_PACKING_KEYS = ("pack_size", "packing_ratio", "drop_long_samples", "long_samples")
# What happens to a sample longer than pack_size (docs: puzzletron.dataset.packing._units).
LONG_SAMPLE_POLICIES = ("drop", "raise", "truncate", "split")
_SPEC_KEYS = ("modality", "layout", "max_sample_length", "packing")
_IDENTITY_KEYS = ("messages_field", "id_field", "rows_per_shard")  # what the tokens depend on
_TOKENIZE_KEYS = (*_IDENTITY_KEYS, "max_turn_bytes", "max_row_bytes")


def check_size_limits(owner: Any, turn: Any, row: Any) -> tuple[int, int]:
    """``(max_turn_bytes, max_row_bytes)`` checked: ints >= 1 with the turn bound <= the row bound;
    `ConfigError` naming `owner` otherwise."""
    turn = require_int(turn, f"{owner}.max_turn_bytes", minimum=1, error=ConfigError)
    row = require_int(row, f"{owner}.max_row_bytes", minimum=1, error=ConfigError)
    if turn > row:
        raise ConfigError(f"{owner}.max_turn_bytes ({turn}) is larger than max_row_bytes ({row})")
    return turn, row


_MAX_TOKENS = 2**31 - 1  # token counts and offsets are int32 at the model boundary (cu_seqlens)


@dataclass(frozen=True)
class PackingSpec:
    """How samples are packed into rows: ``pack_size`` tokens per row (hard limit).

    ``packing_ratio`` in ``(0, 1]`` is the share of ``pack_size`` a planner may fill when sample lengths are
    estimated (VLM image tokens), leaving headroom; ``drop_long_samples`` drops samples longer than
    ``pack_size`` (and counts them) instead of raising.

    ``long_samples`` (keyword-only) names the policy for samples longer than ``pack_size``: ``"drop"``,
    ``"raise"``, ``"truncate"`` (keep the first ``pack_size`` tokens) or ``"split"`` (cut into ``pack_size``
    pieces packed as separate documents). Unset, it follows ``drop_long_samples`` (drop / raise); named, it
    overrides the default ``drop_long_samples=True`` (an explicit ``False`` with ``"drop"`` is an error).
    After construction ``long_samples`` holds the policy in effect and ``drop_long_samples`` says whether it
    is ``"drop"``.
    """

    pack_size: int
    packing_ratio: float = 1.0
    drop_long_samples: bool = True
    long_samples: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        require_positive(self.pack_size, "data.packing.pack_size", error=ConfigError)
        require_int(self.pack_size, "data.packing.pack_size", maximum=_MAX_TOKENS, error=ConfigError)
        ratio = self.packing_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float):
            raise ConfigError(f"data.packing.packing_ratio must be a number in (0, 1]; got {ratio!r}")
        if not (math.isfinite(ratio) and 0 < ratio <= 1):
            raise ConfigError(f"data.packing.packing_ratio must be in (0, 1]; got {ratio}")
        object.__setattr__(self, "packing_ratio", float(ratio))
        object.__setattr__(
            self,
            "drop_long_samples",
            require_bool(
                self.drop_long_samples, "data.packing.drop_long_samples", error=ConfigError, strings=True
            ),
        )
        policy = self.long_samples
        if policy is None:
            policy = "drop" if self.drop_long_samples else "raise"
        if policy not in LONG_SAMPLE_POLICIES:
            raise ConfigError(
                f"data.packing.long_samples must be one of {', '.join(LONG_SAMPLE_POLICIES)}; got {policy!r}"
            )
        # drop_long_samples=True is the default, indistinguishable from an explicit True: a named policy
        # overrides it. An explicit False (never the default) with long_samples='drop' contradicts it.
        if policy == "drop" and not self.drop_long_samples:
            raise ConfigError(
                "data.packing.long_samples='drop' contradicts data.packing.drop_long_samples=False; set "
                "only one of them"
            )
        object.__setattr__(self, "long_samples", policy)
        object.__setattr__(self, "drop_long_samples", policy == "drop")

    @classmethod
    def _from_mapping(cls, raw: Mapping[str, Any]) -> PackingSpec:
        """Parse a ``data.packing`` block: ``pack_size`` required, unknown keys rejected with a suggestion."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"data.packing must be a mapping or null; got {type(raw).__name__}")
        raw = plain_mapping(raw, "data.packing", error=ConfigError)
        _refuse_unknown_keys(raw, _PACKING_KEYS, what="key(s) in data.packing", prefix="data.packing.")
        if "pack_size" not in raw:
            raise ConfigError("data.packing.pack_size is required when data.packing is given")
        spec = cls(**{k: raw[k] for k in _PACKING_KEYS if k in raw})
        if "drop_long_samples" in raw and "long_samples" in raw:  # both set by the user: they must agree
            asked = require_bool(
                raw["drop_long_samples"], "data.packing.drop_long_samples", error=ConfigError, strings=True
            )
            if asked != spec.drop_long_samples:
                raise ConfigError(
                    f"data.packing.long_samples={spec.long_samples!r} contradicts "
                    f"data.packing.drop_long_samples={asked}; set only one of them"
                )
        return spec


@dataclass(frozen=True)
class PuzzletronDataSpec:
    """The canonical data description: ``packed_varlen`` layout if and only if ``packing`` is given.

    ``extras`` (not an init argument; excluded from ``==`` and ``hash``) holds the unrelated ``data.*`` keys
    ``from_mapping`` passed through (``path``, ``calibration``, ...) as a read-only mapping.
    """

    modality: Modality
    layout: DataLayout
    max_sample_length: int
    packing: PackingSpec | None = None
    extras: Mapping[str, Any] = field(
        default_factory=lambda: types.MappingProxyType({}), init=False, compare=False, hash=False, repr=False
    )

    def __post_init__(self) -> None:
        # Coerce first: the packing rule below must see DataLayout.PACKED_VARLEN, not the string.
        object.__setattr__(
            self, "modality", coerce_enum(Modality, self.modality, "data.modality", error=ConfigError)
        )
        object.__setattr__(
            self, "layout", coerce_enum(DataLayout, self.layout, "data.layout", error=ConfigError)
        )
        require_positive(self.max_sample_length, "data.max_sample_length", error=ConfigError)
        require_int(self.max_sample_length, "data.max_sample_length", maximum=_MAX_TOKENS, error=ConfigError)
        if self.packing is not None and not isinstance(self.packing, PackingSpec):
            raise ConfigError(
                f"data.packing must be a PackingSpec or null; got {type(self.packing).__name__}"
            )
        packed = self.layout is DataLayout.PACKED_VARLEN
        if packed and self.packing is None:
            raise ConfigError("data.packing is required when data.layout is packed_varlen")
        if not packed and self.packing is not None:
            raise ConfigError(
                f"data.packing is only valid with data.layout packed_varlen; got layout {self.layout.value}"
            )
        if self.packing is not None and self.max_sample_length > self.packing.pack_size:
            raise ConfigError(
                f"data.max_sample_length ({self.max_sample_length}) must be <= data.packing.pack_size "
                f"({self.packing.pack_size}): a sample must fit in one pack"
            )

    @property
    def sequence_length(self) -> int:
        """Row length in tokens: ``pack_size`` when packing, else ``max_sample_length``."""
        return self.packing.pack_size if self.packing is not None else self.max_sample_length

    def __getstate__(self) -> dict[str, Any]:
        """Pickle support (DataLoader workers under spawn): the read-only ``extras`` as a plain dict."""
        return {**self.__dict__, "extras": dict(self.extras)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, types.MappingProxyType(value) if name == "extras" else value)

    @property
    def legacy_varlen(self) -> bool:
        """The old ``varlen: true`` flag, i.e. ``layout == packed_varlen``."""
        return self.layout is DataLayout.PACKED_VARLEN

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> PuzzletronDataSpec:
        """Parse a Hydra ``data:`` block (a dict or an OmegaConf ``DictConfig``); see the module docstring."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"data must be a mapping; got {type(raw).__name__}")
        raw = plain_mapping(raw, "data", error=ConfigError)
        if "varlen" in raw:
            raise ConfigError(
                "data.varlen is no longer supported: set data.layout: packed_varlen (with a data.packing "
                "block) instead of varlen: true, or data.layout: padded_varlen / fixed"
            )
        for key in ("modality", "layout", "max_sample_length"):
            if key not in raw:
                others = [str(k) for k in raw if k not in _SPEC_KEYS]
                hint = did_you_mean(key, tuple(others))
                raise ConfigError(f"canonical data config is missing data.{key}{hint}")
        packing_raw = raw.get("packing")
        packing = None if packing_raw is None else PackingSpec._from_mapping(packing_raw)
        spec = cls(
            modality=raw["modality"],
            layout=raw["layout"],
            max_sample_length=raw["max_sample_length"],
            packing=packing,
        )
        extras = {str(k): v for k, v in raw.items() if k not in _SPEC_KEYS}
        object.__setattr__(spec, "extras", types.MappingProxyType(extras))
        return spec


CACHE_DIR_ENV = "PUZZLETRON_CACHE_DIR"


def default_cache_dir() -> Path:
    """Where a store is built or found when a caller names no ``cache_dir`` and the source must be tokenised
    (a subset given to `build_vlm_batches` or the VLM factory): ``PUZZLETRON_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/puzzletron/stores`` (``~/.cache/puzzletron/stores``), per user as `datasets` and
    `huggingface_hub` keep theirs (the object cache is ``.../puzzletron/objects``). Read at every call."""
    named = os.environ.get(CACHE_DIR_ENV)
    if named:
        return Path(named)
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "puzzletron", "stores")


def as_spec(spec: Any, *, owner: str) -> PuzzletronDataSpec:
    """``spec`` as a `PuzzletronDataSpec`: one as it is, a ``data:`` mapping (a dict, an OmegaConf
    ``DictConfig``) through `PuzzletronDataSpec.from_mapping`; anything else a `ConfigError` naming `owner`.
    Every entry point that takes a spec takes it through here.

    >>> as_spec({"modality": "text", "layout": "fixed", "max_sample_length": 8}, owner="f").layout.value
    'fixed'
    >>> as_spec("packed", owner="build_batches")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    puzzletron.dataset.errors.ConfigError: build_batches: spec must be a PuzzletronDataSpec or ...; got str
    """
    if isinstance(spec, PuzzletronDataSpec):
        return spec
    if isinstance(spec, Mapping):
        return PuzzletronDataSpec.from_mapping(spec)
    raise ConfigError(
        f"{owner}: spec must be a PuzzletronDataSpec or a data: mapping (PuzzletronDataSpec.from_mapping); "
        f"got {type(spec).__name__}"
    )


@dataclass(frozen=True)
class TokenizeOptions:
    """How rows of a text split become samples; exactly the ``options`` part of a token store's identity.

    ``messages_field``: the column holding ``[{role, content}]`` turns; ``id_field``: the column naming a
    sample (None, or a column the rows lack: the row index); ``rows_per_shard``: rows of the split per
    store shard (fixed row ranges, so a store's bytes do not depend on the number of processes or ranks).
    ``max_turn_bytes`` / ``max_row_bytes``: a row with a turn (or all its text) over these UTF-8 sizes is
    an error naming it (`MAX_TURN_BYTES`, `MAX_ROW_BYTES`); they never change the tokens of a build that
    succeeds, so they are not part of the identity. How a build runs (processes, batch size) is not an
    option: it never changes the tokens.

    >>> TokenizeOptions().identity()
    {'messages_field': 'messages', 'id_field': 'uuid', 'rows_per_shard': 65536}
    >>> TokenizeOptions.from_mapping({"messages_field": "conversation"}).messages_field
    'conversation'
    """

    messages_field: str = "messages"
    id_field: str | None = "uuid"
    rows_per_shard: int = 65_536
    max_turn_bytes: int = MAX_TURN_BYTES
    max_row_bytes: int = MAX_ROW_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.messages_field, str) or not self.messages_field:
            raise ConfigError(f"messages_field must be a non-empty column name, got {self.messages_field!r}")
        if self.id_field is not None and not isinstance(self.id_field, str):
            raise ConfigError(f"id_field must be a column name or None, got {self.id_field!r}")
        object.__setattr__(self, "id_field", self.id_field or None)
        require_positive(self.rows_per_shard, "rows_per_shard", error=ConfigError)
        limits = check_size_limits("TokenizeOptions", self.max_turn_bytes, self.max_row_bytes)
        object.__setattr__(self, "max_turn_bytes", limits[0])
        object.__setattr__(self, "max_row_bytes", limits[1])

    def identity(self) -> dict[str, Any]:
        """The JSON-ready ``options`` of a store identity (every field the tokens depend on)."""
        return {name: getattr(self, name) for name in _IDENTITY_KEYS}

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | TokenizeOptions | None) -> TokenizeOptions:
        """Options from a mapping (a Hydra block), unknown keys rejected with a suggestion; an instance or
        None (the defaults) as it is."""
        if raw is None or isinstance(raw, TokenizeOptions):
            return raw or cls()
        if not isinstance(raw, Mapping):
            raise ConfigError(f"tokenize options must be a mapping; got {type(raw).__name__}")
        raw = plain_mapping(raw, "options", error=ConfigError)
        _refuse_unknown_keys(raw, _TOKENIZE_KEYS, what="tokenize option(s)")
        return cls(**raw)


def _refuse_unknown_keys(
    raw: Mapping[str, Any], known: Sequence[str], *, what: str, prefix: str = ""
) -> None:
    """A `ConfigError` naming every key of `raw` not in `known`, each with the closest known key."""
    unknown = [str(k) for k in raw if k not in known]
    if unknown:
        hints = "; ".join(f"{prefix}{k}{did_you_mean(k, known)}" for k in sorted(unknown))
        raise ConfigError(f"unknown {what}: {hints}; expected {', '.join(known)}")

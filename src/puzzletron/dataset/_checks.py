"""Argument checks shared by the whole package, each raising the library error the caller names.

Every message names the argument and what was expected (``cp_rank must be an int >= 0; got -1``). Booleans
are never accepted as ints (``True`` is an ``int`` in Python, never a sensible count).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from typing import Any, TypeVar

__all__ = [
    "coerce_enum",
    "did_you_mean",
    "is_int",
    "lazy_attribute",
    "plain_mapping",
    "refuse_unknown",
    "require_bool",
    "require_int",
    "require_positive",
    "require_rank",
    "require_seed",
]

_E = TypeVar("_E", bound=Enum)
_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})


def is_int(value: Any) -> bool:
    """An integer that is not a bool (numpy integer scalars included)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return type(value).__module__ == "numpy" and hasattr(value, "dtype") and value.dtype.kind in "iu"


def require_int(
    value: Any, name: str, *, minimum: int | None = None, maximum: int | None = None, error: type[Exception]
) -> int:
    """``value`` as a Python int in ``[minimum, maximum]``; else ``error`` naming ``name``."""
    bounds = " and ".join(
        part
        for part in (
            f">= {minimum}" if minimum is not None else "",
            f"<= {maximum}" if maximum is not None else "",
        )
        if part
    )
    expected = f"an int {bounds}".rstrip()
    if not is_int(value):
        raise error(f"{name} must be {expected}; got {value!r}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise error(f"{name} must be {expected}; got {value!r}")
    return value


def require_positive(value: Any, name: str, *, error: type[Exception]) -> int:
    """A count: an int > 0 (``{name} must be a positive int; got ...`` / ``{name} must be > 0; got ...``)."""
    if not is_int(value):
        raise error(f"{name} must be a positive int; got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise error(f"{name} must be > 0; got {value}")
    return int(value)


def require_seed(value: Any, name: str = "seed", *, error: type[Exception]) -> int:
    """A random seed: an int >= 0 (numpy's own error for a negative seed names no field)."""
    return require_int(value, name, minimum=0, error=error)


def require_rank(rank: Any, size: Any, *, rank_name: str, size_name: str, error: type[Exception]) -> int:
    """Check ``size >= 1`` and ``0 <= rank < size``; return ``rank``."""
    size = require_int(size, size_name, minimum=1, error=error)
    rank = require_int(rank, rank_name, minimum=0, error=error)
    if rank >= size:
        raise error(f"{rank_name} must be < {size_name.rpartition('.')[2]} ({size}); got {rank}")
    return rank


def require_bool(value: Any, name: str, *, error: type[Exception], strings: bool = False) -> bool:
    """``True``/``False``; with ``strings``, also 0/1 and true/false, yes/no, on/off, 1/0 in any case."""
    if isinstance(value, bool):
        return value
    if strings:
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str):
            text = value.strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
    raise error(f"{name} must be a boolean (true/false); got {value!r}")


def coerce_enum(enum_cls: type[_E], value: Any, name: str, *, error: type[Exception]) -> _E:
    """``value`` as a member of ``enum_cls`` (members and their values accepted); else ``error``."""
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)
        raise error(f"{name} must be one of {allowed}; got {value!r}") from None


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known``, or ``""``."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def refuse_unknown(function: Callable[..., Any], unknown: Iterable[str]) -> None:
    """A `TypeError` (what Python raises for an unexpected keyword) naming each of `unknown` with the closest
    named parameter of `function` and all of them, so a YAML typo in a Hydra ``_target_``'s keys says what
    was meant; nothing when `unknown` is empty. The one behaviour of every entry point that takes
    ``**unknown`` (the AutoModel factories), as `PuzzletronDataSpec.from_mapping` for the ``data:`` block.

    >>> def load(path, *, size=None, **unknown): ...
    >>> refuse_unknown(load, ["sise"])
    Traceback (most recent call last):
    TypeError: load() got unknown option(s): 'sise' (did you mean 'size'?); accepted options are path, size
    """
    unknown = sorted(unknown)
    if not unknown:
        return
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    named = [p.name for p in inspect.signature(function).parameters.values() if p.kind not in kinds]
    hints = ", ".join(f"{name!r}{did_you_mean(name, named)}" for name in unknown)
    raise TypeError(
        f"{function.__name__}() got unknown option(s): {hints}; accepted options are {', '.join(named)}"
    )


def plain_mapping(raw: Mapping[Any, Any], name: str, *, error: type[Exception]) -> dict[Any, Any]:
    """The top-level items of `raw` as a plain dict. An OmegaConf ``DictConfig`` resolves each value on
    access; a missing interpolation (``${model.seq_len}`` with no such key) or mandatory value (``???``) is
    ``error`` naming ``{name}.{key}`` in one line instead of OmegaConf's own multi-line exception."""
    out = {}
    for key in raw:
        try:
            out[key] = raw[key]
        except Exception as exc:
            if not type(exc).__module__.startswith("omegaconf"):
                raise
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise error(f"{name}.{key} cannot be resolved: {reason}") from None
    return out


def lazy_attribute(package: str, owners: Mapping[str, str], name: str, namespace: dict[str, Any]) -> Any:
    """The package attribute `name` imported on first use (PEP 562): ``owners`` maps each lazy name to the
    submodule (relative to `package`) that defines it; the value is cached in the package's ``namespace``
    so later lookups skip ``__getattr__``. An unknown name is Python's own `AttributeError`."""
    if name not in owners:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{package}.{owners[name]}"), name)
    namespace[name] = value
    return value

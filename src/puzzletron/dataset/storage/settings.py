"""Every ``PUZZLETRON_OBJECT_*`` variable, read and checked in one place (``docs/object-storage.md``).

    settings = object_settings()        # from os.environ; ConfigError naming the variable and its value
    settings.retries, settings.request_timeout_s, settings.cache_bytes

- ``PUZZLETRON_OBJECT_CACHE``: the node's cache folder (default ``~/.cache/puzzletron/objects``);
- ``PUZZLETRON_OBJECT_CACHE_BYTES``: its bound, bytes or a number with K, M, G, T (default ``64G``);
- ``PUZZLETRON_OBJECT_CONNECT_TIMEOUT_S`` (10), ``..._READ_TIMEOUT_S`` (60: the longest wait for the next
  bytes), ``..._REQUEST_TIMEOUT_S`` (300: the longest one whole request may take): seconds, finite, above 0;
- ``PUZZLETRON_OBJECT_RETRIES`` (4): attempts after the first, a whole number, 0 or more.

A value that is not what the list says (``RETRIES=-1``, ``RETRIES=abc``, a timeout of ``0`` or ``inf``) and
a ``PUZZLETRON_OBJECT_*`` name the list does not hold (a typo would otherwise leave the default in force)
are a `ConfigError` naming the variable, the value and what is expected. The same checks hold for
values given in code (`check_seconds`, `check_retries`: ``ObjectOptions(retries=-1)`` is refused too).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from puzzletron.dataset.errors import ConfigError

__all__ = [
    "DEFAULTS",
    "ObjectSettings",
    "check_retries",
    "check_seconds",
    "object_settings",
    "parse_size",
]

PREFIX = "PUZZLETRON_OBJECT_"
DEFAULTS: dict[str, str] = {  # variable -> default (as the text a user would set)
    "PUZZLETRON_OBJECT_CACHE": "~/.cache/puzzletron/objects",
    "PUZZLETRON_OBJECT_CACHE_BYTES": "64G",
    "PUZZLETRON_OBJECT_CONNECT_TIMEOUT_S": "10",
    "PUZZLETRON_OBJECT_READ_TIMEOUT_S": "60",
    "PUZZLETRON_OBJECT_REQUEST_TIMEOUT_S": "300",
    "PUZZLETRON_OBJECT_RETRIES": "4",
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_WHOLE = re.compile(r"^\s*\+?\d+\s*$")


def parse_size(text: str, name: str = "size") -> int:
    """Bytes of ``"64G"``, ``"512MiB"``, ``"1048576"`` (binary multiples); `ConfigError` naming `name`.

    >>> parse_size("64G") == 64 << 30, parse_size("1.5M"), parse_size("100")
    (True, 1572864, 100)
    """
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"{name}={text!r}: expected bytes, or a number with K, M, G or T")
    power = " KMGT".index(match[2].upper() or " ")
    return int(float(match[1]) * (1 << (10 * power)))


def check_seconds(value: object, name: str) -> float:
    """`value` as seconds: a finite number above 0 (a timeout of 0 or ``inf`` would never end a request,
    or end every one at once).

    >>> check_seconds("2.5", "T")
    2.5
    >>> check_seconds("inf", "T")
    Traceback (most recent call last):
    puzzletron.dataset.errors.ConfigError: T='inf': expected a number of seconds, finite and above 0
    """
    seconds = None
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):
            seconds = float(value)
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{name}={value!r}: expected a number of seconds, finite and above 0")
    return seconds


def check_retries(value: object, name: str) -> int:
    """`value` as a number of retries after the first attempt: a whole number, 0 or more.

    >>> check_retries("3", "R")
    3
    >>> check_retries("-1", "R")
    Traceback (most recent call last):
    puzzletron.dataset.errors.ConfigError: R='-1': expected a whole number of retries, 0 or more
    """
    if isinstance(value, str) and _WHOLE.match(value):
        return int(value)
    if type(value) is int and value >= 0:
        return value
    raise ConfigError(f"{name}={value!r}: expected a whole number of retries, 0 or more")


@dataclass(frozen=True)
class ObjectSettings:
    """The checked values of every ``PUZZLETRON_OBJECT_*`` variable (the module docstring's table)."""

    cache: Path
    cache_bytes: int
    connect_timeout_s: float
    read_timeout_s: float
    request_timeout_s: float
    retries: int


def object_settings(environ: Mapping[str, str] | None = None) -> ObjectSettings:
    """The ``PUZZLETRON_OBJECT_*`` settings of `environ` (default ``os.environ``), each checked; an unset or
    empty variable takes its default. `ConfigError` for an unknown name or a value that is not expected."""
    env = os.environ if environ is None else environ
    unknown = sorted(k for k in env if k.startswith(PREFIX) and k not in DEFAULTS)
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a variable this package reads (it reads {', '.join(DEFAULTS)})")

    def get(name: str) -> str:
        return env.get(name) or DEFAULTS[name]

    name = "PUZZLETRON_OBJECT_CACHE_BYTES"
    size = parse_size(get(name), name)
    if size < 1:
        raise ConfigError(f"{name}={get(name)!r}: expected at least 1 byte")
    cache = env.get("PUZZLETRON_OBJECT_CACHE") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "puzzletron", "objects"
    )
    return ObjectSettings(
        cache=Path(os.path.abspath(os.path.expanduser(cache))),
        cache_bytes=size,
        connect_timeout_s=check_seconds(get(f"{PREFIX}CONNECT_TIMEOUT_S"), f"{PREFIX}CONNECT_TIMEOUT_S"),
        read_timeout_s=check_seconds(get(f"{PREFIX}READ_TIMEOUT_S"), f"{PREFIX}READ_TIMEOUT_S"),
        request_timeout_s=check_seconds(get(f"{PREFIX}REQUEST_TIMEOUT_S"), f"{PREFIX}REQUEST_TIMEOUT_S"),
        retries=check_retries(get(f"{PREFIX}RETRIES"), f"{PREFIX}RETRIES"),
    )

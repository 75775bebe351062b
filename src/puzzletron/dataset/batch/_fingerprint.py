"""Canonical, process-independent encoding of batch content and its SHA-256.

The encoding is a tagged, length-prefixed byte stream fed straight into ``hashlib.sha256`` (nothing is
joined into one big ``bytes``), so it is unambiguous (``["ab"]`` and ``["a", "b"]`` differ) and never
depends on ``repr()``, ``PYTHONHASHSEED``, ``torch.set_printoptions``, dict insertion order or the device:

- tensor: dtype name, shape, then the raw little-endian bytes of its contiguous CPU copy (0-dim tensors and
  dtypes numpy lacks, e.g. bfloat16 and float8, are viewed as ``uint8``); the copy to the host happens only
  here, when a fingerprint is read;
- enum: its value (a ``str``-enum hashes like its value with an enum tag);
- mapping: entries sorted by the encoding of their key; list/tuple: element-wise;
- dataclass: class name, then fields in declaration order;
- ``None``, ``bool``, ``int``, ``float`` (IEEE bits), ``str`` (UTF-8), ``bytes``, numpy arrays and scalars.

Anything else (a model, a lambda, an open file; sparse, nested, quantized or meta tensors) is a ``TypeError``
naming its type and where it sits: a ``repr()`` with a memory address would silently make every fingerprint
unique.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["content_equal", "content_hash", "encode_into", "fingerprint_of"]

# Bump when the encoding changes: fingerprints are stored next to cached artefacts.
_VERSION = b"puzzletron-fingerprint-v1"


class _Sink(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...


def _len(sink: _Sink, n: int) -> None:
    sink.update(struct.pack("<Q", n))


def _str(sink: _Sink, text: str) -> None:
    raw = text.encode("utf-8")
    _len(sink, len(raw))
    sink.update(raw)


def _tensor(sink: _Sink, t: torch.Tensor, where: str) -> None:
    if t.layout != torch.strided or t.is_nested:
        kind = "a nested tensor" if t.is_nested else f"tensor layout {t.layout}"
        raise TypeError(f"cannot fingerprint {where}: {kind} has no canonical encoding")
    if t.is_quantized:  # its bytes are the integers only: scale and zero point would be lost
        raise TypeError(f"cannot fingerprint {where}: quantized tensors have no canonical encoding")
    if t.device.type == "meta":
        raise TypeError(f"cannot fingerprint {where}: a meta tensor has no data")
    sink.update(b"T")
    _str(sink, str(t.dtype))
    _len(sink, t.dim())
    for size in t.shape:
        _len(sink, size)
    # resolve_conj/neg: lazily conjugated views must hash like their materialised values.
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    # Bytes through a uint8 view: works for every dtype (bf16, float8, bool) and for 0-dim tensors.
    data = flat.view(torch.uint8).numpy()
    _len(sink, data.nbytes)
    sink.update(memoryview(data))


def encode_into(sink: _Sink, obj: Any, where: str = "value") -> None:
    """Feed the canonical encoding of ``obj`` into ``sink`` (anything with ``update(bytes)``)."""
    if obj is None:
        sink.update(b"N")
    elif isinstance(obj, torch.Tensor):
        _tensor(sink, obj, where)
    elif isinstance(obj, Enum):
        # Before str/int: DataLayout is also a str.
        sink.update(b"E")
        encode_into(sink, obj.value, where)
    elif isinstance(obj, bool | np.bool_):
        sink.update(b"B1" if obj else b"B0")
    elif isinstance(obj, int | np.integer):
        sink.update(b"I")
        _str(sink, str(int(obj)))
    elif isinstance(obj, float | np.floating):
        sink.update(b"F" + struct.pack("<d", float(obj)))
    elif isinstance(obj, str):
        sink.update(b"S")
        _str(sink, obj)
    elif isinstance(obj, bytes | bytearray | memoryview):
        sink.update(b"Y")
        _len(sink, len(obj))
        sink.update(bytes(obj))
    elif isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError(f"cannot fingerprint {where}: numpy array of dtype object")
        _tensor(sink, torch.from_numpy(np.ascontiguousarray(obj)), where)
    elif isinstance(obj, Mapping):
        entries = []
        for key, value in obj.items():
            key_sink = hashlib.sha256()
            encode_into(key_sink, key, f"{where} key")
            entries.append((key_sink.digest(), key, value))
        entries.sort(key=lambda entry: entry[0])
        sink.update(b"M")
        _len(sink, len(entries))
        for key_digest, key, value in entries:
            sink.update(key_digest)
            encode_into(sink, value, f"{where}[{key!r}]")
    elif isinstance(obj, list | tuple):
        sink.update(b"L")
        _len(sink, len(obj))
        for i, item in enumerate(obj):
            encode_into(sink, item, f"{where}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        sink.update(b"D")
        _str(sink, type(obj).__qualname__)
        fields = dataclasses.fields(obj)
        _len(sink, len(fields))
        for f in fields:
            _str(sink, f.name)
            encode_into(sink, getattr(obj, f.name), f"{where}.{f.name}")
    else:
        raise TypeError(
            f"cannot fingerprint {where}: objects of type {type(obj).__module__}.{type(obj).__qualname__} "
            "have no canonical encoding (use tensors, numbers, strings, enums, mappings or sequences)"
        )


def fingerprint_of(obj: Any, *, where: str = "value") -> str:
    """SHA-256 hex digest of the canonical encoding of ``obj`` (see the module docstring)."""
    sink = hashlib.sha256(_VERSION)
    encode_into(sink, obj, where)
    return sink.hexdigest()


# -- equality by content -------------------------------------------------------------------------------------

_NO_CONTENT_KEY = object()  # cached: this object holds a value without a canonical encoding


def _content_key(obj: Any, fingerprint: Callable[[Any], str]) -> str | None:
    """The fingerprint of ``obj``, or ``None`` when it holds a value with no canonical encoding.

    ``fingerprint`` itself raises ``TypeError`` then (a ``repr()`` would make it meaningless), but ``==`` and
    ``hash`` must never crash: such an object compares by identity instead. The failure is cached so repeated
    comparisons do not hash its tensors again (derived and unpickled objects copy fields only, never this
    cache).
    """
    key = obj.__dict__.get("_content_key", None)
    if key is None:
        try:
            key = fingerprint(obj)
        except TypeError:
            key = _NO_CONTENT_KEY
        object.__setattr__(obj, "_content_key", key)
    return None if key is _NO_CONTENT_KEY else key


def content_equal(a: Any, b: Any, fingerprint: Callable[[Any], str]) -> bool:
    """By content fingerprint; by identity when either side has no canonical encoding."""
    if a is b:
        return True
    key_a, key_b = _content_key(a, fingerprint), _content_key(b, fingerprint)
    return key_a is not None and key_a == key_b


def content_hash(obj: Any, fingerprint: Callable[[Any], str]) -> int:
    """Consistent with `content_equal`: equal fingerprints hash alike, identity-only objects by id."""
    key = _content_key(obj, fingerprint)
    return hash(key) if key is not None else object.__hash__(obj)

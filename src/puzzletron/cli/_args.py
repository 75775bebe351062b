"""Argument types shared by the `puzzletron-data` subcommands."""

from __future__ import annotations

import argparse

__all__ = ["port_type", "seed_type"]


def _int_in(text: str, minimum: int, maximum: int | None, expected: str) -> int:
    """`text` as an int in ``[minimum, maximum]``; else an `argparse.ArgumentTypeError` (exit 2)."""
    try:
        value: int | None = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
    return value


def seed_type(text: str) -> int:
    """An argparse type: an int >= 0 (numpy seeds cannot be negative).

    >>> seed_type("3")
    3
    >>> seed_type("-1")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: must be an int >= 0, got '-1'
    """
    return _int_in(text, 0, None, "an int >= 0")


def port_type(text: str) -> int:
    """An argparse type: a TCP port.

    >>> port_type("8080")
    8080
    >>> port_type("-1")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: must be a TCP port 1..65535, got '-1'
    """
    return _int_in(text, 1, 65535, "a TCP port 1..65535")

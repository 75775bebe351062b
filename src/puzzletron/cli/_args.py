"""Argument types shared by the `puzzletron-data` subcommands."""

from __future__ import annotations

import argparse

__all__ = ["seed_type"]


def seed_type(text: str) -> int:
    """An argparse type: an int >= 0 (numpy seeds cannot be negative).

    >>> seed_type("3")
    3
    >>> seed_type("-1")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: must be an int >= 0, got '-1'
    """
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}")
    return value

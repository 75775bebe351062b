"""STUB — subcommands of this area are registered here."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add this area's subcommands to the `puzzletron-data` parser."""

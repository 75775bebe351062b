"""The machine output of `puzzletron-data`: one JSON line on stdout per command (``--json``), with the same
keys for the same facts across commands.

=================  ===============================================================================
key                meaning
=================  ===============================================================================
``command``        the command that ran (``"materialize puzzle-kd"``, ``"tokenize"``, ``"verify"`` ...)
``status``         ``done`` (it wrote something), ``reused`` (it was there), ``ok`` (checked or read),
                   ``failed`` (a check failed; the exit code is 1), ``serving`` (``hub serve``)
``path``           the absolute folder the command wrote or read: snapshot, subset, token store, the
                   fixture Hub, the demo's workdir
``format``         the on-disk format of ``path`` (``puzzletron-text-snapshot``,
                   ``puzzletron-conversation-subset``, ``puzzletron-token-store`` ...)
``manifest``       ``path``'s ``manifest.json``
``row_count``      rows of a text split or snapshot (a token store: the rows it read)
``sample_count``   samples (conversations) kept
``image_count``    images
``token_count``    tokens
``bytes_on_disk``  the size of ``path``
``error``          why it failed (``status`` ``failed``): the one line said on stderr
``exit_code``      with ``error``: the exit code (1 a data error, 2 usage, 130 interrupted)
=================  ===============================================================================

Commands add their own facts under their own names (``adapter``, ``identity_sha256``, ``problems``,
``endpoint``, ``stages`` ...). The counts of a snapshot or store come from its format's ``describe``
(`counts_of`), so ``materialize``, ``tokenize``, ``verify`` and ``inspect`` of one folder agree.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["COUNT_KEYS", "CommandFailed", "add_json", "counts_of", "emit", "folder_facts"]

COUNT_KEYS = ("row_count", "sample_count", "image_count", "token_count", "bytes_on_disk")
# A format that reports its counts in a "counts" mapping (the token store): its names -> the shared keys.
_NESTED = {"rows": "row_count", "samples": "sample_count", "images": "image_count", "tokens": "token_count"}


class CommandFailed(Exception):
    """A command that cannot go on for a reason that is neither data nor usage (a port in use): said by
    `puzzletron.cli.main` as one line (and the ``--json`` line), exit ``code``."""

    def __init__(self, message: str, *, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def add_json(parser: argparse.ArgumentParser, *, always: bool = False) -> None:
    """Add ``--json`` to a command's parser; ``always``: the command prints its JSON line anyway."""
    help_text = (
        "print the one JSON line (this command prints it anyway)"
        if always
        else "print one JSON line on stdout instead of text (keys: puzzletron-data --help)"
    )
    parser.add_argument("--json", action="store_true", help=help_text)


def counts_of(info: Mapping[str, Any]) -> dict[str, Any]:
    """The shared count keys of a ``describe`` summary (`COUNT_KEYS`), wherever its format keeps them."""
    out = {key: info[key] for key in COUNT_KEYS if key in info}
    nested = info.get("counts")
    if isinstance(nested, Mapping):
        out.update({_NESTED[k]: v for k, v in nested.items() if k in _NESTED})
    return {key: out[key] for key in COUNT_KEYS if key in out}


def folder_facts(path: str | Path) -> dict[str, Any]:
    """``path``, ``format``, ``manifest`` and the counts of the snapshot or store at ``path``."""
    from puzzletron.dataset import formats

    info = formats.describe(path)
    root = str(info["path"])
    return {
        "path": root,
        "format": info["format"],
        "manifest": f"{root.rstrip('/')}/{formats.MANIFEST}"
        if "://" in root
        else str(Path(root, formats.MANIFEST)),
        **counts_of(info),
    }


def emit(command: str, status: str, **facts: Any) -> None:
    """Print the command's one JSON line: ``command``, ``status``, then ``facts``."""
    line = json.dumps({"command": command, "status": status, **facts}, default=str) + "\n"
    sys.stdout.write(line)  # one write: the ranks of a launcher may share one stdout
    sys.stdout.flush()

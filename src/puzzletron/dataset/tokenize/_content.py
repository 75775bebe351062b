"""The files of a tokenizer or processor directory, by content: what a store's identity records of them and
what keys the per-process caches of loaded tokenizers and processors (`docs/trust-model.md`, "Every cache
is keyed by content").

A directory is named by the SHA-256 of each file the loader reads (`TOKENIZER_FILE`, and for a processor
`PROCESSOR_FILE` too), never by its path: a chat template edited between two builds in one process is
another key, so the second build renders with the new template, and two copies of one tokenizer share one
loaded object.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.formats.manifest import canonical_sha256, sha256_file

__all__ = [
    "PROCESSOR_FILE",
    "TOKENIZER_FILE",
    "check_template",
    "content_key",
    "directory_files",
    "load_directory",
]

# The files `AutoTokenizer.from_pretrained` reads from a directory, ``config.json`` included (its model type
# can choose the tokenizer class); a model's weights are not.
TOKENIZER_FILE = re.compile(
    r"tokenizer.*|special_tokens_map\.json|added_tokens\.json|chat_template.*|vocab.*|merges.*"
    r"|.*\.model|.*\.tiktoken|spiece.*|additional_chat_templates/.*|config\.json"
)
# The files of a processor directory its tokens and pixels depend on (besides the tokenizer's).
PROCESSOR_FILE = re.compile(
    r"preprocessor_config\.json|processor_config\.json|image_processor.*\.json|chat_template.*"
)


def directory_files(root: Path, *, processor: bool = False) -> dict[str, str]:
    """``{relative path: SHA-256}`` of the tokenizer files under `root` (with ``processor``: and its
    processor files), sorted by path."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        wanted = TOKENIZER_FILE.fullmatch(rel) or (processor and PROCESSOR_FILE.fullmatch(rel))
        if wanted and path.is_file():
            out[rel] = sha256_file(path)
    return out


def content_key(root: Path, *, processor: bool = False) -> str:
    """The hex SHA-256 of `directory_files`: the cache key of what is loaded from `root`."""
    return canonical_sha256({"files": directory_files(root, processor=processor), "processor": processor})


def load_directory(loader: Callable[[str], Any], root: Path, what: str) -> Any:
    """``loader(root)`` (``AutoTokenizer.from_pretrained``, ...); whatever it raises (a tokenizers parse
    error, a ``JSONDecodeError`` of a truncated file, ``OSError``, ``ValueError`` ...) is one `ConfigError`
    line naming `what` and the directory."""
    try:
        return loader(str(root))
    except Exception as exc:
        reason = (str(exc).splitlines() or [""])[0][:200]
        raise ConfigError(
            f"{what} {root} cannot be loaded ({type(exc).__name__}: {reason}); is it a complete, undamaged "
            f"{what} directory?"
        ) from exc


def check_template(template: Any, where: str) -> None:
    """`ConfigError` naming `where` unless `template` is a chat template: a string, or transformers' named
    templates (a mapping of names to strings)."""
    named = isinstance(template, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in template.items()
    )
    if not isinstance(template, str) and not named:
        raise ConfigError(
            f"{where}: chat_template is a {type(template).__name__} ({template!r:.40}); expected the "
            "template's text (a string, in tokenizer_config.json or chat_template.jinja)"
        )

"""How much rendered text a chat template may make, and how much is encoded at once
(``docs/trust-model.md``, "Size bounds").

A template is code: ``{{ 'word ' * 20000000 }}`` renders 100 MB from a conversation of a few bytes, and
encoding takes ~200 bytes of memory a character (the backend's encodings with their offsets). So a row's
rendered text is bounded (`check_rendered`, before a character of it is encoded) and a batch's texts are
encoded in calls of at most `MAX_RENDERED_CHARS` characters (`encode_calls`): the encoding of a batch stays
under ~1.6 GB whatever its template does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from puzzletron.dataset.errors import ConversationError

__all__ = ["MAX_RENDERED_CHARS", "check_rendered", "encode_calls"]

# Characters of rendered text a row may have (or twice its own text, if more), and encoded in one backend
# call (a call has at least one row): encoding takes ~200 bytes a character, so ~1.6 GB at most, whatever a
# template does to the text (``'word ' * 20000000`` renders 100 MB from a few bytes).
MAX_RENDERED_CHARS = 8 * 2**20


def _text_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of text of a normalised conversation (string contents and ``text`` items)."""
    total = 0
    for message in messages:
        content = message["content"]
        items = [content] if isinstance(content, str) else [
            item.get("text") for item in content if isinstance(item, Mapping)
        ]  # fmt: skip
        total += sum(len(t) for t in items if isinstance(t, str))
    return total


def check_rendered(text: str, messages: list[dict[str, Any]], where: str) -> None:
    """`ConversationError` naming `where` when the template rendered more than `MAX_RENDERED_CHARS` (or
    twice the conversation's own text, if more) from it: checked before a character is encoded."""
    bound = max(MAX_RENDERED_CHARS, 2 * _text_chars(messages))
    if len(text) > bound:
        raise ConversationError(
            f"{where}: the chat template renders {len(text)} characters from {_text_chars(messages)} of "
            f"text; the bound is {bound} (MAX_RENDERED_CHARS, or twice the text): a template that "
            "amplifies text"
        )


def encode_calls(texts: list[str]) -> list[tuple[int, int]]:
    """``[a, b)`` ranges of `texts` encoded in one backend call: at most `MAX_RENDERED_CHARS` characters
    each, at least one text."""
    ends = np.cumsum(np.fromiter((len(t) for t in texts), np.int64, len(texts)))
    out, a = [], 0
    while a < len(texts):
        spent = int(ends[a - 1]) if a else 0
        b = max(int(np.searchsorted(ends, spent + MAX_RENDERED_CHARS, side="right")), a + 1)
        out.append((a, b))
        a = b
    return out

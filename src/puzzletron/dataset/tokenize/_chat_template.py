"""Rendering conversations with a chat template and finding the assistant's tokens: one conversation at a
time (`assistant_token_mask`, the reference) or a batch at once (`tokenize_batch`, the fast path, with
identical output).

Which tokens are the assistant's: templates with ``{% generation %}`` blocks answer that themselves
(``apply_chat_template(..., return_assistant_tokens_mask=True)``). For templates without them the fallback
renders the conversation prefix by prefix: the text an assistant message adds after the generation prompt of
the turns before it (``apply_chat_template(messages[:i], add_generation_prompt=True)`` vs
``messages[:i + 1]``), with trailing whitespace trimmed, is that message's span, mapped onto tokens by their
character offsets (fast tokenizers).

The batch path does for a whole batch what ``apply_chat_template`` does per conversation, with the same
calls and the same rules, so its ids and masks are the same:

1. render every conversation once with transformers' ``render_jinja_template(...,
   return_assistant_tokens_mask=True, **tokenizer.special_tokens_map)``: the texts and, per text, the
   character spans ``(start, end)`` of its generation blocks;
2. encode every text with ONE backend call, ``tokenizer.backend_tokenizer.encode_batch(texts,
   add_special_tokens=False)``, the backend first put in the state ``tokenizer(text)`` puts it in (no
   truncation, no padding, ``encode_special_tokens = split_special_tokens``);
3. map each span to tokens with ``Encoding.char_to_token`` of its first and last character and
   ``apply_chat_template``'s rules: a span whose start maps to no token ends that conversation's mask; an
   end that maps to no token *or to token 0* runs to the end of the sequence; an empty range marks nothing.
   The mask of the whole batch is one difference-array cumsum (no per-token Python loop).

Tokenizers whose encoding transformers customises (a subclass overriding ``__call__`` / ``_encode_plus``,
slow tokenizers, transformers before 5) and templates without generation markers go row by row through
`assistant_token_mask`. Errors name the row: a malformed message (``messages`` not a list, a turn without a
string role or a string content) or a template that fails on a conversation, however it fails (a
``raise_exception``, a ``ZeroDivisionError``, ``TypeError``, ``RecursionError``, ``MemoryError`` of a
string bomb), is a `ConversationError` (``"row 3: the chat template failed on the conversation: ..."``).

A chat template is code from the tokenizer's author (``docs/trust-model.md``, "Tokenizers and chat
templates"): it runs in transformers' Jinja sandbox, and here under a time bound as well (`RENDER_SECONDS`
plus `RENDER_SECONDS_PER_ROW` a row, in the main thread, with ``SIGALRM``), so a template that loops for
hours is an error naming the rows instead of a hang. ``strftime_now`` (Llama 3 templates print today's date)
is pinned to `PINNED_DATE`, so the same identity always renders the same bytes.
"""

from __future__ import annotations

import datetime
import re
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import chain
from typing import Any

import numpy as np

from puzzletron.dataset.errors import ConversationError
from puzzletron.dataset.tokenize._rendered import check_rendered, encode_calls

__all__ = [
    "PINNED_DATE",
    "RENDER_SECONDS",
    "RENDER_SECONDS_PER_ROW",
    "assistant_token_mask",
    "normalise_messages",
    "tokenize_batch",
    "uses_clock",
]

RENDER_SECONDS = 10.0  # the time bound of one render call, plus RENDER_SECONDS_PER_ROW for each row in it
RENDER_SECONDS_PER_ROW = 0.01
PINNED_DATE = datetime.date(2024, 7, 26)  # what `strftime_now` prints (Llama 3's own fallback date)


def _pinned_strftime(fmt: str) -> str:
    return PINNED_DATE.strftime(fmt)


# Passed to every render: context variables shadow the template globals transformers installs.
_TEMPLATE_KWARGS = {"strftime_now": _pinned_strftime}


def uses_clock(template: str | None) -> bool:
    """Whether a chat template calls ``strftime_now`` (its output is pinned to `PINNED_DATE`)."""
    return bool(template) and "strftime_now" in template  # type: ignore[operator]


class _RenderTimeout(Exception):
    """A render ran past its time bound."""


@contextmanager
def _bounded(seconds: float) -> Iterator[None]:
    """Raise `_RenderTimeout` inside the block after `seconds` (main thread only: elsewhere no bound). A
    real-time interval timer already running (a test runner's timeout) is kept: when it is due first it
    alone stays armed, else it is re-armed with what remains of it afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer, _ = signal.getitimer(signal.ITIMER_REAL)
    if outer and outer <= seconds:  # the outer timer fires first anyway
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _RenderTimeout(f"the chat template ran for more than {seconds:.0f} s")

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 1e-3))


def _failed(where: str, exc: BaseException) -> ConversationError:
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return ConversationError(
        f"{where}: the chat template failed on the conversation: {type(exc).__name__}: {text}"
    )


_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_HAS_GENERATION: dict[str, bool] = {}  # template -> has a generation block (a search costs ~0.5 ms)


def _has_generation(template: str) -> bool:
    if not isinstance(template, str):  # chat_template_of has refused it where it was loaded
        return False
    if template not in _HAS_GENERATION:
        _HAS_GENERATION[template] = bool(_GENERATION.search(template))
    return _HAS_GENERATION[template]


def normalise_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """``[{role: str, content: str | list}]`` of a row's messages; `ConversationError` naming `where` for a
    value that is not a list of such turns (null, a number, a turn without a string role, content that is a
    number or a bool)."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise ConversationError(
            f"{where}: messages is {messages!r:.80}; expected a list of {{role, content}} turns"
        )
    out = []
    for i, message in enumerate(messages):
        # Arrow fills a missing key with null, so null counts as missing.
        if not isinstance(message, Mapping) or message.get("role") is None or message.get("content") is None:
            raise ConversationError(
                f"{where}: messages[{i}] must be a mapping with 'role' and 'content' (got {message!r:.120})"
            )
        role, content = message["role"], message["content"]
        if not isinstance(role, str):
            raise ConversationError(f"{where}: messages[{i}].role is {role!r:.40}; expected a string")
        if not isinstance(content, str | list):
            raise ConversationError(
                f"{where}: messages[{i}].content is a {type(content).__name__} ({content!r:.40}); expected a "
                "string"
            )
        out.append({"role": role, "content": content})
    return out


def _rejected(where: str, exc: Exception) -> ConversationError:
    return ConversationError(f"{where}: the chat template rejected the conversation: {exc}")


def assistant_token_mask(
    messages: Sequence[Mapping[str, Any]], tokenizer: Any, *, where: str = "sample"
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenise one conversation with its chat template: ``(input_ids [T], assistant mask [T] bool)``."""
    messages = normalise_messages(messages, where)
    if not messages:  # nothing to render, nothing supervised: the caller skips and counts it
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    from jinja2 import TemplateError

    template = tokenizer.chat_template or ""
    try:
        with _bounded(RENDER_SECONDS + RENDER_SECONDS_PER_ROW):
            if not _GENERATION.search(template):
                return _prefix_diff_mask(messages, tokenizer, where=where)
            text = tokenizer.apply_chat_template(messages, tokenize=False, **_TEMPLATE_KWARGS)
            check_rendered(text, messages, where)
            out = tokenizer.apply_chat_template(
                messages,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                **_TEMPLATE_KWARGS,
            )
    except ConversationError:
        raise
    except TemplateError as exc:  # e.g. raise_exception("Conversation roles must alternate ...")
        raise _rejected(where, exc) from exc
    except (
        Exception
    ) as exc:  # the template's own failure (ZeroDivisionError, RecursionError, MemoryError ...)
        raise _failed(where, exc) from exc
    ids = np.asarray(out["input_ids"], dtype=np.int64)
    mask = np.asarray(out["assistant_masks"], dtype=bool)
    return ids, mask


def _prefix_diff_mask(
    messages: list[dict[str, Any]], tokenizer: Any, *, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """Fallback without generation markers: assistant spans from incremental prefix renders."""
    full = tokenizer.apply_chat_template(messages, tokenize=False, **_TEMPLATE_KWARGS)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _generation_prompt_render(tokenizer, messages[:i], where=where)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False, **_TEMPLATE_KWARGS)
        if not (full.startswith(through) and through.startswith(before)):
            raise ConversationError(
                f"{where}: the chat template does not render message {i} as a prefix extension; "
                "add {% generation %} blocks to the template to mark assistant tokens"
            )
        spans.append((len(before), len(through.rstrip())))
    check_rendered(full, messages, where)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    starts = np.asarray([a for a, _ in enc["offset_mapping"]], dtype=np.int64).reshape(-1)
    mask = np.zeros(ids.shape, dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    return ids, mask


def _generation_prompt_render(tokenizer: Any, prefix: list[dict[str, Any]], *, where: str) -> str:
    """The text ``prefix`` renders to with the generation prompt.

    An empty prefix (before a leading assistant turn), which `apply_chat_template` refuses, goes through the
    same Jinja renderer with the same template variables.
    """
    if prefix:
        return tokenizer.apply_chat_template(
            prefix, tokenize=False, add_generation_prompt=True, **_TEMPLATE_KWARGS
        )
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template(
            conversations=[[]],
            chat_template=tokenizer.get_chat_template(),
            add_generation_prompt=True,
            **tokenizer.special_tokens_map,
            **_TEMPLATE_KWARGS,
        )
    except Exception as exc:  # the template itself may reject an empty conversation
        raise ConversationError(
            f"{where}: the chat template cannot render the generation prompt before the leading assistant "
            f"message ({exc}); add {{% generation %}} blocks to the template to mark assistant tokens"
        ) from exc
    return rendered[0]


# ---------------------------------------------------------------------------------------------- batches


def _batch_capable(tokenizer: Any) -> bool:
    """Whether ``tokenizer(text)`` is the backend's ``encode_batch`` (transformers >= 5, not overridden)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, TokenizersBackend)
        and cls.__call__ is PreTrainedTokenizerBase.__call__
        and cls._encode_plus is TokenizersBackend._encode_plus
        and cls._get_padding_truncation_strategies
        is PreTrainedTokenizerBase._get_padding_truncation_strategies
        and not hasattr(tokenizer, "_switch_to_input_mode")
    )


def _backend(tokenizer: Any) -> Any:
    """The backend `tokenizers.Tokenizer` in the state ``tokenizer(text, add_special_tokens=False)`` uses."""
    from transformers.tokenization_utils_base import PaddingStrategy, TruncationStrategy

    # Exactly what TokenizersBackend._encode_plus does for padding=False, truncation=None, max_length=None.
    tokenizer.set_truncation_and_padding(
        padding_strategy=PaddingStrategy.DO_NOT_PAD,
        truncation_strategy=TruncationStrategy.DO_NOT_TRUNCATE,
        max_length=None,
        stride=0,
        pad_to_multiple_of=None,
        padding_side=None,
    )
    backend = tokenizer.backend_tokenizer
    if backend.encode_special_tokens != tokenizer.split_special_tokens:
        backend.encode_special_tokens = tokenizer.split_special_tokens
    return backend


def _render(convs: list[list[dict]], rows: list[int], tokenizer: Any) -> tuple[list[str], list[list]]:
    """Texts and generation spans of `convs` (rows `rows`), the batch under one time bound; a failure (or a
    batch past its bound) is rendered again row by row, each under its own, to name the first row at fault."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    template = tokenizer.get_chat_template()
    # apply_chat_template: {**self.special_tokens_map, **kwargs}
    kwargs = {**tokenizer.special_tokens_map, **_TEMPLATE_KWARGS}

    def render(batch: list[list[dict]]) -> tuple[list[str], list[list]]:
        with _bounded(RENDER_SECONDS + RENDER_SECONDS_PER_ROW * len(batch)):
            return render_jinja_template(
                conversations=batch, chat_template=template, return_assistant_tokens_mask=True, **kwargs
            )

    try:
        return render(convs)
    except Exception:  # a template error, its own exception, or the bound: find the row
        pass
    texts: list[str] = []
    spans: list[list] = []
    for conv, row in zip(convs, rows, strict=True):
        try:
            text, span = render([conv])
        except TemplateError as exc:
            raise _rejected(f"row {row}", exc) from exc
        except Exception as exc:
            raise _failed(f"row {row}", exc) from exc
        texts += text
        spans += span
    return texts, spans


def _span_token_ranges(
    encodings: list[Any], spans: list[list], lengths: list[int], starts: list[int], rows: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Global ``[begin, end)`` token ranges of the generation spans, by `apply_chat_template`'s rules."""
    lo: list[int] = []
    hi: list[int] = []
    for enc, conv_spans, n, base, row in zip(encodings, spans, lengths, starts, rows, strict=True):
        for a, b in conv_spans:  # a few spans per conversation: Python per span, never per token
            if b == 0:  # transformers asks char_to_token(-1) for it and fails with an OverflowError
                raise ConversationError(
                    f"row {row}: the chat template's {{% generation %}} block at character 0 is empty"
                )
            s = enc.char_to_token(a)
            e = enc.char_to_token(b - 1)
            if s is None:  # transformers: `break` (a truncation guard): later spans stay unmarked
                break
            stop = e + 1 if e else n  # `end_token + 1 if end_token else len(ids)`: None and 0 run to the end
            if stop > s:
                lo.append(base + s)
                hi.append(base + stop)
    return np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)


def _encode(
    texts: list[str], spans: list[list], rows: list[int], tokenizer: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, lengths, span starts, span ends)`` of `texts` encoded in one backend call (token positions
    from the first text's first token); the encodings, ~200 bytes a character, are dropped on return."""
    encodings = _backend(tokenizer).encode_batch(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e) for e in encodings), np.int64, len(encodings))
    starts = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
    ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), np.int64, int(starts[-1]))
    lo, hi = _span_token_ranges(encodings, spans, lengths.tolist(), starts[:-1].tolist(), rows)
    return ids, lengths, lo, hi


def _row_by_row(
    conversations: Sequence[Sequence[Mapping[str, Any]]], tokenizer: Any, first_row: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = [
        assistant_token_mask(c, tokenizer, where=f"row {first_row + i}") for i, c in enumerate(conversations)
    ]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([ids.size for ids, _ in rows], out=offsets[1:])
    ids = np.concatenate([np.zeros(0, np.int64), *(r[0] for r in rows)])
    mask = np.concatenate([np.zeros(0, bool), *(r[1] for r in rows)])
    return ids, mask, offsets


def tokenize_batch(
    conversations: Sequence[Sequence[Mapping[str, Any]]], tokenizer: Any, *, first_row: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokenise a batch of conversations: ``(ids int64 [N], assistant mask bool [N], offsets int64 [n + 1])``.

    Row ``i`` is ``ids[offsets[i]:offsets[i + 1]]``, equal to `assistant_token_mask` of ``conversations[i]``
    (an empty conversation is an empty row). Errors name rows ``first_row + i``; with several bad rows in
    one batch the one reported may differ from the row-by-row path's.
    """
    if not _has_generation(tokenizer.chat_template or "") or not _batch_capable(tokenizer):
        return _row_by_row(conversations, tokenizer, first_row)
    convs = [normalise_messages(m, f"row {first_row + i}") for i, m in enumerate(conversations)]
    nonempty = [i for i, c in enumerate(convs) if c]
    lengths = np.zeros(len(convs), dtype=np.int64)
    offsets = np.zeros(len(convs) + 1, dtype=np.int64)
    if not nonempty:
        return np.zeros(0, np.int64), np.zeros(0, bool), offsets
    todo = convs if len(nonempty) == len(convs) else [convs[i] for i in nonempty]
    rows = [first_row + i for i in nonempty]
    texts, spans = _render(todo, rows, tokenizer)
    for text, conv, row in zip(texts, todo, rows, strict=True):
        check_rendered(text, conv, f"row {row}")
    parts = [_encode(texts[a:b], spans[a:b], rows[a:b], tokenizer) for a, b in encode_calls(texts)]
    lengths[nonempty] = np.concatenate([p[1] for p in parts])
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    ids = np.concatenate([p[0] for p in parts])
    bases = np.cumsum([0] + [p[0].size for p in parts])  # the first token of each call's texts
    lo = np.concatenate([p[2] + base for p, base in zip(parts, bases, strict=False)])
    hi = np.concatenate([p[3] + base for p, base in zip(parts, bases, strict=False)])
    diff = np.zeros(total + 1, dtype=np.int32)
    np.add.at(diff, lo, 1)
    np.add.at(diff, hi, -1)
    mask = np.cumsum(diff[:-1], dtype=np.int32) > 0
    return ids, mask, offsets

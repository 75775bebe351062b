"""Chat-template tokenisation of text conversations, with labels on the assistant turns only.

A row holds ``messages: list<{role, content}>`` (Puzzle-KD; often a leading system turn with empty content).
It is rendered with the tokenizer's own chat template and tokenised; ``labels`` supervise the assistant
turns and come already shifted, in AutoModel's convention::

    tokens   <|im_start|> user \\n Hi <|im_end|> \\n <|im_start|> assistant \\n Hello <|im_end|> \\n
    mask       0           0    0  0   0         0   0           0         0   1       1          0
    labels[t] = input_ids[t + 1] where mask[t + 1], else -100; the last token of a sample is -100.

Which tokens are the assistant's: templates with ``{% generation %}`` blocks answer that themselves
(``return_assistant_tokens_mask=True``). For templates without them the fallback renders the conversation
prefix by prefix: the text an assistant message adds after the generation prompt of the turns before it
(``apply_chat_template(messages[:i], add_generation_prompt=True)`` vs ``messages[:i + 1]``), with trailing
whitespace trimmed, is that message's span, mapped onto tokens by their character offsets (fast tokenizers).

Samples without a supervised token (an empty ``messages`` list too) are skipped and counted.
``num_proc > 1`` tokenises in parallel with `datasets.Dataset.map`; the result is identical to
``num_proc=1`` (same rows, same order, same ids). `puzzletron.dataset.pipeline` turns the result into
batches.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.batch import IGNORE_INDEX
from puzzletron.dataset.errors import ConversationError, PackingError
from puzzletron.dataset.packing import TokenizedSamples

__all__ = [
    "TokenizedText",
    "assistant_token_mask",
    "load_tokenizer",
    "shift_labels",
    "tokenize_conversation",
    "tokenize_conversations",
]

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TOKENIZERS: dict[str, Any] = {}  # per-process cache: path -> tokenizer (worker processes load once)


@dataclass(frozen=True)
class TokenizedText:
    """The result of `tokenize_conversations`.

    Attributes:
        samples: the kept samples (flat ids + shifted labels + ids), in input row order.
        skipped: how many rows had no supervised token.
        skipped_ids: their sample ids.
        pad_token_id: the tokenizer's pad id (else its eos id, else 0), for building batches.
    """

    samples: TokenizedSamples
    skipped: int
    skipped_ids: tuple[str, ...]
    pad_token_id: int


def load_tokenizer(tokenizer: str | Path | Any) -> Any:
    """A `transformers` tokenizer from a local path (cached per process), or the tokenizer given."""
    if not isinstance(tokenizer, str | Path):
        return tokenizer
    key = str(Path(tokenizer).resolve())
    if key not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[key] = AutoTokenizer.from_pretrained(key)
    return _TOKENIZERS[key]


def shift_labels(input_ids: np.ndarray, supervised: np.ndarray) -> np.ndarray:
    """``[T]`` labels: ``input_ids[t + 1]`` where ``supervised[t + 1]``, else -100 (always at the end)."""
    labels = np.full(input_ids.shape, IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = np.where(supervised[1:], input_ids[1:], IGNORE_INDEX)
    return labels


def _normalise(messages: Sequence[Mapping[str, Any]], where: str) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        # Arrow fills a missing key with null, so null counts as missing.
        if not isinstance(message, Mapping) or message.get("role") is None or message.get("content") is None:
            raise ConversationError(
                f"{where}: messages[{i}] must be a mapping with 'role' and 'content' (got {message!r:.120})"
            )
        out.append({"role": str(message["role"]), "content": message["content"]})
    return out


def assistant_token_mask(
    messages: Sequence[Mapping[str, Any]], tokenizer: Any, *, where: str = "sample"
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenise one conversation with its chat template: ``(input_ids [T], assistant mask [T] bool)``."""
    messages = _normalise(messages, where)
    if not messages:  # nothing to render, nothing supervised: the caller skips and counts it
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    from jinja2 import TemplateError

    template = tokenizer.chat_template or ""
    try:
        if not _GENERATION.search(template):
            return _prefix_diff_mask(messages, tokenizer, where=where)
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except TemplateError as exc:  # e.g. raise_exception("Conversation roles must alternate ...")
        raise ConversationError(f"{where}: the chat template rejected the conversation: {exc}") from exc
    ids = np.asarray(out["input_ids"], dtype=np.int64)
    mask = np.asarray(out["assistant_masks"], dtype=bool)
    return ids, mask


def _prefix_diff_mask(
    messages: list[dict[str, Any]], tokenizer: Any, *, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """Fallback without generation markers: assistant spans from incremental prefix renders."""
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _generation_prompt_render(tokenizer, messages[:i], where=where)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(through) and through.startswith(before)):
            raise ConversationError(
                f"{where}: the chat template does not render message {i} as a prefix extension; "
                "add {% generation %} blocks to the template to mark assistant tokens"
            )
        spans.append((len(before), len(through.rstrip())))
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
        return tokenizer.apply_chat_template(prefix, tokenize=False, add_generation_prompt=True)
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template(
            conversations=[[]],
            chat_template=tokenizer.get_chat_template(),
            add_generation_prompt=True,
            **tokenizer.special_tokens_map,
        )
    except Exception as exc:  # the template itself may reject an empty conversation
        raise ConversationError(
            f"{where}: the chat template cannot render the generation prompt before the leading assistant "
            f"message ({exc}); add {{% generation %}} blocks to the template to mark assistant tokens"
        ) from exc
    return rendered[0]


def tokenize_conversation(
    messages: Sequence[Mapping[str, Any]], tokenizer: Any, *, where: str = "sample"
) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids [T], labels [T])`` int64 of one conversation (shifted labels, -100 off the assistant)."""
    ids, mask = assistant_token_mask(messages, load_tokenizer(tokenizer), where=where)
    return ids, shift_labels(ids, mask)


def _map_batch(
    batch: Mapping[str, list[Any]], indices: list[int], *, tokenizer: Any, messages_field: str
) -> dict[str, list[Any]]:
    tok = load_tokenizer(tokenizer)
    out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "supervised": []}
    for index, messages in zip(indices, batch[messages_field], strict=True):
        ids, labels = tokenize_conversation(messages, tok, where=f"row {index}")
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["supervised"].append(int((labels != IGNORE_INDEX).sum()))
    return out


def tokenize_conversations(
    rows: Any,
    *,
    tokenizer: str | Path | Any,
    messages_field: str = "messages",
    id_field: str | None = "uuid",
    num_proc: int = 1,
    batch_size: int = 64,
) -> TokenizedText:
    """Tokenise every row's ``messages`` (a `datasets.Dataset`, or an iterable of mappings).

    Sample ids come from ``id_field`` when the rows have it, else the row index. Rows without a supervised
    token are skipped and counted. The snapshot is never written to (``keep_in_memory``).
    """
    import datasets

    if not isinstance(rows, datasets.Dataset):
        rows = list(rows)
        # No rows at all still has the messages column (from_list([]) would have no columns).
        rows = datasets.Dataset.from_list(rows) if rows else datasets.Dataset.from_dict({messages_field: []})
    if messages_field not in rows.column_names:
        raise ConversationError(f"rows have no {messages_field!r} column (columns: {rows.column_names})")
    tok = load_tokenizer(tokenizer)
    # Workers reload from the path (cheap) rather than unpickling a tokenizer object.
    worker_tok = str(tokenizer) if isinstance(tokenizer, str | Path) else tok
    ids = (
        [str(x) for x in rows[id_field]]
        if id_field and id_field in rows.column_names
        else [str(i) for i in range(len(rows))]
    )
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    pad = int(pad) if pad is not None else 0
    if len(rows) == 0:  # map() of no rows adds no columns
        empty = np.zeros(0, dtype=np.int64)
        return TokenizedText(TokenizedSamples(empty, empty, np.zeros(1, dtype=np.int64), ()), 0, (), pad)
    mapped = rows.select_columns([messages_field]).map(
        _map_batch,
        batched=True,
        batch_size=batch_size,
        with_indices=True,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=[messages_field],
        fn_kwargs={"tokenizer": worker_tok, "messages_field": messages_field},
        keep_in_memory=True,
        load_from_cache_file=False,
        desc=None,
    )
    table = mapped.data.table
    supervised = table.column("supervised").to_numpy()
    keep = np.flatnonzero(supervised > 0)
    skipped = np.flatnonzero(supervised == 0)
    all_ids, all_offsets = _flatten(table.column("input_ids"))
    all_labels, label_offsets = _flatten(table.column("labels"))
    if not np.array_equal(all_offsets, label_offsets):
        raise PackingError("labels and input_ids lost alignment during tokenisation")
    (flat_ids, flat_labels), offsets = _select_rows((all_ids, all_labels), all_offsets, keep)
    samples = TokenizedSamples(flat_ids, flat_labels, offsets, tuple(ids[i] for i in keep.tolist()))
    return TokenizedText(
        samples=samples,
        skipped=int(skipped.size),
        skipped_ids=tuple(ids[i] for i in skipped.tolist()),
        pad_token_id=pad,
    )


def _flatten(column: Any) -> tuple[np.ndarray, np.ndarray]:
    """A pyarrow list column -> (flat int64 values, ``[n + 1]`` int64 offsets from 0).

    Chunk by chunk, never `combine_chunks`: Arrow ``list`` offsets are int32, so one combined array of a
    large split (over 2**31 tokens) would overflow; numpy offsets here are int64.
    """
    import pyarrow as pa

    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    values, lengths = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for chunk in chunks:
        if len(chunk) == 0:
            continue
        off = chunk.offsets.to_numpy().astype(np.int64)
        values.append(chunk.values.to_numpy(zero_copy_only=False)[off[0] : off[-1]].astype(np.int64))
        lengths.append(np.diff(off))
    length = np.concatenate(lengths)
    return np.concatenate(values), np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(length)])


def _select_rows(
    columns: tuple[np.ndarray, ...], offsets: np.ndarray, keep: np.ndarray
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Rows ``keep`` of ragged columns sharing ``offsets`` ``[n + 1]``: (the columns' rows, new offsets)."""
    lengths = np.diff(offsets)[keep]
    new_offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)])
    # source index of every kept token: its row's old start plus its position inside the row
    source = np.repeat(offsets[keep] - new_offsets[:-1], lengths) + np.arange(new_offsets[-1], dtype=np.int64)
    return tuple(column[source] for column in columns), new_offsets

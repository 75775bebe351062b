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

Samples without a supervised token are skipped and counted. ``num_proc > 1`` tokenises in parallel with
`datasets.Dataset.map`; the result is identical to ``num_proc=1`` (same rows, same order, same ids).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset.packing import IGNORE_INDEX, TokenizedSamples

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
            raise ValueError(
                f"{where}: messages[{i}] must be a mapping with 'role' and 'content' (got {message!r:.120})"
            )
        out.append({"role": str(message["role"]), "content": message["content"]})
    return out


def assistant_token_mask(
    messages: Sequence[Mapping[str, Any]], tokenizer: Any, *, where: str = "sample"
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenise one conversation with its chat template: ``(input_ids [T], assistant mask [T] bool)``."""
    messages = _normalise(messages, where)
    template = tokenizer.chat_template or ""
    if _GENERATION.search(template):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = np.asarray(out["input_ids"], dtype=np.int64)
        mask = np.asarray(out["assistant_masks"], dtype=bool)
        return ids, mask
    return _prefix_diff_mask(messages, tokenizer, where=where)


def _prefix_diff_mask(
    messages: list[dict[str, Any]], tokenizer: Any, *, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """Fallback without generation markers: assistant spans from incremental prefix renders."""
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(through) and through.startswith(before)):
            raise ValueError(
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
        rows = datasets.Dataset.from_list(list(rows) if isinstance(rows, Iterable) else rows)
    if messages_field not in rows.column_names:
        raise ValueError(f"rows have no {messages_field!r} column (columns: {rows.column_names})")
    tok = load_tokenizer(tokenizer)
    # Workers reload from the path (cheap) rather than unpickling a tokenizer object.
    worker_tok = str(tokenizer) if isinstance(tokenizer, str | Path) else tok
    ids = (
        [str(x) for x in rows[id_field]]
        if id_field and id_field in rows.column_names
        else [str(i) for i in range(len(rows))]
    )
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
    table = table.take(keep)
    flat_ids, offsets = _flatten(table.column("input_ids"))
    flat_labels, label_offsets = _flatten(table.column("labels"))
    if not np.array_equal(offsets, label_offsets):
        raise RuntimeError("labels and input_ids lost alignment during tokenisation")
    samples = TokenizedSamples(flat_ids, flat_labels, offsets, tuple(ids[i] for i in keep.tolist()))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return TokenizedText(
        samples=samples,
        skipped=int(skipped.size),
        skipped_ids=tuple(ids[i] for i in skipped.tolist()),
        pad_token_id=int(pad) if pad is not None else 0,
    )


def _flatten(column: Any) -> tuple[np.ndarray, np.ndarray]:
    """A pyarrow list column -> (flat int64 values, ``[n + 1]`` offsets from 0), without a Python loop."""
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(array) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values.to_numpy(zero_copy_only=False).astype(np.int64)
    return values[offsets[0] : offsets[-1]], offsets - offsets[0]

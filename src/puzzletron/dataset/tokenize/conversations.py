"""Chat-template tokenisation of text conversations, with labels on the assistant turns only.

A row holds ``messages: list<{role, content}>`` (Puzzle-KD; often a leading system turn with empty content).
It is rendered with the tokenizer's own chat template and tokenised; ``labels`` supervise the assistant
turns and come already shifted, in AutoModel's convention::

    tokens   <|im_start|> user \\n Hi <|im_end|> \\n <|im_start|> assistant \\n Hello <|im_end|> \\n
    mask       0           0    0  0   0         0   0           0         0   1       1          0
    labels[t] = input_ids[t + 1] where mask[t + 1], else -100; the last token of a sample is -100.

Which tokens are the assistant's, and how a batch of rows is rendered once and encoded in one backend call:
`puzzletron.dataset.tokenize._chat_template` (`tokenize_conversation` goes through ``apply_chat_template``
row by row, the reference; `tokenize_rows` and `tokenize_conversations` through the batch path, identical
output).

Samples without a supervised token (an empty ``messages`` list too) are skipped and counted.
``num_proc > 1`` tokenises row ranges in worker processes (`map_tasks`); the result is identical to
``num_proc=1`` (same rows, same order, same ids). `puzzletron.dataset.pipelines.text` turns the result into
batches; `puzzletron.dataset.tokenize.store` writes `tokenize_rows`' output to a token store.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from puzzletron.dataset._checks import require_positive
from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.errors import ConfigError, ConversationError
from puzzletron.dataset.packing.sources import TokenizedSamples, labels_from_mask, shift_labels
from puzzletron.dataset.tokenize._chat_template import assistant_token_mask, tokenize_batch
from puzzletron.dataset.tokenize._content import check_template, content_key, load_directory
from puzzletron.dataset.tokenize._workers import map_tasks

__all__ = [
    "MAX_BATCH_BYTES",
    "TokenizedRows",
    "TokenizedText",
    "assistant_token_mask",
    "chat_tokenizer",
    "check_columns",
    "load_tokenizer",
    "pad_token_id",
    "select_rows",
    "tokenize_conversation",
    "tokenize_conversations",
    "tokenize_rows",
]

# Per-process cache: the content of a directory's tokenizer files (`_content.content_key`) -> the tokenizer
# (worker processes load once); never the path, so a template edited between two builds is loaded again.
_TOKENIZERS: dict[str, Any] = {}
# Text rendered and encoded at a time: a batch's peak memory is about 200x its text (Python strings, the
# rendered text, the backend's encodings with offsets), so at most ~1.6 GB however long the rows are.
MAX_BATCH_BYTES = 8 * 2**20


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


@dataclass(frozen=True)
class TokenizedRows:
    """Rows ``[start, start + n)`` of a split, tokenised (every row, skipped ones included).

    Row ``i`` is ``input_ids[offsets[i]:offsets[i + 1]]`` (int64 ``[N]``) with its assistant mask
    ``mask[...]`` (bool ``[N]``); ``offsets`` int64 ``[n + 1]`` from 0; ``sample_ids`` ``n`` strings.
    """

    start: int
    input_ids: np.ndarray = field(repr=False)
    mask: np.ndarray = field(repr=False)
    offsets: np.ndarray = field(repr=False)
    sample_ids: tuple[str, ...]

    @property
    def supervised(self) -> np.ndarray:
        """``[n]`` int64: the labels of each row that are not -100 (0 for a row to skip)."""
        seen = np.concatenate([np.zeros(1, np.int64), np.cumsum(self.mask, dtype=np.int64)])
        begin, end = self.offsets[:-1], self.offsets[1:]
        # labels[t] is supervised where mask[t + 1]: every masked token of a row but its first
        return seen[end] - seen[np.minimum(begin + 1, end)]


def load_tokenizer(tokenizer: str | Path | Any) -> Any:
    """A `transformers` tokenizer from a local directory (cached per process by the content of its files),
    or the tokenizer given; a directory it cannot be loaded from (none, a corrupt ``tokenizer.json``, ...) is
    a `ConfigError` naming it."""
    if not isinstance(tokenizer, str | Path):
        return tokenizer
    root = Path(tokenizer).resolve()
    if not root.is_dir():
        raise ConfigError(f"tokenizer {root} is not a directory (give a local tokenizer directory)")
    key = content_key(root)
    if key not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[key] = load_directory(AutoTokenizer.from_pretrained, root, "tokenizer")
    return _TOKENIZERS[key]


def chat_tokenizer(tokenizer: str | Path | Any) -> Any:
    """`load_tokenizer`, and a `ConfigError` naming it when it has no chat template (tokenisation renders
    every conversation with it)."""
    tok = load_tokenizer(tokenizer)
    name = tokenizer if isinstance(tokenizer, str | Path) else type(tok).__name__
    template = getattr(tok, "chat_template", None)
    if not template:
        raise ConfigError(
            f"tokenizer {name} has no chat template (no chat_template.jinja, no chat_template in "
            "tokenizer_config.json); give a tokenizer with one"
        )
    check_template(template, f"tokenizer {name}")
    return tok


def check_columns(rows: Any, options: TokenizeOptions) -> None:
    """A `ConfigError` naming ``options.messages_field`` when the rows have no such column."""
    if options.messages_field not in rows.column_names:
        raise ConfigError(
            f"the rows have no column {options.messages_field!r} (messages_field, --messages-field); their "
            f"columns: {rows.column_names}"
        )


def pad_token_id(tokenizer: Any) -> int:
    """The id batches pad with: the tokenizer's pad id, else its eos id, else 0."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad) if pad is not None else 0


def tokenize_conversation(
    messages: Sequence[Mapping[str, Any]], tokenizer: Any, *, where: str = "sample"
) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids [T], labels [T])`` int64 of one conversation (shifted labels, -100 off the assistant)."""
    ids, mask = assistant_token_mask(messages, load_tokenizer(tokenizer), where=where)
    return ids, shift_labels(ids, mask)


def _text_bytes(view: Any, start: int, stop: int, messages: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(UTF-8 bytes of each turn's string content, the row of each turn from 0, row offsets into the
    turns)`` of rows ``[start, stop)``, read from Arrow without decoding a string (other contents: 0)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = view.with_format("arrow")[start:stop].column(messages).combine_chunks()
    kind = column.type
    item = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) else None
    if item is None or not pa.types.is_struct(item) or item.get_field_index("content") < 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(stop - start + 1, np.int64)
    turns = pc.list_flatten(column)
    content = pc.struct_field(turns, "content")
    if pa.types.is_string(content.type) or pa.types.is_large_string(content.type):
        sizes = pc.fill_null(pc.binary_length(content), 0).to_numpy().astype(np.int64)
    else:
        sizes = np.zeros(len(turns), np.int64)
    owner = pc.list_parent_indices(column).to_numpy().astype(np.int64)
    offsets = np.asarray(column.offsets, dtype=np.int64)
    return sizes, owner, offsets - offsets[0]


def _row_sizes(view: Any, start: int, stop: int, options: TokenizeOptions) -> np.ndarray:
    """``[stop - start]`` bytes of text of each row; a `ConversationError` naming the first row with a turn
    over ``options.max_turn_bytes`` or more text than ``options.max_row_bytes``."""
    sizes, owner, offsets = _text_bytes(view, start, stop, options.messages_field)
    totals = np.bincount(owner, weights=sizes, minlength=stop - start).astype(np.int64)
    long_turns = np.flatnonzero(sizes > options.max_turn_bytes)
    long_rows = np.flatnonzero(totals > options.max_row_bytes)
    first = min([int(owner[long_turns[0]])] if long_turns.size else [], default=None)
    if first is not None and (not long_rows.size or first <= long_rows[0]):
        turn = int(long_turns[0])
        raise ConversationError(
            f"row {start + first}: turn {turn - int(offsets[first])} has {int(sizes[turn])} bytes of text; "
            f"the bound is {options.max_turn_bytes} (TokenizeOptions.max_turn_bytes)"
        )
    if long_rows.size:
        row = int(long_rows[0])
        raise ConversationError(
            f"row {start + row}: it has {int(totals[row])} bytes of text; the bound is "
            f"{options.max_row_bytes} (TokenizeOptions.max_row_bytes)"
        )
    return totals


def tokenize_rows(
    rows: Any,
    start: int,
    stop: int,
    *,
    tokenizer: str | Path | Any,
    options: TokenizeOptions = TokenizeOptions(),
    batch_size: int = 1024,
) -> Iterator[TokenizedRows]:
    """Rows ``[start, stop)`` of the `datasets.Dataset` `rows`, tokenised `batch_size` rows at a time, and
    at most `MAX_BATCH_BYTES` of text at a time (a batch has at least one row).

    Sample ids come from ``options.id_field`` when the rows have it, else the row index. Only one batch of
    rows and tokens is in memory at a time. A row over the size bounds of `options` is an error naming it
    (before any row is tokenised).
    """
    batch_size = require_positive(batch_size, "batch_size", error=ConfigError)
    tok = chat_tokenizer(tokenizer)
    check_columns(rows, options)
    messages, id_field = options.messages_field, options.id_field
    with_ids = id_field is not None and id_field in rows.column_names
    view = rows.with_format(None).select_columns([messages, id_field] if with_ids else [messages])
    ends = np.cumsum(_row_sizes(view, start, stop, options))  # bytes of text up to each row's end
    a = start
    while a < stop:
        spent = int(ends[a - start - 1]) if a > start else 0
        fit = int(np.searchsorted(ends, spent + MAX_BATCH_BYTES, side="right")) + start
        b = min(a + batch_size, stop, max(fit, a + 1))
        batch = _read_rows(view, a, b)
        ids, mask, offsets = tokenize_batch(batch[messages], tok, first_row=a)
        names = [str(x) for x in batch[id_field]] if with_ids else [str(i) for i in range(a, b)]
        yield TokenizedRows(a, ids, mask, offsets, tuple(names))
        a = b


def _read_rows(view: Any, a: int, b: int) -> dict[str, list]:
    """Rows ``[a, b)`` as Python values; a row whose text is not UTF-8 (a hand-made or old snapshot) is a
    `ConversationError` naming it, not a `UnicodeDecodeError` from deep inside Arrow."""
    try:
        return view[a:b]
    except UnicodeDecodeError:
        for row in range(a, b):
            try:
                view[row]
            except UnicodeDecodeError as exc:
                raise ConversationError(
                    f"row {row}: its text is not valid UTF-8 (byte {exc.start}: {exc.reason}); rematerialise "
                    "the snapshot (materialisation rejects such rows)"
                ) from None
        raise


def _as_dataset(rows: Any, messages_field: str) -> Any:
    import datasets

    if not isinstance(rows, datasets.Dataset):
        rows = list(rows)
        # No rows at all still has the messages column (from_list([]) would have no columns).
        rows = datasets.Dataset.from_list(rows) if rows else datasets.Dataset.from_dict({messages_field: []})
    if messages_field not in rows.column_names:
        raise ConversationError(f"rows have no {messages_field!r} column (columns: {rows.column_names})")
    return rows


def _tokenize_range(context: tuple[Any, Any, TokenizeOptions], task: tuple[int, int]) -> TokenizedRows:
    rows, tokenizer, options = context
    parts = list(
        tokenize_rows(rows, *task, tokenizer=tokenizer, options=options, batch_size=task[1] - task[0])
    )
    if len(parts) == 1:
        return parts[0]
    lengths = np.concatenate([np.diff(p.offsets) for p in parts])  # more than MAX_BATCH_BYTES of text
    return TokenizedRows(
        task[0],
        np.concatenate([p.input_ids for p in parts]),
        np.concatenate([p.mask for p in parts]),
        np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)]),
        tuple(name for p in parts for name in p.sample_ids),
    )


def tokenize_conversations(
    rows: Any,
    *,
    tokenizer: str | Path | Any,
    options: TokenizeOptions = TokenizeOptions(),
    num_proc: int = 1,
    batch_size: int = 1024,
) -> TokenizedText:
    """Tokenise every row's ``messages`` (a `datasets.Dataset`, or an iterable of mappings) in memory.

    Sample ids come from ``options.id_field`` when the rows have it, else the row index. Rows without a
    supervised token are skipped and counted. ``batch_size`` rows are rendered and encoded at a time. The
    snapshot is never written to. For splits too large for memory, build a token store
    (`puzzletron.dataset.tokenize.store`).
    """
    batch_size = require_positive(batch_size, "batch_size", error=ConfigError)
    rows = _as_dataset(rows, options.messages_field)
    tok = chat_tokenizer(tokenizer)
    pad = pad_token_id(tok)
    if len(rows) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return TokenizedText(TokenizedSamples(empty, empty, np.zeros(1, dtype=np.int64), ()), 0, (), pad)
    # Workers reload from the path (cheap) rather than unpickling a tokenizer object.
    worker_tok = str(tokenizer) if isinstance(tokenizer, str | Path) and num_proc > 1 else tok
    tasks = [(a, min(a + batch_size, len(rows))) for a in range(0, len(rows), batch_size)]
    context = (rows, worker_tok, options)
    parts = list(map_tasks(_tokenize_range, context, tasks, num_proc=num_proc))
    input_ids = np.concatenate([p.input_ids for p in parts])
    mask = np.concatenate([p.mask for p in parts])
    lengths = np.concatenate([np.diff(p.offsets) for p in parts])
    offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)])
    supervised = np.concatenate([p.supervised for p in parts])
    ids = [name for p in parts for name in p.sample_ids]
    keep = np.flatnonzero(supervised > 0)
    skipped = np.flatnonzero(supervised == 0)
    labels = labels_from_mask(input_ids, mask, offsets)
    (flat_ids, flat_labels), kept_offsets = select_rows((input_ids, labels), offsets, keep)
    samples = TokenizedSamples(flat_ids, flat_labels, kept_offsets, tuple(ids[i] for i in keep.tolist()))
    return TokenizedText(
        samples=samples,
        skipped=int(skipped.size),
        skipped_ids=tuple(ids[i] for i in skipped.tolist()),
        pad_token_id=pad,
    )


def select_rows(
    columns: tuple[np.ndarray, ...], offsets: np.ndarray, keep: np.ndarray
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Rows ``keep`` (sorted, unique) of ragged columns sharing ``offsets`` ``[n + 1]``: (the columns' rows,
    new offsets)."""
    if len(keep) == len(offsets) - 1:  # every row: nothing to gather
        return tuple(columns), np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)[keep]
    new_offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)])
    # source index of every kept token: its row's old start plus its position inside the row
    source = np.repeat(offsets[keep] - new_offsets[:-1], lengths) + np.arange(new_offsets[-1], dtype=np.int64)
    return tuple(column[source] for column in columns), new_offsets

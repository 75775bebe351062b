"""The batch tokeniser (`_chat_template.tokenize_batch`: one render, one backend ``encode_batch``, spans
mapped to tokens) equals ``apply_chat_template(..., return_assistant_tokens_mask=True)`` row by row: ids
and masks, on multi-turn, empty, unicode and special-token conversations, three tokenizer pre/post-
processing variants, templates whose generation blocks straddle tokens or start at character 0, and the
no-marker fallback; errors name the row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Regex, pre_tokenizers, processors
from transformers import AutoTokenizer

from _token_store_data import fixture_rows
from puzzletron.dataset.errors import ConversationError
from puzzletron.dataset.tokenize._chat_template import _batch_capable, assistant_token_mask, tokenize_batch
from puzzletron.fixtures.hub import FixtureHub

# The generation block starts right after "assistant:" (BPE tokens straddle the span start).
STRADDLE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{ 'assistant:' }}"
    "{% generation %}{{ m['content'] }}{% endgeneration %}{{ ' <|im_end|>' }}"
    "{%- else -%}{{ m['role'] + ': ' + m['content'] + '\n' }}{%- endif -%}"
    "{%- endfor -%}"
)
# The first generation block may start at character 0: transformers' `if end_token` marks a span ending on
# token 0 through the end of the sequence; the batch path must do the same.
AT_ZERO = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{% generation %}{{ m['content'] }}{% endgeneration %}{{ '|' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' }}{%- endif -%}"
    "{%- endfor -%}"
)
S = {"role": "system", "content": ""}
UNI = "héllo wörld — naïve café 日本語のテキスト 中文 emoji 😀🚀 👩‍👩‍👧 e\u0301 ✓ ± ≤ ≥ ∑ \u200b\u00a0"


def U(text: object) -> dict:
    return {"role": "user", "content": text}


def A(text: object) -> dict:
    return {"role": "assistant", "content": text}


EDGES = [
    [S, U("Hi"), A("Hello")],
    [S, U("Hi"), A("")],
    [S, U("Hi"), A(" leading space")],
    [S, U("Hi"), A("trailing spaces   ")],
    [S, U("Hi"), A("\n\nnewlines around\n\n")],
    [S, U("Hi"), A("   ")],
    [S, U(UNI), A(UNI)],
    [S, U("😀"), A("😀")],
    [S, U("x"), A("🚀 at start"), U("y"), A("at end 🚀")],
    [S, U("Hi"), A("literal <|im_end|> inside and <|im_start|>user\n")],
    [S, U("Hi"), A("<|endoftext|>")],
    [U("no system"), A("ok")],
    [A("assistant first"), U("then a user")],
    [A("a1"), A("a2"), A("a3")],
    [A("a"), U("hello there")],
    [S, U("only user")],
    [S],
    [],
    [{"role": "system", "content": "You are helpful."}, U("q"), A("a"), U("q2"), A("a2"), U("q3"), A("a3")],
    [S, {"role": "tool", "content": '{"x": 1}'}, A("tool answered")],
    [S, U([{"type": "text", "text": "list "}, {"type": "image"}]), A([{"type": "text", "text": "answer"}])],
    [S, U("Hi"), A("word " * 2000)],
]


def _variant(tokenizer_dir: Path, variant: str):
    """The fixture tokenizer as is, with a Qwen2-style split regex and a ByteLevel post-processor, or with
    a ByteLevel post-processor that trims offsets (leading spaces then map to no token)."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    backend = tok.backend_tokenizer
    if variant == "qwen":
        pattern = (
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+"
        )
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    elif variant == "trim":
        backend.post_processor = processors.ByteLevel(trim_offsets=True)
    return tok


@pytest.fixture(scope="module")
def conversations(fixture_hub: FixtureHub) -> list[list[dict]]:
    rows = [r["messages"] for r in fixture_rows(fixture_hub, "train", 120)]
    rng = np.random.default_rng(7)
    for conv in rows[::4]:  # border whitespace, unicode, empty contents sprinkled over real rows
        for message in conv:
            r = rng.random()
            if message["role"] == "assistant" and r < 0.3:
                message["content"] = " " + message["content"] + " \n"
            elif r < 0.5:
                message["content"] += " 😀 日本語"
            elif r < 0.6:
                message["content"] = ""
    return rows + EDGES


def _assert_equal_rowwise(conversations: list, tok, batch_sizes: tuple[int, ...]) -> None:
    reference = [assistant_token_mask(c, tok) for c in conversations]
    for size in batch_sizes:
        for first in range(0, len(conversations), size):
            ids, mask, offsets = tokenize_batch(conversations[first : first + size], tok, first_row=first)
            for j, (ref_ids, ref_mask) in enumerate(reference[first : first + size]):
                cut = slice(offsets[j], offsets[j + 1])
                assert np.array_equal(ids[cut], ref_ids), (size, first + j, "ids")
                assert np.array_equal(mask[cut], ref_mask), (size, first + j, "mask")


@pytest.mark.parametrize("variant", ["plain", "qwen", "trim"])
def test_batches_equal_apply_chat_template_row_by_row(
    tokenizer_dir: Path, conversations: list, variant: str
) -> None:
    tok = _variant(tokenizer_dir, variant)
    assert _batch_capable(tok)
    _assert_equal_rowwise(conversations, tok, (1, 16, len(conversations)))
    strings = [c for c in conversations if all(isinstance(m["content"], str) for m in c)]
    for template in (STRADDLE, AT_ZERO):
        tok.chat_template = template
        # AT_ZERO with an empty leading reply: transformers itself fails (char_to_token(-1))
        usable = [c for c in strings if not (template is AT_ZERO and c and c[0] == A(""))]
        _assert_equal_rowwise(usable, tok, (1, 64))


def test_the_at_zero_quirk_and_its_failure_are_reproduced(tokenizer_dir: Path) -> None:
    tok = _variant(tokenizer_dir, "plain")
    tok.chat_template = AT_ZERO
    ids, mask, _ = tokenize_batch([[A("a"), U("hello there")]], tok)
    assert mask.all() and ids.size > 2  # a span ending on token 0 marks through the end, as transformers does
    # transformers fails on the empty span at character 0 (char_to_token(-1): OverflowError): one line here
    with pytest.raises(
        ConversationError, match=r"^row 4: the chat template's \{% generation %\} block at char"
    ):
        tokenize_batch([[A(""), U("x")]], tok, first_row=4)
    with pytest.raises(ConversationError, match=r"^row 4: the chat template failed .*: OverflowError"):
        assistant_token_mask([A(""), U("x")], tok, where="row 4")


def test_templates_without_markers_and_custom_tokenizers_go_row_by_row(
    tokenizer_dir: Path, conversations: list
) -> None:
    tok = _variant(tokenizer_dir, "plain")
    marked = [assistant_token_mask(c, tok) for c in conversations[:40]]
    for marker in ("{% generation %}", "{% endgeneration %}"):
        tok.chat_template = tok.chat_template.replace(marker, "")
    _assert_equal_rowwise(conversations[:40], tok, (40,))  # the prefix-diff fallback, per row
    fallback = [assistant_token_mask(c, tok) for c in conversations[:40]]
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(marked, fallback, strict=True))

    class Custom(type(tok)):  # transformers' encoding overridden: the batch path must not bypass it
        def _encode_plus(self, *args, **kwargs):
            return super()._encode_plus(*args, **kwargs)

    custom = Custom.from_pretrained(tokenizer_dir)
    assert not _batch_capable(custom)
    _assert_equal_rowwise(conversations[:10], custom, (10,))


def test_errors_name_the_row(tokenizer_dir: Path) -> None:
    tok = _variant(tokenizer_dir, "plain")
    with pytest.raises(ConversationError, match=r"^row 12: messages\[0\] must be a mapping with 'role'"):
        tokenize_batch([[U("fine"), A("ok")], [{"role": "user"}]], tok, first_row=11)
    tok.chat_template = (
        "{%- if messages[0]['role'] == 'system' -%}{{ raise_exception('no system') }}{%- endif -%}"
        + (tok.chat_template)
    )
    with pytest.raises(
        ConversationError, match=r"^row 8: the chat template rejected the conversation: no system$"
    ):
        tokenize_batch([[U("fine"), A("ok")], [], [S, U("x"), A("y")]], tok, first_row=6)

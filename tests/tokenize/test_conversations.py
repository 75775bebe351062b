"""Chat-template tokenisation: assistant-only shifted labels (hand-checked goldens), the no-marker
fallback giving the same mask, rows without supervision skipped and counted, errors naming the row, parallel
runs identical to one process, and a snapshot never written into."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from _chat_rows import IDS_A, IDS_B, LABELS_A, LABELS_B, ROWS
from puzzletron.dataset.tokenize import (
    assistant_token_mask,
    load_tokenizer,
    shift_labels,
    tokenize_conversation,
    tokenize_conversations,
)
from puzzletron.fixtures.hub import PUZZLE_KD, FixtureHub

CONVERSATION = [
    {"role": "system", "content": ""},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "The total is 4."},
    {"role": "user", "content": "Thank you!"},
    {"role": "assistant", "content": "You're welcome."},
]


@pytest.fixture(scope="module")
def plain_template_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tokenizer with its `{% generation %}` markers removed, saved and reloaded by path."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    out = tmp_path_factory.mktemp("plain-template")
    tok.save_pretrained(out)
    return out


def test_shift_labels_golden():
    ids = np.array([10, 11, 12, 13, 14])
    mask = np.array([False, False, True, True, False])
    assert shift_labels(ids, mask).tolist() == [-100, 12, 13, -100, -100]


def test_labels_supervise_exactly_the_assistant_turns_shifted(tokenizer_dir: Path):
    tok = load_tokenizer(tokenizer_dir)
    ids, labels = tokenize_conversation(CONVERSATION, tokenizer_dir)
    assert ids.tolist() == tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    supervised = labels != -100
    assert labels[-1] == -100
    assert (labels[:-1][supervised[:-1]] == ids[1:][supervised[:-1]]).all()  # labels[t] = input_ids[t + 1]
    # The supervised targets, decoded, are the assistant turns with their end-of-turn token, nothing else.
    targets = tok.decode(labels[supervised].tolist())
    assert targets == "The total is 4.<|im_end|>You're welcome.<|im_end|>"
    # Runs of supervision: one per assistant turn.
    starts = np.flatnonzero(np.diff(np.concatenate([[0], supervised.astype(int)])) == 1)
    assert len(starts) == 2


def test_fallback_without_generation_markers_gives_the_same_mask(
    tokenizer_dir: Path, plain_template_dir: Path
):
    marked = assistant_token_mask(CONVERSATION, load_tokenizer(tokenizer_dir))
    plain_tok = load_tokenizer(plain_template_dir)
    assert "{% generation %}" not in plain_tok.chat_template
    fallback = assistant_token_mask(CONVERSATION, plain_tok)
    assert np.array_equal(marked[0], fallback[0])
    assert np.array_equal(marked[1], fallback[1])


def test_fallback_handles_a_conversation_that_opens_with_the_assistant(
    tokenizer_dir: Path, plain_template_dir: Path
):
    greeting = [
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yes"},
    ]
    tok = load_tokenizer(tokenizer_dir)
    marked = assistant_token_mask(greeting, tok)
    fallback = assistant_token_mask(greeting, load_tokenizer(plain_template_dir))
    assert np.array_equal(marked[0], fallback[0]) and np.array_equal(marked[1], fallback[1])
    assert tok.decode(fallback[0][fallback[1]].tolist()) == "Hello<|im_end|>Yes<|im_end|>"


def test_fallback_names_the_row_when_the_template_cannot_render_an_empty_prefix(tokenizer_dir: Path):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    plain = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tok.chat_template = "{%- if not messages -%}{{ raise_exception('no messages') }}{%- endif -%}" + plain
    greeting = [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match=r"row 7: the chat template cannot render the generation prompt"):
        assistant_token_mask(greeting, tok, where="row 7")


@pytest.mark.parametrize("markers", [True, False])
def test_a_conversation_the_template_rejects_is_an_error_naming_the_row(tokenizer_dir: Path, markers: bool):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if not markers:
        for marker in ("{% generation %}", "{% endgeneration %}"):
            tok.chat_template = tok.chat_template.replace(marker, "")
    strict = "{%- if messages[0]['role'] == 'system' -%}{{ raise_exception('no system turns') }}{%- endif -%}"
    tok.chat_template = strict + tok.chat_template
    rows = [{"messages": CONVERSATION[1:3]}, {"messages": CONVERSATION}]
    expected = r"^row 1: the chat template rejected the conversation: no system turns$"
    with pytest.raises(ValueError, match=expected):
        tokenize_conversations(rows, tokenizer=tok)


def test_rows_without_a_supervised_token_are_skipped_and_counted(tokenizer_dir: Path):
    rows = [
        {"uuid": "keep-1", "messages": CONVERSATION},
        {"uuid": "no-assistant", "messages": CONVERSATION[:2]},
        {"uuid": "keep-2", "messages": CONVERSATION[1:3]},
    ]
    result = tokenize_conversations(rows, tokenizer=tokenizer_dir)
    assert result.samples.sample_ids == ("keep-1", "keep-2")
    assert result.skipped == 1 and result.skipped_ids == ("no-assistant",)
    assert result.pad_token_id == load_tokenizer(tokenizer_dir).pad_token_id
    first, _ = tokenize_conversation(CONVERSATION, tokenizer_dir)
    assert result.samples.input_ids[: result.samples.offsets[1]].tolist() == first.tolist()


def test_an_empty_conversation_is_skipped_and_counted_like_any_row_without_supervision(tokenizer_dir: Path):
    rows = [{"uuid": "empty", "messages": []}, {"uuid": "keep", "messages": CONVERSATION[1:3]}]
    result = tokenize_conversations(rows, tokenizer=tokenizer_dir)
    assert result.samples.sample_ids == ("keep",)
    assert result.skipped == 1 and result.skipped_ids == ("empty",)
    ids, labels = tokenize_conversation([], tokenizer_dir)
    assert ids.tolist() == [] and labels.tolist() == []


def test_no_rows_give_no_samples(tokenizer_dir: Path):
    for rows in ([], datasets.Dataset.from_list(ROWS).select([])):
        result = tokenize_conversations(rows, tokenizer=tokenizer_dir)
        assert len(result.samples) == 0 and result.skipped == 0 and result.samples.offsets.tolist() == [0]
        assert result.pad_token_id == 0  # <|endoftext|>


def test_malformed_message_is_an_error_naming_the_row(tokenizer_dir: Path):
    rows = [{"messages": CONVERSATION}, {"messages": [{"role": "user"}]}]
    with pytest.raises(ValueError, match=r"row 1: messages\[0\] must be a mapping with 'role' and 'content'"):
        tokenize_conversations(rows, tokenizer=tokenizer_dir)


@pytest.fixture(scope="module")
def puzzle_kd_rows(fixture_hub: FixtureHub) -> datasets.Dataset:
    """The fixture Hub's Puzzle-KD train parquet, read locally (schema-faithful rows)."""
    files = sorted(str(p) for p in fixture_hub.repo_dir(PUZZLE_KD).glob("data/train-*.parquet"))
    return datasets.load_dataset("parquet", data_files=files, split="train").select(range(240))


def test_parallel_tokenisation_is_identical_to_one_process(tokenizer_dir: Path, puzzle_kd_rows):
    one = tokenize_conversations(puzzle_kd_rows, tokenizer=tokenizer_dir, num_proc=1)
    two = tokenize_conversations(puzzle_kd_rows, tokenizer=tokenizer_dir, num_proc=2, batch_size=16)
    assert one.samples.sample_ids == two.samples.sample_ids
    assert one.skipped_ids == two.skipped_ids
    for name in ("input_ids", "labels", "offsets"):
        assert np.array_equal(getattr(one.samples, name), getattr(two.samples, name))
    assert len(one.samples) + one.skipped == len(puzzle_kd_rows)
    assert one.samples.sample_ids[0] == puzzle_kd_rows[0]["uuid"]


def test_puzzle_kd_rows_label_only_assistant_content(tokenizer_dir: Path, puzzle_kd_rows):
    tok = load_tokenizer(tokenizer_dir)
    result = tokenize_conversations(puzzle_kd_rows.select(range(20)), tokenizer=tokenizer_dir)
    by_id = {r["uuid"]: r for r in puzzle_kd_rows.select(range(20))}
    s = result.samples
    for i, sid in enumerate(s.sample_ids):
        labels = s.labels[s.offsets[i] : s.offsets[i + 1]]
        expected = "".join(
            m["content"] + "<|im_end|>" for m in by_id[sid]["messages"] if m["role"] == "assistant"
        )
        assert tok.decode(labels[labels != -100].tolist()) == expected


def test_tokenising_a_snapshot_never_writes_into_it(tokenizer_dir: Path, puzzle_kd_rows, tmp_path: Path):
    snapshot = tmp_path / "train"
    puzzle_kd_rows.select(range(40)).save_to_disk(str(snapshot))
    before = sorted((p.relative_to(snapshot), p.stat().st_size) for p in snapshot.rglob("*"))
    rows = datasets.load_from_disk(str(snapshot))
    result = tokenize_conversations(rows, tokenizer=tokenizer_dir, num_proc=2, batch_size=8)
    assert len(result.samples) + result.skipped == 40
    assert sorted((p.relative_to(snapshot), p.stat().st_size) for p in snapshot.rglob("*")) == before


def test_tokenised_labels_golden(tokenizer_dir: Path):
    for row, ids, labels in ((ROWS[0], IDS_A, LABELS_A), (ROWS[1], IDS_B, LABELS_B)):
        got_ids, got_labels = tokenize_conversation(row["messages"], tokenizer_dir)
        assert got_ids.tolist() == ids and got_labels.tolist() == labels


def test_rows_of_ragged_columns_are_selected_exactly() -> None:
    from puzzletron.dataset.tokenize import select_rows

    values = np.array([1, 2, 3, 4, 5, 6, 7])
    offsets = np.array([0, 2, 3, 6, 6, 7])  # rows [1 2] [3] [4 5 6] [] [7]
    (kept,), new_offsets = select_rows((values,), offsets, np.array([0, 2, 4]))
    assert kept.tolist() == [1, 2, 4, 5, 6, 7]
    assert new_offsets.tolist() == [0, 2, 5, 6]

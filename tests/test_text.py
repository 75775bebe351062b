"""Chat-template tokenisation: assistant-only shifted labels, the no-marker fallback, parallel runs."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from puzzletron.dataset.batch import DataLayout, PuzzletronBatch
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
from puzzletron.dataset.errors import SubsetError
from puzzletron.dataset.formats.text_snapshot import load_text_split
from puzzletron.dataset.pipelines.text import build_batches
from puzzletron.dataset.tokenize import (
    assistant_token_mask,
    load_tokenizer,
    shift_labels,
    tokenize_conversation,
    tokenize_conversations,
)
from puzzletron.fixtures.hub import PUZZLE_KD, FixtureHub
from puzzletron.fixtures.tokenizer import build_chat_tokenizer

CONVERSATION = [
    {"role": "system", "content": ""},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "The total is 4."},
    {"role": "user", "content": "Thank you!"},
    {"role": "assistant", "content": "You're welcome."},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_tokenizer(tmp_path_factory.mktemp("tokenizer"))


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


# ------------------------------------------------------------------ snapshot + tokenizer + spec -> batches

# Two tiny conversations and their tokens under the fixture tokenizer (hand-checked against its vocab):
#   a: <|im_start|> user \n H i <|im_end|> \n <|im_start|> as sis tant \n Y es <|im_end|> \n     16 tokens
#   b: <|im_start|> user \n N o <|im_end|> \n <|im_start|> as sis tant \n O <|im_end|> \n        15 tokens
ROWS = [
    {"uuid": "a", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"}]},
    {"uuid": "b", "messages": [{"role": "user", "content": "No"}, {"role": "assistant", "content": "O"}]},
]
IDS_A = [1, 401, 205, 46, 79, 2, 205, 1, 352, 312, 335, 205, 63, 291, 2, 205]
IDS_B = [1, 401, 205, 52, 85, 2, 205, 1, 352, 312, 335, 205, 53, 2, 205]
X = -100
# labels[t] is the target of input_ids[t]: the assistant reply and its <|im_end|>, nothing else.
LABELS_A = [X] * 11 + [63, 291, 2, X, X]  # "\n" -> Y, Y -> es, es -> <|im_end|>
LABELS_B = [X] * 11 + [53, 2, X, X]  # "\n" -> O, O -> <|im_end|>


def _only_batch(batches) -> PuzzletronBatch:
    (batch,) = list(batches)
    return batch


def test_tokenised_labels_golden(tokenizer_dir: Path):
    for row, ids, labels in ((ROWS[0], IDS_A, LABELS_A), (ROWS[1], IDS_B, LABELS_B)):
        got_ids, got_labels = tokenize_conversation(row["messages"], tokenizer_dir)
        assert got_ids.tolist() == ids and got_labels.tolist() == labels


def test_build_batches_packed_golden_labels_never_cross_the_document_boundary(tokenizer_dir: Path):
    spec = PuzzletronDataSpec("text", "packed_varlen", 40, PackingSpec(pack_size=40))
    batches = build_batches(ROWS, tokenizer=tokenizer_dir, spec=spec, batch_size=1, shuffle=False)
    assert batches.plan is not None and batches.plan.rows == ((0, 1),) and len(batches) == 1
    batch = _only_batch(batches)
    assert batch.layout is DataLayout.PACKED_VARLEN
    assert batch.input_ids.tolist() == [IDS_A + IDS_B + [0] * 9]
    # Position 15 is the last token of a ("\n"); the next token, position 16, is b's <|im_start|>. Its
    # label is -100: a document never predicts the next one.
    expected = [X] * 11 + [63, 291, 2, X, X] + [X] * 11 + [53, 2, X, X] + [X] * 9
    assert batch.labels.tolist() == [expected]
    assert batch.sequence.seq_ids.tolist() == [[0] * 16 + [1] * 15 + [-1] * 9]
    assert batch.sequence.global_cu_seqlens.tolist() == [0, 16, 31]
    assert batch.model_kwargs["position_ids"].tolist() == [list(range(16)) + list(range(15)) + [0] * 9]
    assert batch.sample_ids == ("a|b",)


@pytest.mark.parametrize(("multiple", "width"), [(1, 16), (12, 24)])
def test_build_batches_padded_golden(tokenizer_dir: Path, multiple: int, width: int):
    spec = PuzzletronDataSpec("text", "padded_varlen", 64)
    batches = build_batches(
        ROWS, tokenizer=tokenizer_dir, spec=spec, batch_size=2, shuffle=False, pad_to_multiple_of=multiple
    )
    batch = _only_batch(batches)
    assert batch.layout is DataLayout.PADDED_VARLEN
    assert batch.input_ids.tolist() == [IDS_A + [0] * (width - 16), IDS_B + [0] * (width - 15)]
    assert batch.labels.tolist() == [LABELS_A + [X] * (width - 16), LABELS_B + [X] * (width - 15)]
    assert batch.model_kwargs["attention_mask"].tolist() == [
        [1] * 16 + [0] * (width - 16),
        [1] * 15 + [0] * (width - 15),
    ]
    assert batch.sample_ids == ("a", "b")


def _fixed_batch(tokenizer_dir: Path, max_sample_length: int) -> PuzzletronBatch:
    spec = PuzzletronDataSpec("text", "fixed", max_sample_length)
    return _only_batch(build_batches(ROWS, tokenizer=tokenizer_dir, spec=spec, batch_size=2, shuffle=False))


def test_build_batches_fixed_golden_truncates_and_pads_to_max_sample_length(tokenizer_dir: Path):
    short = _fixed_batch(tokenizer_dir, 12)
    assert short.layout is DataLayout.FIXED
    assert short.input_ids.tolist() == [IDS_A[:12], IDS_B[:12]]
    # Truncated: the kept tokens keep their true targets (the "\n" before the reply still predicts it).
    assert short.labels.tolist() == [[X] * 11 + [63], [X] * 11 + [53]]
    long = _fixed_batch(tokenizer_dir, 18)
    assert long.input_ids.tolist() == [[*IDS_A, 0, 0], [*IDS_B, 0, 0, 0]]
    assert long.labels.tolist() == [[*LABELS_A, X, X], [*LABELS_B, X, X, X]]


def test_build_batches_deals_to_dp_ranks_and_reads_a_snapshot_folder(tokenizer_dir: Path, tmp_path: Path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "snap" / "train"))
    spec = PuzzletronDataSpec("text", "fixed", 16)
    ranks = [
        build_batches(
            tmp_path / "snap", tokenizer=tokenizer_dir, spec=spec, batch_size=1, dp_rank=r, dp_size=2, seed=3
        )
        for r in range(2)
    ]
    assert sorted(b.sample_ids[0] for r in ranks for b in r) == ["a", "b"]
    assert [b.fingerprint for b in ranks[0].for_rank(1)] == [b.fingerprint for b in ranks[1]]
    assert [b.fingerprint for b in ranks[0].loader(num_workers=0)] == [b.fingerprint for b in ranks[0]]
    assert len(load_text_split(tmp_path / "snap")) == 2
    with pytest.raises(SubsetError, match="does not exist"):
        load_text_split(tmp_path / "missing")


def test_build_batches_rejects_a_multimodal_spec(tokenizer_dir: Path):
    spec = PuzzletronDataSpec("multimodal", "fixed", 16)
    with pytest.raises(ValueError, match=r"data\.modality is multimodal"):
        build_batches(ROWS, tokenizer=tokenizer_dir, spec=spec, batch_size=1)


def test_rows_of_ragged_columns_are_selected_exactly() -> None:
    from puzzletron.dataset.tokenize import select_rows

    values = np.array([1, 2, 3, 4, 5, 6, 7])
    offsets = np.array([0, 2, 3, 6, 6, 7])  # rows [1 2] [3] [4 5 6] [] [7]
    (kept,), new_offsets = select_rows((values,), offsets, np.array([0, 2, 4]))
    assert kept.tolist() == [1, 2, 4, 5, 6, 7]
    assert new_offsets.tolist() == [0, 2, 5, 6]

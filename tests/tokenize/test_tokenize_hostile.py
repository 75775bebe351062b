"""`puzzletron-data tokenize` against careless and hostile tokenizers and rows (docs/trust-model.md,
"Tokenizers and chat templates"): each is one line on stderr naming the tokenizer, the option or the row,
with exit 2 for a tokenizer or option that cannot be used and 1 for data; a runaway template is bounded;
nothing is published and no build directory is left. Inputs: `puzzletron.fixtures.hostile_tokenizers`."""

from __future__ import annotations

import time
from pathlib import Path

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from puzzletron.cli import main
from puzzletron.dataset.config import TokenizeOptions
from puzzletron.dataset.errors import ConversationError
from puzzletron.dataset.formats.text_snapshot import load_text_split, open_split
from puzzletron.dataset.tokenize import (
    _chat_template,
    conversations,
    store_identity,
    tokenize_conversations,
    tokenize_rows,
)
from puzzletron.fixtures.hostile_tokenizers import HOSTILE_ROW, hostile_split, hostile_tokenizer


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["tokenize", *argv])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) <= 1 and "Traceback" not in err, err
    return code, err


@pytest.mark.parametrize(
    ("case", "code", "says"),
    [
        ("no-template", 2, "has no chat template"),
        ("corrupt-json", 2, "cannot be loaded (JSONDecodeError: "),
        ("template-int", 2, "chat_template is a int (123); expected the template's text"),
        ("amplifier", 1, "row 0: the chat template renders 100000"),
        ("zero-division", 1, "row 0: the chat template failed on the conversation: ZeroDivisionError"),
        ("type-error", 1, "row 0: the chat template failed on the conversation: TypeError"),
        ("recursion", 1, "row 0: the chat template failed on the conversation: RecursionError"),
        ("string-bomb", 1, "row 0: the chat template failed on the conversation: MemoryError"),
        (
            "empty-generation-at-0",
            1,
            "row 0: the chat template's {% generation %} block at character 0 is empty",
        ),
    ],
)
def test_a_hostile_tokenizer_is_one_line_and_leaves_nothing(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, capsys, case: str, code: int, says: str
) -> None:
    tok = hostile_tokenizer(tokenizer_dir, tmp_path / "tok", case)
    out = tmp_path / "out" / "store"
    got, err = _run(
        capsys, str(snapshot), "--tokenizer", str(tok), "--output", str(out), "--split", "validation"
    )
    assert got == code and says in err, err
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_a_runaway_template_is_cut_at_its_time_bound_naming_the_row(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setattr(_chat_template, "RENDER_SECONDS", 1.0)  # documented default 10 s (+ 10 ms a row)
    tok = hostile_tokenizer(tokenizer_dir, tmp_path / "tok", "endless-loop")  # 10^10 iterations
    start = time.monotonic()
    code, err = _run(capsys, str(snapshot), "--tokenizer", str(tok), "--output", str(tmp_path / "s"))
    assert (
        code == 1 and "row 0: the chat template failed on the conversation: _RenderTimeout: the chat " in err
    )
    assert "ran for more than 1 s" in err and time.monotonic() - start < 30


def test_a_messages_field_typo_is_a_usage_error_naming_the_columns(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path, capsys
) -> None:
    argv = [str(snapshot), "--tokenizer", str(tokenizer_dir), "--output", str(tmp_path / "s")]
    code, err = _run(capsys, *argv, "--messages-field", "mesages")
    assert code == 2 and "no column 'mesages' (messages_field, --messages-field); their columns: [" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("messages-null", "messages is None; expected a list of {role, content} turns"),
        ("content-int", "messages[0].content is a int (0); expected a string"),
        ("content-bool", "messages[0].content is a bool (False); expected a string"),
        ("not-utf8", "its text is not valid UTF-8"),
        (
            "huge-reply",
            "turn 1 has 2097153 bytes of text; the bound is 2097152 (TokenizeOptions.max_turn_bytes)",
        ),
    ],
)
def test_a_hostile_row_is_one_line_naming_it(
    tokenizer_dir: Path, tmp_path: Path, capsys, case: str, says: str
) -> None:
    split = hostile_split(tmp_path / "split", case)
    code, err = _run(capsys, str(split), "--tokenizer", str(tokenizer_dir), "--output", str(tmp_path / "s"))
    assert code == 1 and f"row {HOSTILE_ROW[case]}: {says}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["split"]


def test_a_template_printing_the_date_renders_a_pinned_date_recorded_in_the_identity(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    tok = hostile_tokenizer(tokenizer_dir, tmp_path / "tok", "clock")
    rows = load_text_split(snapshot, split="validation")
    first = tokenize_conversations(rows, tokenizer=tok).samples
    again = tokenize_conversations(rows, tokenizer=tok).samples
    assert np.array_equal(first.input_ids, again.input_ids)
    text = AutoTokenizer.from_pretrained(tok).decode(first.input_ids[first.offsets[0] : first.offsets[1]])
    assert text.startswith("26 Jul 2024")  # not today's date
    identity = store_identity(open_split(snapshot, "validation"), tokenizer=tok)
    assert identity["tokenizer"]["pinned_date"] == "2024-07-26"
    assert (
        "pinned_date"
        not in store_identity(open_split(snapshot, "validation"), tokenizer=tokenizer_dir)["tokenizer"]
    )


def test_config_json_is_part_of_the_tokenizer_identity(
    snapshot: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    tok = hostile_tokenizer(tokenizer_dir, tmp_path / "tok", "config-class")
    split = open_split(snapshot, "validation")
    with_config = store_identity(split, tokenizer=tok)["tokenizer"]["files"]
    assert (
        "config.json" in with_config
        and with_config != store_identity(split, tokenizer=tokenizer_dir)["tokenizer"]["files"]
    )


def test_a_batch_holds_at_most_max_batch_bytes_of_text(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(conversations, "MAX_BATCH_BYTES", 25_000)
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "w " * 5_000}]}
        for _ in range(7)
    ]  # 10 kB of text a row: 2 rows a batch, whatever batch_size says
    dataset = datasets.Dataset.from_list(rows)
    parts = list(tokenize_rows(dataset, 0, 7, tokenizer=tokenizer_dir, batch_size=1024))
    assert [p.start for p in parts] == [0, 2, 4, 6]
    whole = tokenize_conversations(dataset, tokenizer=tokenizer_dir, batch_size=1024)
    assert np.array_equal(np.concatenate([p.input_ids for p in parts]), whole.samples.input_ids)
    strict = TokenizeOptions(max_row_bytes=9_000, max_turn_bytes=9_000)
    with pytest.raises(ConversationError, match=r"^row 0: turn 1 has 10000 bytes of text; the bound is 9000"):
        list(tokenize_rows(dataset, 0, 7, tokenizer=tokenizer_dir, options=strict))

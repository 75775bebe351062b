"""The command line as a whole: ``--version``, a help text on every option of every command, ``--json`` on
every command, and one JSON line per command whose keys mean the same thing across commands (the folder a
materialisation wrote is the ``path`` verify and inspect read, with the same counts)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from puzzletron.cli import build_parser, main
from puzzletron.cli._output import COUNT_KEYS


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every leaf command's parser by its name (``"materialize puzzle-kd"``, ``"verify"`` ...)."""
    out = {}
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {prefix.strip(): parser}
    for name, child in subs[0].choices.items():
        out |= _commands(child, f"{prefix} {name}")
    return out


COMMANDS = _commands(build_parser())


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    name, version = capsys.readouterr().out.split()
    assert name == "puzzletron-data" and version[0].isdigit()


def test_the_commands_are_the_documented_ones() -> None:
    assert sorted(COMMANDS) == [
        "demo",
        "hub fixtures",
        "hub serve",
        "inspect",
        "materialize intersyn",
        "materialize nemotron-vlm",
        "materialize puzzle-kd",
        "pack-report",
        "tokenize",
        "verify",
    ]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_a_help_text_and_every_command_json(command: str) -> None:
    parser = COMMANDS[command]
    missing = [
        a.option_strings or a.dest
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()
    ]
    assert missing == []
    assert "--json" in parser._option_string_actions


def _line(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def test_the_same_facts_have_the_same_keys_across_commands(
    hub_endpoint: str, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kd, vlm, store = tmp_path / "kd", tmp_path / "vlm", tmp_path / "stores" / "kd-train"
    made = {
        kd: [
            "materialize",
            "puzzle-kd",
            "--output",
            str(kd),
            "--train-samples",
            "40",
            "--validation-samples",
            "4",
        ],
        vlm: ["materialize", "nemotron-vlm", "--output", str(vlm), "--num-samples", "6"],
        store: ["tokenize", str(kd), "--tokenizer", str(tokenizer_dir), "--output", str(store)],
    }
    wrote = {}
    for folder, argv in made.items():
        assert main([*argv, "--json", "--quiet"]) == 0
        wrote[folder] = _line(capsys)
        command = " ".join(argv[:2]) if argv[0] == "materialize" else argv[0]
        assert (wrote[folder]["command"], wrote[folder]["status"]) == (command, "done")
        assert wrote[folder]["path"] == str(folder) and wrote[folder]["manifest"] == str(
            folder / "manifest.json"
        )
    shared = ("path", "format", "manifest", *COUNT_KEYS)
    for folder, line in wrote.items():
        for command in ("verify", "inspect"):
            assert main([command, str(folder), "--json"]) == 0
            seen = _line(capsys)
            assert (seen["command"], seen["status"]) == (command, "ok")
            assert {k: seen.get(k) for k in shared} == {k: line.get(k) for k in shared}, (command, folder)
    assert (wrote[kd]["row_count"], wrote[vlm]["sample_count"], wrote[store]["row_count"]) == (44, 6, 40)
    assert "sample_count" not in wrote[kd] and wrote[vlm]["image_count"] == 6
    argv = ["pack-report", str(store), "--pack-size", "2048", "--out", str(tmp_path / "p.png"), "--json"]
    assert main(argv) == 0
    report = _line(capsys)
    assert (report["command"], report["path"]) == ("pack-report", str(store))
    assert {k: report[k] for k in ("row_count", "sample_count", "token_count")} == {
        k: wrote[store][k] for k in ("row_count", "sample_count", "token_count")
    }


def test_verify_json_of_a_missing_folder_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(tmp_path / "nosuch"), "--json"]) == 1
    line = _line(capsys)
    assert (line["status"], line["problems"]) == ("failed", [f"{tmp_path / 'nosuch'}: no such folder"])

"""The command line as a whole: ``--version``, a help text on every option of every command, ``--json`` on
every command, and one JSON line per command whose keys mean the same thing across commands (the folder a
materialisation wrote is the ``path`` verify and inspect read, with the same counts)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
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
    assert (line["error"], line["exit_code"]) == (f"1 problem(s): {tmp_path / 'nosuch'}: no such folder", 1)


def _failures(tmp_path: Path) -> dict[str, tuple[list[str], int]]:
    """A failing run of every command that can fail without a Hub or store of its own: argv, exit code."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    missing = str(tmp_path / "missing")
    return {
        "inspect": (["inspect", missing], 1),
        "verify": (["verify", "s3://bkt/stores/kd"], 1),  # an URL nothing answers at
        "tokenize": (["tokenize", missing, "--tokenizer", missing, "--output", str(tmp_path / "s")], 1),
        "materialize puzzle-kd": (["materialize", "puzzle-kd", "--output", str(tmp_path / "kd")], 1),
        "materialize nemotron-vlm": (
            ["materialize", "nemotron-vlm", "--output", str(tmp_path / "v"), "--num-samples", "0"],
            2,
        ),
        "hub fixtures": (["hub", "fixtures", str(a_file)], 1),
        "hub serve": (["hub", "serve", missing], 1),
        "pack-report": (["pack-report", missing, "--pack-size", "0", "--out", str(tmp_path / "p.png")], 2),
    }


@pytest.mark.parametrize(
    "command",
    [
        "inspect",
        "verify",
        "tokenize",
        "materialize puzzle-kd",
        "materialize nemotron-vlm",
        "hub fixtures",
        "hub serve",
        "pack-report",
    ],
)
def test_every_failure_with_json_is_one_json_line_with_the_error(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from puzzletron.fixtures.mirror import free_port

    closed = f"http://127.0.0.1:{free_port()}"  # a Hub and an object store that are not there
    monkeypatch.setenv("HF_ENDPOINT", closed)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name, value in {
        "AWS_ENDPOINT_URL": closed,
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PUZZLETRON_OBJECT_RETRIES", "0")
    argv, code = _failures(tmp_path)[command]
    assert main([*argv, "--json"]) == code
    captured = capsys.readouterr()
    line = _line_of(captured.out)
    error = captured.err.strip().splitlines()[-1].removeprefix(f"puzzletron-data {command}: ")
    assert line == {"command": command, "status": "failed", "error": error, "exit_code": code}


def _line_of(out: str) -> dict[str, Any]:
    lines = out.splitlines()
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def test_a_usage_error_with_json_is_one_json_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["materialize", "puzzle-kd", "--json"])  # --output missing
    assert exc.value.code == 2
    line = _line_of(capsys.readouterr().out)
    assert line == {
        "command": "materialize puzzle-kd",
        "status": "failed",
        "error": "the following arguments are required: --output",
        "exit_code": 2,
    }


def test_verbose_goes_before_or_after_the_command() -> None:
    parser = build_parser()
    assert parser.parse_args(["-v", "verify", "x"]).verbose is True
    assert parser.parse_args(["verify", "x", "-v"]).verbose is True
    assert parser.parse_args(["materialize", "puzzle-kd", "--output", "x", "--verbose"]).verbose is True
    assert parser.parse_args(["verify", "x"]).verbose is False


@pytest.mark.parametrize("typo", ["--train-sample", "--train-samplez"])
def test_a_misspelled_or_abbreviated_option_is_refused_with_the_subcommand_usage(
    typo: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["materialize", "puzzle-kd", "--output", "x", typo, "5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: puzzletron-data materialize puzzle-kd ")
    assert f"puzzletron-data materialize puzzle-kd: error: unrecognized arguments: {typo} 5" in err


def test_a_spec_field_out_of_range_is_named_as_its_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["materialize", "puzzle-kd", "--output", str(tmp_path / "x"), "--train-samples", "-5"]) == 2
    assert capsys.readouterr().err == (
        "puzzletron-data materialize puzzle-kd: --train-samples must be an int >= 1; got -5\n"
    )


def test_a_usage_error_imports_nothing_heavy() -> None:
    """Parsing comes before the library: a usage error is said before torch, numpy, pyarrow or the Hub
    client are imported (they took seconds before the first word of an error)."""
    script = (
        "import sys\nfrom puzzletron.cli import main\n"
        "try:\n    main(['materialize', 'puzzle-kd', '--bogus'])\nexcept SystemExit as exc:\n"
        "    heavy = {'torch', 'numpy', 'pyarrow', 'huggingface_hub', 'datasets', 'transformers'}\n"
        "    print(exc.code, sorted(heavy & set(sys.modules)))\n"
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.stdout.split(maxsplit=1) == ["2", "[]\n"], child.stderr

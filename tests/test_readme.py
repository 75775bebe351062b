"""README.md runs as written: every code block, read from the file, on the fixture Hub.

The runner (documented in the README's Development section): in a fresh folder holding ``.venv`` (this
interpreter's environment), every ``bash`` block goes, in README order, to one ``bash`` process (so an
``export`` or a background ``hub serve`` carries over), each with a timeout; every ``python`` block is
executed on its own (a fresh namespace: a block defines what it uses) in that folder; every ``yaml``
block's ``dataset:`` is instantiated with Hydra and with NeMo AutoModel's YAML loader. ``text`` blocks are
not run. ``<!-- readme-test: production -->`` before a block: parsed, not run, and the block before it
(its try-it twin) runs; ``<!-- readme-test: setup -->``: the two set-up commands, which are what this test
runs under (checked as text). Inline ``puzzletron-data ...`` commands must name real commands and flags,
and inline ``.py`` paths must exist.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from puzzletron.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK_TIMEOUT_S = 240
LANGUAGES = {"bash", "python", "yaml", "text"}
MARKERS = {None, "setup", "production"}
SET_UP = (
    "bash scripts/bootstrap.sh && .venv/bin/puzzletron-data demo",
    "bash scripts/bootstrap.sh && .venv/bin/python -m pytest",
)


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # from an HTML comment `<!-- readme-test: X -->` right before the fence

    def where(self) -> str:
        return f"README.md:{self.line} ({self.lang}{', ' + self.marker if self.marker else ''})"


def _blocks(text: str) -> list[Block]:
    """The fenced code blocks of ``text`` with their language and marker."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = i - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = re.fullmatch(r"<!-- readme-test: (\w+) -->", lines[before].strip()) if before >= 0 else None
        blocks.append(Block(i + 1, fence[1], "\n".join(lines[i + 1 : end]) + "\n", marker and marker[1]))
        i = end + 1
    return blocks


TEXT = README.read_text(encoding="utf-8")
BLOCKS = _blocks(TEXT)


def _commands(code: str) -> list[list[str]]:
    """The ``puzzletron-data`` command lines of a bash block (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "puzzletron-data":
            out.append(words[1:])
    return out


def test_the_readme_starts_with_the_two_set_up_commands() -> None:
    first = BLOCKS[0]
    assert TEXT.index("```") > TEXT.index("# puzzletron-data") and first.marker == "setup"
    assert not TEXT[: TEXT.index("<!-- readme-test: setup -->")].replace("# puzzletron-data", "").strip()
    commands = [line.split("#")[0].strip() for line in first.code.splitlines() if line.strip()]
    assert tuple(commands) == SET_UP
    assert (ROOT / "scripts" / "bootstrap.sh").is_file()
    assert subprocess.run(["bash", "-n"], input=first.code, text=True, check=False).returncode == 0
    # the demo it starts with is run below, with --workdir (the try-it files)
    assert any(c == ["demo", "--workdir", "try"] for b in BLOCKS if not b.marker for c in _commands(b.code))


def test_every_block_has_a_known_language_and_a_production_block_follows_its_try_it_twin() -> None:
    assert {b.lang for b in BLOCKS} <= LANGUAGES, [b.where() for b in BLOCKS if b.lang not in LANGUAGES]
    assert {b.marker for b in BLOCKS} <= MARKERS
    for before, block in itertools.pairwise(BLOCKS):
        if block.marker == "production":
            assert before.marker is None and before.lang == block.lang, block.where()


def _check_command(words: list[str], where: str) -> None:
    """``words`` (after ``puzzletron-data``) name a real command, and every flag is one of its flags."""
    parser = build_parser()
    rest = [word for word in words if word != "..."]  # "..." stands for arguments left out
    while rest and not rest[0].startswith("-"):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            break
        assert rest[0] in subs[0].choices, f"{where}: no command {rest[0]!r} in {words}"
        parser = subs[0].choices[rest.pop(0)]
    flags = {word.split("=")[0] for word in rest if word.startswith("--")}
    unknown = flags - set(parser._option_string_actions)
    assert not unknown, f"{where}: {' '.join(words)}: unknown flag(s) {sorted(unknown)}"


def test_production_blocks_parse_and_their_commands_are_run_in_a_try_it_block() -> None:
    tried = {tuple(c[:2]) for b in BLOCKS if b.marker is None and b.lang == "bash" for c in _commands(b.code)}
    for block in (b for b in BLOCKS if b.marker == "production"):
        if block.lang == "bash":
            assert subprocess.run(["bash", "-n"], input=block.code, text=True, check=False).returncode == 0
            for words in _commands(block.code):
                build_parser().parse_args(words)  # exits 2 on any usage error
                assert tuple(words[:2]) in tried, f"{block.where()}: {words[:2]} has no try-it twin"
        elif block.lang == "python":
            compile(block.code, block.where(), "exec")
        else:
            yaml.safe_load(block.code)


def test_inline_commands_name_real_commands_and_flags_and_named_files_exist() -> None:
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", TEXT, flags=re.S))
    commands = [s for s in spans if s.startswith("puzzletron-data ")]
    assert len(commands) >= 3
    for span in commands:
        _check_command(shlex.split(span)[1:], f"`{span}`")
    paths = {word for s in spans for word in s.split() if re.fullmatch(r"[\w./-]+/[\w.-]+\.py", word)}
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert paths and not missing


# ------------------------------------------------------------------------------------------ the runner


class _Shell:
    """One ``bash`` process in its own session: blocks run in it one after another, each with a timeout."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.run("set -eo pipefail", timeout=10)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def run(self, code: str, *, timeout: float) -> tuple[int | None, str]:
        """(exit status, output) of ``code``; None when the shell died (``set -e``) or timed out."""
        token = f"__block_done_{uuid.uuid4().hex}"
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{code}\necho {token} $?\n")
        self.proc.stdin.flush()
        out: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                return None, "".join(out) + f"\n[timed out after {timeout} s]"
            if line is None:
                return None, "".join(out) + f"\n[the shell exited: {self.proc.wait()}]"
            if line.startswith(token):
                return int(line.split()[1]), "".join(out)
            out.append(line)

    def close(self) -> None:
        """End the shell and everything it started (its session: the background ``hub serve``)."""
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh folder with ``.venv`` (this interpreter's environment), the current directory while the test
    runs."""
    venv = Path(sys.prefix)
    if (venv / "bin" / "activate").is_file():
        (tmp_path / ".venv").symlink_to(venv)
    else:  # not a venv: an activate script that puts this interpreter's scripts on the PATH
        (tmp_path / ".venv" / "bin").mkdir(parents=True)
        scripts = shlex.quote(str(Path(sys.executable).parent))
        (tmp_path / ".venv" / "bin" / "activate").write_text(f'export PATH={scripts}:"$PATH"\n')
    monkeypatch.chdir(tmp_path)
    yield tmp_path


def _environment() -> dict[str, str]:
    """This process's environment without the Hub settings a test session may have made, with ``src/`` on
    the path (so a checkout that is not installed runs its own code)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


def _instantiate(block: Block, workdir: Path) -> list[Any]:
    """The ``dataset:`` of a YAML block, instantiated by Hydra and by AutoModel's own loader."""
    from hydra.utils import instantiate
    from nemo_automodel.components.config import loader

    config = yaml.safe_load(block.code)
    built = [instantiate(config["dataset"])]
    path = workdir / f"readme-{block.line}.yaml"
    path.write_text(block.code)
    allowed = loader.ENABLE_USER_MODULES
    loader.set_enable_user_modules(False)  # the README: NEMO_ENABLE_USER_MODULES=1 is not needed for these
    try:
        built.append(loader.load_yaml_config(path).dataset.instantiate())
    finally:
        loader.set_enable_user_modules(allowed)
    return built


@pytest.mark.slow
def test_every_block_runs_on_the_fixture_hub(workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="puzzletron.dataset.pipelines.text")
    shell = _Shell(workdir, _environment())
    ran: list[str] = []
    try:
        for block in BLOCKS:
            if block.marker is not None or block.lang == "text":
                continue
            start = time.monotonic()
            if block.lang == "bash":
                status, output = shell.run(block.code, timeout=BLOCK_TIMEOUT_S)
                assert status == 0, f"{block.where()} failed ({status}):\n{output[-4000:]}"
            elif block.lang == "python":
                exec(compile(block.code, block.where(), "exec"), {"__name__": "__readme__"})
            else:
                for dataset in _instantiate(block, workdir):
                    assert len(dataset) > 0 and dataset[0], block.where()
            ran.append(f"{block.where()}: {time.monotonic() - start:.1f} s")
    finally:
        shell.close()
    assert len(ran) == sum(1 for b in BLOCKS if b.marker is None and b.lang != "text") >= 8, ran
    # One store, never two: tokenize wrote stores/puzzle-kd (and the VLM store stores/vlm); build_batches,
    # build_vlm_batches and AutoModel found them there.
    assert sorted(p.name for p in (workdir / "stores").iterdir() if not p.name.startswith(".")) == [
        "puzzle-kd",
        "vlm",
    ]
    reused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reusing token store")]
    assert reused and all(m.endswith(str(workdir / "stores" / "puzzle-kd")) for m in reused), reused
    # The CPU-sized examples (rows of 1024) keep every token: no "dropped ... 71%" warning first thing.
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in warned if "pack_size 1024" in m], warned
    _rerun_offline(workdir)


_RERUN = """
import json, sys
from puzzletron.cli import main
for argv in json.loads(sys.argv[1]):
    print(json.dumps({"code": main(argv)}), flush=True)
"""


def _rerun_offline(workdir: Path) -> None:
    """ "A rerun with the same spec reuses the snapshot without a request": the README's materialize
    commands again, in their folder, with the Hub stopped (a port that counts the connections it refuses) and
    every other outbound request trapped."""
    from puzzletron.fixtures.faults import OutboundTrap
    from puzzletron.fixtures.mirror import free_port
    from puzzletron.fixtures.tcp_faults import TcpFaults

    assert "A rerun with the same spec reuses the snapshot without a request" in " ".join(TEXT.split())
    runs = [c for b in BLOCKS if b.marker is None and b.lang == "bash" for c in _commands(b.code)]
    runs = [c for c in runs if c[0] == "materialize"]
    assert len(runs) == 3
    with TcpFaults(free_port()) as stopped, OutboundTrap() as trap:
        env = {**_environment(), **trap.environment(), "HF_ENDPOINT": stopped.endpoint}
        env["HF_HOME"] = str(workdir / "try" / "hf-home")
        child = subprocess.run(
            [sys.executable, "-c", _RERUN, json.dumps(runs)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    lines = [json.loads(line) for line in child.stdout.splitlines()]
    assert [line["code"] for line in lines if "code" in line] == [0] * 3, child.stderr[-3000:]
    assert [line["status"] for line in lines if "status" in line] == ["reused"] * 3
    assert (stopped.connections, trap.requests) == (0, [])


def test_the_failure_lines_the_readme_promises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ "any command prints exactly one with --json, whatever happens ...; a failure, a usage error included,
    is "status": "failed" with its error ... and exit_code. Exit ... 1 a data error, 2 usage"."""
    from puzzletron.cli import main

    promise = " ".join(TEXT.split())
    assert "any command prints exactly one with `--json`, whatever happens" in promise
    assert 'a usage error included, is `"status": "failed"` with its `error`' in promise
    assert "Exit 0 done or reused, 1 a data error, 2 usage" in promise
    assert main(["inspect", str(tmp_path / "missing"), "--json"]) == 1
    with pytest.raises(SystemExit) as usage:
        main(["verify", str(tmp_path), "--no-such-flag", "--json"])
    assert usage.value.code == 2
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["command"], x["status"], x["exit_code"]) for x in lines] == [
        ("inspect", "failed", 1),
        ("verify", "failed", 2),
    ]
    assert all(x["error"] for x in lines)


def test_the_layout_names_every_module() -> None:
    """The Layout section lists every module of the package, the fixtures and the command line (by name)."""
    layout = TEXT.split("## Layout", 1)[1].split("\n## ", 1)[0]
    words = set(re.findall(r"[\w.]+", layout)) | {
        w.removesuffix(".py") for w in re.findall(r"[\w.]+", layout)
    }
    src = ROOT / "src" / "puzzletron"
    missing = sorted(
        str(path.relative_to(src))
        for path in src.rglob("*.py")
        if path.stem not in ("__init__", "__main__") and path.stem not in words
    )
    assert missing == []

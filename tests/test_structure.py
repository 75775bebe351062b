"""The shape of the package: the import rules of ``docs/architecture.md`` (read from its table), no import
cycle, no import of another package's private module, a small top level, no oversized module, `__all__`
everywhere, no citation of briefing files outside the repository. Read from the source files (every import
statement counts, also those under ``if TYPE_CHECKING:`` and inside functions)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_LINES = 450
MAX_TOP_LEVEL_MODULES = 6
DATASET = "puzzletron.dataset"
FOUNDATION = {"errors", "config", "_checks", "_enums"}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module under src/ (a package by its ``__init__``)."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The modules of src/ that ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the module pkg.sub when there is one, else a name of pkg.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_anywhere_in_src() -> None:
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert graph["puzzletron.dataset.batch._core"] >= {"puzzletron.dataset.batch._splits"}  # edges are seen
    assert _cycles(graph) == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_at_most_450_lines(name: str) -> None:
    lines = len(MODULES[name].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not n.rpartition(".")[2].startswith("_")))
def test_public_module_declares_all(name: str) -> None:
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    names = {
        t.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    names |= {
        n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert "__all__" in names, f"{MODULES[name]} has no __all__"


def test_code_cites_no_file_outside_the_repository() -> None:
    offenders = [str(p) for p in MODULES.values() if "shared/" in p.read_text(encoding="utf-8")]
    assert offenders == []


def _package_of(module: str) -> str:
    """The architecture's unit of a module: a package of `puzzletron.dataset` (``batch``, ``formats`` ...),
    ``foundation``, ``__init__`` (the API face), ``_aliases``, ``cli`` or ``fixtures``."""
    parts = module.split(".")
    if parts[:2] == ["puzzletron", "cli"]:
        return "cli"
    if parts[:2] == ["puzzletron", "fixtures"]:
        return "fixtures"
    if module in (DATASET, "puzzletron"):
        return "__init__"
    top = parts[2]
    return "foundation" if top in FOUNDATION else top


def _rules() -> dict[str, set[str]]:
    """``package -> the packages it may import`` from the table of docs/architecture.md."""
    table = ARCHITECTURE.read_text(encoding="utf-8").split("## Import rules", 1)[1]
    rules = {}
    for name, allowed in re.findall(r"^\| (\w+) \| ([\w, ]+) \|$", table, flags=re.M):
        if name != "package":
            rules[name] = set() if allowed == "nothing" else {a.strip() for a in allowed.split(",")}
    return rules


RULES = _rules()


def test_the_architecture_table_names_every_package_of_the_dataset() -> None:
    packages = {p.name for p in (SRC / "puzzletron" / "dataset").iterdir() if (p / "__init__.py").is_file()}
    assert packages <= set(RULES), sorted(packages - set(RULES))
    assert RULES["batch"] == {"foundation"} and RULES["fixtures"] == set()  # the table parses


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports in ``graph`` (module -> the modules it imports) that the architecture's table forbids."""
    broken = []
    for name, targets in graph.items():
        mine = _package_of(name)
        if mine in ("cli", "__init__", "_aliases"):
            continue  # the face, the alias hook and the command line may import any package
        if mine == "foundation":
            allowed = {"foundation"}
        else:
            allowed = RULES.get(mine, set()) | {mine} | ({"foundation"} if mine != "fixtures" else set())
        broken += [
            f"{name} ({mine}) imports {t} ({_package_of(t)})"
            for t in sorted(targets)
            if _package_of(t) not in allowed
        ]
    return broken


def test_every_import_follows_the_layers_of_docs_architecture() -> None:
    assert _layer_violations({name: _imports(name, path) for name, path in MODULES.items()}) == []


def test_the_layer_check_finds_planted_violations() -> None:
    planted = {
        "puzzletron.dataset.packing._plan": {
            "puzzletron.dataset.pipelines.text",
            "puzzletron.dataset.config",
        },
        "puzzletron.dataset.errors": {"puzzletron.dataset.batch"},
        "puzzletron.fixtures.hub": {"puzzletron.dataset.errors"},
        "puzzletron.cli._demo": {"puzzletron.dataset.pipelines.text"},
    }
    assert _layer_violations(planted) == [
        "puzzletron.dataset.packing._plan (packing) imports puzzletron.dataset.pipelines.text (pipelines)",
        "puzzletron.dataset.errors (foundation) imports puzzletron.dataset.batch (batch)",
        "puzzletron.fixtures.hub (fixtures) imports puzzletron.dataset.errors (foundation)",
    ]


def _private_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a ``_private`` module owned by a package the importer is not inside."""
    broken = []
    for name, targets in graph.items():
        for target in sorted(targets):
            parts = target.split(".")
            private = next(
                (i for i, part in enumerate(parts) if part.startswith("_") and part[1:2] != "_"), None
            )
            if private is None:
                continue
            owner = ".".join(parts[:private])
            if owner and not (name == owner or name.startswith(owner + ".")):
                broken.append(f"{name} -> {target}")
    return broken


def test_no_module_imports_another_packages_private_module() -> None:
    assert _private_imports({name: _imports(name, path) for name, path in MODULES.items()}) == []


def test_the_private_import_check_finds_a_planted_one() -> None:
    planted = {
        "puzzletron.dataset.pipelines.text": {"puzzletron.dataset.packing._build"},
        "puzzletron.dataset.packing.sources": {"puzzletron.dataset.packing._units"},
        "puzzletron.dataset.batch._core": {"puzzletron.dataset._checks"},
    }
    assert _private_imports(planted) == [
        "puzzletron.dataset.pipelines.text -> puzzletron.dataset.packing._build"
    ]


def test_the_top_level_of_the_dataset_package_is_small() -> None:
    top = sorted(p.name for p in (SRC / "puzzletron" / "dataset").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_importing_every_module_prints_nothing() -> None:
    """A fresh interpreter imports every module of the distribution (the CLI, the clients, the HF Trainer
    subclass) and writes nothing to stdout or stderr: no warning of a dependency's import (torchao's CUDA
    kernels, torch's pytree registrations) reaches the user of this library."""
    names = sorted(n for n in MODULES if not n.endswith("__main__"))
    code = "import importlib\nfor name in " + repr(names) + ":\n    importlib.import_module(name)\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (done.stdout, done.stderr) == ("", "")

"""Import paths of earlier releases, kept working: each old module path is a thin alias holding the same
objects as the modules that now own them (``docs/architecture.md`` lists the packages).

    from puzzletron.dataset.text import build_batches        # = puzzletron.dataset.pipelines.text
    from puzzletron.dataset.sampler import PackedBatches     # = puzzletron.dataset.distributed

An import hook (`install`, run by ``puzzletron.dataset``'s ``__init__``) answers for the old paths only;
the alias module is made on first import, from the new modules' ``__all__`` (first listed wins).
New code imports the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

__all__ = ["OLD_PATHS", "install"]

_PACKAGE = "puzzletron.dataset"

# old module (relative to puzzletron.dataset) -> the modules whose public names it holds
OLD_PATHS: dict[str, tuple[str, ...]] = {
    "acquisition": ("sources",),
    "acquisition.specs": ("sources.specs",),
    "acquisition.quotas": ("sources.quotas",),
    "acquisition.puzzle_kd": ("sources.puzzle_kd",),
    "acquisition.nemotron_vlm": ("sources.nemotron_vlm",),
    "acquisition.intersyn": ("sources.intersyn",),
    "attention": ("clients.attention",),
    "automodel": ("clients.automodel.adapter",),
    "build_store": ("tokenize.store", "tokenize.identity"),
    "factory": ("clients.automodel.vlm_factory",),
    "formats.subset_reader": ("formats.subset.reader",),
    "formats.subset_verify": ("formats.subset.verify",),
    "formats.subset_writer": ("formats.subset.writer",),
    "formats.token_store_verify": ("formats.token_store.verify",),
    "formats.token_store_writer": ("formats.token_store.writer",),
    "hf_trainer": ("clients.hf_trainer", "distributed.loader"),
    "llm_factory": ("clients.automodel.llm_factory",),
    "parallel": ("batch.cp",),
    "pipeline": ("pipelines.text",),
    "sampler": ("distributed.sampler", "distributed.batches"),
    "sharding": ("distributed.sharding",),
    "subset": ("formats.subset",),
    "text": ("pipelines.text", "tokenize"),
}


def _alias(name: str, targets: tuple[str, ...]) -> ModuleType:
    module = ModuleType(name, f"Old import path of {', '.join(f'{_PACKAGE}.{t}' for t in targets)}.")
    names: list[str] = []
    for target in reversed(targets):  # the first target wins a name two of them export
        owner = importlib.import_module(f"{_PACKAGE}.{target}")
        for attr in owner.__all__:
            setattr(module, attr, getattr(owner, attr))
            names.append(attr)
    module.__all__ = sorted(set(names))
    return module


class _OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old module paths (and nothing else) and loads each as its alias module."""

    def find_spec(
        self, fullname: str, path: object, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        old = fullname.removeprefix(f"{_PACKAGE}.")
        if old == fullname or old not in OLD_PATHS:
            return None
        has_children = any(other.startswith(f"{old}.") for other in OLD_PATHS)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=has_children)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return _alias(spec.name, OLD_PATHS[spec.name.removeprefix(f"{_PACKAGE}.")])

    def exec_module(self, module: ModuleType) -> None:
        pass  # filled by create_module


def install() -> None:
    """Put the old-path finder first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(finder, _OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OldPathFinder())

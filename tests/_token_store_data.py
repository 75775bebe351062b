"""A small Puzzle-KD text snapshot for the token-store tests: the fixture Hub's rows (schema-faithful) with
a few edits a real split has (rows without an assistant turn, unicode, an empty reply, a leading assistant
turn), materialised as a real text snapshot (manifest with every file's SHA-256). Its fixtures:
``_token_store_fixtures``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import datasets

from puzzletron.dataset.sources import TextAcquisitionSpec, materialize_puzzle_kd_dataset
from puzzletron.fixtures.hub import PUZZLE_KD, FixtureHub

__all__ = [
    "ROWS_PER_SHARD",
    "SKIPPED_ROWS",
    "TRAIN_ROWS",
    "VALIDATION_ROWS",
    "fixture_rows",
    "make_snapshot",
]

TRAIN_ROWS = 200
VALIDATION_ROWS = 24
ROWS_PER_SHARD = 32  # 200 rows: 7 shards, the last one partial
SKIPPED_ROWS = (5, 11, 64)  # no assistant turn: system + user, system alone, user alone


def _edit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = copy.deepcopy(rows)
    rows[5]["messages"] = rows[5]["messages"][:2]  # system + user only
    rows[11]["messages"] = rows[11]["messages"][:1]  # the empty system turn alone
    rows[64]["messages"] = [{"role": "user", "content": "Nobody answers this."}]
    rows[17]["messages"][-1]["content"] = ""  # an empty reply: only its <|im_end|> is supervised
    rows[23]["messages"][1]["content"] += " héllo wörld — 日本語 😀🚀 👩‍👩‍👧 e\u0301"
    rows[23]["messages"][-1]["content"] = "naïve café ✓ ≤ ∑ " + rows[23]["messages"][-1]["content"]
    rows[29]["messages"] = [{"role": "assistant", "content": "I open."}, *rows[29]["messages"][1:]]
    return rows


def fixture_rows(fixture_hub: FixtureHub, split: str, count: int) -> list[dict[str, Any]]:
    """The first `count` rows of the fixture Puzzle-KD `split`, edited (see the module docstring)."""
    files = sorted(str(p) for p in fixture_hub.repo_dir(PUZZLE_KD).glob(f"data/{split}-*.parquet"))
    table = datasets.load_dataset("parquet", data_files=files, split="train").select(range(count))
    return _edit(table.to_list()) if split == "train" else table.to_list()


def make_snapshot(fixture_hub: FixtureHub, out: Path) -> Path:
    """A text snapshot of `TRAIN_ROWS` + `VALIDATION_ROWS` edited fixture rows at `out`."""
    rows = {
        "train": fixture_rows(fixture_hub, "train", TRAIN_ROWS),
        "validation": fixture_rows(fixture_hub, "validation", VALIDATION_ROWS),
    }

    def loader(source: str, *, split: str, revision: str, seed: int) -> list[dict[str, Any]]:
        return rows[split]

    spec = TextAcquisitionSpec(output_dir=out, train_samples=TRAIN_ROWS, validation_samples=VALIDATION_ROWS)
    materialize_puzzle_kd_dataset(spec, dataset_loader=loader, revision_resolver=lambda s, r: "f" * 40)
    return out

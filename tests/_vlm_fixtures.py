"""The fixtures the VLM tests share (tokenize/, formats/vlm_store/, pipelines/, clients/, cli/): the two
fixture processors (Qwen2.5-VL, Qwen3-VL), a subset of `_vlm_data.vlm_samples` and its VLM store under
each processor. A plugin module, registered by ``pytest_plugins`` in the root ``conftest.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from _vlm_data import make_subset
from puzzletron.dataset.tokenize import build_vlm_store
from puzzletron.fixtures.tokenizer import build_qwen2_5_vl_processor, build_qwen3_vl_processor

__all__ = ["VLM_ROWS", "VLM_ROWS_PER_SHARD", "processor_dirs", "vlm_stores", "vlm_subset"]

VLM_ROWS = 40
VLM_ROWS_PER_SHARD = 16  # 3 shards, the last one partial


@pytest.fixture(scope="session")
def processor_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"qwen2_5_vl": dir, "qwen3_vl": dir}``: the fixture processors, saved."""
    root = tmp_path_factory.mktemp("processors")
    return {
        "qwen2_5_vl": build_qwen2_5_vl_processor(root / "qwen2_5_vl"),
        "qwen3_vl": build_qwen3_vl_processor(root / "qwen3_vl"),
    }


@pytest.fixture(scope="session")
def vlm_subset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`VLM_ROWS` samples of `_vlm_data.vlm_samples` as a conversation subset."""
    return make_subset(tmp_path_factory.mktemp("vlm") / "subset", VLM_ROWS)


@pytest.fixture(scope="session")
def vlm_stores(vlm_subset: Path, processor_dirs: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    """The VLM store of `vlm_subset` under each fixture processor (`VLM_ROWS_PER_SHARD` rows a shard)."""
    root = tmp_path_factory.mktemp("vlm-stores")
    return {
        kind: build_vlm_store(vlm_subset, processor=d, output=root / kind, rows_per_shard=VLM_ROWS_PER_SHARD)
        for kind, d in processor_dirs.items()
    }

"""The acquisition specs: `TextAcquisitionSpec` and `VlmAcquisitionSpec` normalise their fields, give a
JSON-able identity without the output directory, take keyword arguments only, and refuse every bad value
with a `ConfigError`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from puzzletron.dataset import TextAcquisitionSpec, VlmAcquisitionSpec
from puzzletron.dataset.errors import ConfigError
from puzzletron.fixtures.hub import PUZZLE_KD


def test_specs_validate_and_normalise_their_fields(tmp_path: Path) -> None:
    spec = VlmAcquisitionSpec(
        output_dir=str(tmp_path), subsets=(" a ", "b"), subset_rows=(("a", 10), ("b", 30))
    )
    assert spec.subsets == ("a", "b") and spec.output_dir == tmp_path
    assert VlmAcquisitionSpec(output_dir=tmp_path, subsets=("a", "b")).subset_rows == (("a", 1), ("b", 1))
    identity = spec.identity(revision="abc")
    assert identity["adapter"] == "nemotron_vlm_v2" and identity["revision"] == "abc"
    assert identity["subsets"] == ["a", "b"] and identity["subset_rows"] == {"a": 10, "b": 30}
    assert "output_dir" not in identity
    json.dumps(identity)
    text = TextAcquisitionSpec(output_dir=tmp_path).identity(revision="r")
    assert text == {
        "adapter": "puzzle_kd_v2",
        "train_samples": 8192,
        "validation_samples": 1024,
        "seed": 408,
        "revision": "r",
        "source": PUZZLE_KD,
    }
    with pytest.raises(TypeError):
        TextAcquisitionSpec(tmp_path)  # type: ignore[misc]
    for bad in (
        {"train_samples": 0},
        {"validation_samples": -1},
        {"train_samples": True},
        {"source": "no-slash"},
        {"revision": " "},
    ):
        with pytest.raises(ConfigError):
            TextAcquisitionSpec(output_dir=tmp_path, **bad)
    for bad in (
        {"subsets": ()},
        {"subsets": ("a", " a")},
        {"subsets": ("a", "")},
        {"subsets": ("a", "b"), "subset_rows": (("b", 1), ("a", 1))},
        {"subsets": ("a",), "subset_rows": (("a", 0),)},
        {"num_samples": 0},
        {"max_shards_per_subset": 0},
    ):
        with pytest.raises(ConfigError):
            VlmAcquisitionSpec(output_dir=tmp_path, **bad)

"""`PackingSpec` / `PuzzletronDataSpec` (contract 4): rules, messages naming the key, `from_mapping`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from puzzletron.dataset import DataLayout, Modality, PackingSpec, PuzzletronDataSpec
from puzzletron.dataset.errors import ConfigError

PACKED = {
    "modality": "text",
    "layout": "packed_varlen",
    "max_sample_length": 4096,
    "packing": {"pack_size": 4096, "packing_ratio": 0.9, "drop_long_samples": True},
}


def test_packing_spec_defaults() -> None:
    spec = PackingSpec(128)
    assert (spec.pack_size, spec.packing_ratio, spec.drop_long_samples) == (128, 1.0, True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pack_size": 0}, "data.packing.pack_size must be > 0"),
        ({"pack_size": -3}, "data.packing.pack_size must be > 0"),
        ({"pack_size": 4.0}, "data.packing.pack_size must be a positive int"),
        ({"pack_size": True}, "data.packing.pack_size must be a positive int"),
        ({"pack_size": 8, "packing_ratio": 0}, r"data.packing.packing_ratio must be in \(0, 1\]"),
        ({"pack_size": 8, "packing_ratio": 1.01}, r"data.packing.packing_ratio must be in \(0, 1\]"),
        ({"pack_size": 8, "packing_ratio": float("nan")}, "data.packing.packing_ratio"),
        ({"pack_size": 8, "packing_ratio": "0.5"}, "data.packing.packing_ratio must be a number"),
        ({"pack_size": 8, "drop_long_samples": "maybe"}, "data.packing.drop_long_samples must be a boolean"),
        ({"pack_size": 8, "drop_long_samples": 2}, "data.packing.drop_long_samples must be a boolean"),
    ],
)
def test_packing_spec_rules(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PackingSpec(**kwargs)


def test_config_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        PackingSpec(0)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("false", False), ("False", False), ("no", False), ("0", False), ("true", True), (1, True)],
)
def test_booleans_are_parsed_strictly(raw: object, expected: bool) -> None:
    assert PackingSpec(8, drop_long_samples=raw).drop_long_samples is expected  # type: ignore[arg-type]


def test_data_spec_coerces_enum_strings_before_the_packing_rule() -> None:
    # The original let layout="packed_varlen" (a string) skip the "packing required" rule.
    with pytest.raises(ConfigError, match=r"data.packing is required when data.layout is packed_varlen"):
        PuzzletronDataSpec(modality="text", layout="packed_varlen", max_sample_length=8)  # type: ignore[arg-type]
    spec = PuzzletronDataSpec("multimodal", "fixed", 8)  # type: ignore[arg-type]
    assert spec.modality is Modality.MULTIMODAL
    assert spec.layout is DataLayout.FIXED


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"modality": "audio", "layout": "fixed", "max_sample_length": 8}, "data.modality must be one of"),
        ({"modality": "text", "layout": "varlen", "max_sample_length": 8}, "data.layout must be one of"),
        (
            {"modality": "text", "layout": "fixed", "max_sample_length": 0},
            "data.max_sample_length must be > 0",
        ),
        (
            {"modality": "text", "layout": "fixed", "max_sample_length": 8, "packing": PackingSpec(8)},
            "data.packing is only valid with data.layout packed_varlen",
        ),
        (
            {
                "modality": "text",
                "layout": "packed_varlen",
                "max_sample_length": 9,
                "packing": PackingSpec(8),
            },
            r"data.max_sample_length \(9\) must be <= data.packing.pack_size \(8\)",
        ),
        (
            {
                "modality": "text",
                "layout": "packed_varlen",
                "max_sample_length": 8,
                "packing": {"pack_size": 8},
            },
            "data.packing must be a PackingSpec",
        ),
    ],
)
def test_data_spec_rules(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PuzzletronDataSpec(**kwargs)


def test_sequence_length_and_legacy_varlen() -> None:
    packed = PuzzletronDataSpec(Modality.TEXT, DataLayout.PACKED_VARLEN, 100, PackingSpec(256))
    assert packed.sequence_length == 256
    assert packed.legacy_varlen is True
    fixed = PuzzletronDataSpec(Modality.TEXT, DataLayout.FIXED, 100)
    assert fixed.sequence_length == 100
    assert fixed.legacy_varlen is False


def test_from_mapping_parses_the_canonical_block() -> None:
    spec = PuzzletronDataSpec.from_mapping(PACKED)
    assert spec == PuzzletronDataSpec(
        Modality.TEXT, DataLayout.PACKED_VARLEN, 4096, PackingSpec(4096, 0.9, True)
    )
    assert spec.extras == {}


def test_from_mapping_with_null_packing() -> None:
    spec = PuzzletronDataSpec.from_mapping(
        {"modality": "multimodal", "layout": "fixed", "max_sample_length": 64, "packing": None}
    )
    assert spec.packing is None
    assert spec.sequence_length == 64


def test_from_mapping_rejects_varlen_with_a_migration_message() -> None:
    with pytest.raises(ConfigError, match=r"data.varlen.*data.layout: packed_varlen"):
        PuzzletronDataSpec.from_mapping({**PACKED, "varlen": True})


@pytest.mark.parametrize("key", ["modality", "layout", "max_sample_length"])
def test_from_mapping_names_a_missing_key(key: str) -> None:
    raw = {k: v for k, v in PACKED.items() if k != key}
    with pytest.raises(ConfigError, match=f"canonical data config is missing data.{key}"):
        PuzzletronDataSpec.from_mapping(raw)


def test_missing_key_suggests_a_misspelling() -> None:
    raw = {"modality": "text", "layout": "fixed", "max_sample_lenght": 8}
    with pytest.raises(ConfigError, match="did you mean 'max_sample_lenght'"):
        PuzzletronDataSpec.from_mapping(raw)


def test_from_mapping_packing_needs_pack_size_and_rejects_unknown_keys() -> None:
    with pytest.raises(ConfigError, match=r"data.packing.pack_size is required"):
        PuzzletronDataSpec.from_mapping({**PACKED, "packing": {"packing_ratio": 0.5}})
    with pytest.raises(ConfigError, match=r"data.packing.pack_ratio \(did you mean 'packing_ratio'\?\)"):
        PuzzletronDataSpec.from_mapping({**PACKED, "packing": {"pack_size": 8, "pack_ratio": 0.5}})
    with pytest.raises(ConfigError, match=r"data.packing must be a mapping"):
        PuzzletronDataSpec.from_mapping({**PACKED, "packing": 4096})


def test_from_mapping_parses_string_booleans_strictly() -> None:
    spec = PuzzletronDataSpec.from_mapping(
        {**PACKED, "packing": {"pack_size": 4096, "drop_long_samples": "false"}}
    )
    assert spec.packing is not None and spec.packing.drop_long_samples is False
    with pytest.raises(ConfigError, match=r"data.packing.drop_long_samples"):
        PuzzletronDataSpec.from_mapping(
            {**PACKED, "packing": {"pack_size": 4096, "drop_long_samples": "maybe"}}
        )


def test_from_mapping_passes_unrelated_keys_through_extras() -> None:
    spec = PuzzletronDataSpec.from_mapping(
        {**PACKED, "path": "/data/subset", "calibration": {"num_samples": 16}}
    )
    assert dict(spec.extras) == {"path": "/data/subset", "calibration": {"num_samples": 16}}
    with pytest.raises(TypeError):
        spec.extras["path"] = "x"  # type: ignore[index]
    # extras are not part of equality or hashing: the data description is the same.
    assert spec == PuzzletronDataSpec.from_mapping(PACKED)
    assert hash(spec) == hash(PuzzletronDataSpec.from_mapping(PACKED))


def test_from_mapping_accepts_an_omegaconf_dictconfig() -> None:
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({**PACKED, "path": "/x"})
    spec = PuzzletronDataSpec.from_mapping(cfg)
    assert spec.packing == PackingSpec(4096, 0.9, True)
    assert spec.extras["path"] == "/x"


def test_from_mapping_rejects_a_non_mapping() -> None:
    with pytest.raises(ConfigError, match="data must be a mapping"):
        PuzzletronDataSpec.from_mapping(["modality"])  # type: ignore[arg-type]


def test_a_spec_with_extras_pickles_round_trip_for_spawned_workers() -> None:
    import pickle

    spec = PuzzletronDataSpec.from_mapping({**PACKED, "path": "/data/subset"})
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec and dict(again.extras) == {"path": "/data/subset"}
    with pytest.raises(TypeError):
        again.extras["path"] = "x"  # type: ignore[index]


def test_the_default_cache_dir_is_per_user_and_overridable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from puzzletron.dataset.config import default_cache_dir

    monkeypatch.delenv("PUZZLETRON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "puzzletron" / "stores"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "puzzletron" / "stores"
    monkeypatch.setenv("PUZZLETRON_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"  # read at every call

"""The YAML form of a mixture (`pipelines.mixture_config`): read by `read_mixture`, instantiated by Hydra."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.pipelines.mixture import build_mixture_batches
from puzzletron.dataset.pipelines.mixture_config import read_mixture
from puzzletron.dataset.tokenize import build_token_store

SPEC = """
  modality: text
  layout: packed_varlen
  max_sample_length: 512
  packing: {pack_size: 512}
"""


@pytest.fixture(scope="module")
def stores(snapshot: Path, tokenizer_dir: Path, tmp_path_factory) -> dict[str, Path]:
    cache = tmp_path_factory.mktemp("yaml-stores")
    return {
        s: build_token_store(snapshot, tokenizer=tokenizer_dir, cache_dir=cache, split=s)
        for s in ("train", "validation")
    }


def test_hydra_instantiates_a_mixture_from_yaml_and_gives_the_python_calls_batches(stores) -> None:
    yaml = f"""
data:{SPEC}
  mixture:
    chat: {{path: {stores["train"]}, weight: 3}}
    eval: {{path: {stores["validation"]}, weight: 1}}
    num_tokens: 20480
batches:
  _target_: puzzletron.dataset.pipelines.mixture_config.mixture_batches
  data: ${{data}}
  batch_size: 2
  seed: 4
"""
    config = OmegaConf.create(yaml)
    batches = instantiate(config.batches, _convert_="all")
    direct = build_mixture_batches(
        {"chat": stores["train"], "eval": stores["validation"]},
        weights={"chat": 3, "eval": 1},
        spec=read_mixture(OmegaConf.to_container(config.data)).spec,
        batch_size=2,
        seed=4,
        num_tokens=20480,
    )
    assert [b.fingerprint for b in batches] == [b.fingerprint for b in direct]


def test_a_schedule_in_yaml_is_the_schedule_of_the_call(stores) -> None:
    data = OmegaConf.create(
        f"""{SPEC}
  mixture:
    chat: {{path: {stores["train"]}}}
    eval: {{path: {stores["validation"]}}}
    schedule:
      - {{from_token: 0, weights: {{chat: 0.9, eval: 0.1}}}}
      - {{from_token: 4096, weights: {{chat: 0.1, eval: 0.9}}}}
"""
    )
    mixture = read_mixture(data)
    assert mixture.sources == {"chat": str(stores["train"]), "eval": str(stores["validation"])}
    assert [dict(e) for e in mixture.weights] == [
        {"from_token": 0, "weights": {"chat": 0.9, "eval": 0.1}},
        {"from_token": 4096, "weights": {"chat": 0.1, "eval": 0.9}},
    ]
    assert read_mixture(OmegaConf.create(SPEC)) is None  # no mixture block: none


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ("a: {path: x}", "data.mixture.a.weight is missing"),
        ("a: {path: x, wieght: 1}", "data.mixture.a.wieght is not a component key (did you mean 'weight'?)"),
        ("a: {weight: 1}", "data.mixture.a.path is required"),
        ("a: {path: x, weight: 1}\n    schedule: [{from_token: 0, weights: {a: 1}}]", "in one place"),
        ("a: {path: x, weight: -2}", "must be >= 0"),
        ("a: {path: x}\n    schedule: [{from_token: 0, weights: {a: 1, b: 1}}]", "unknown component 'b'"),
    ],
)
def test_a_bad_mixture_block_names_the_key(block: str, message: str) -> None:
    data = OmegaConf.create(f"{SPEC}\n  mixture:\n    {block}\n")
    with pytest.raises(
        ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")
    ):
        read_mixture(data)

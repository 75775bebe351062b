"""The Hydra dataset factory: AutoModel YAML instantiates it, round-robin order, items are private copies."""

from __future__ import annotations

import pickle
from collections.abc import Sized

import pytest
import yaml
from hydra.utils import instantiate
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset

from _conversation_samples import multi_samples, single_samples
from puzzletron.dataset import (
    load_materialized_conversation_dataset,
    materialize_normalized_conversation_samples,
)
from puzzletron.dataset.clients.automodel.vlm_factory import round_robin_order
from puzzletron.dataset.errors import ConfigError, ConversationError


@pytest.fixture
def subset(tmp_path):
    """4 single-turn then 2 multi-turn samples: two (dataset, revision) groups."""
    dest = tmp_path / "subset"
    materialize_normalized_conversation_samples(iter([*single_samples(4), *multi_samples(2)]), dest)
    return dest


def _ids(dataset):
    return [dataset[i]["source"]["row_id"] for i in range(len(dataset))]


AUTOMODEL_YAML = """
dataset:
  _target_: puzzletron.dataset.load_materialized_conversation_dataset
  path_or_dataset: {path}
  num_samples: 5
  max_length: 2048
  pretokenize: false
  truncate: true
  inject_fake_images: false
"""


def test_hydra_instantiate_from_automodel_yaml(subset):
    cfg = OmegaConf.create(yaml.safe_load(AUTOMODEL_YAML.format(path=subset)))
    dataset = instantiate(cfg.dataset)
    assert isinstance(dataset, Dataset) and isinstance(dataset, Sized)
    assert len(dataset) == 5
    assert _ids(dataset) == ["s0", "m0", "s1", "m1", "s2"]
    item = dataset[1]
    assert item["conversation"][0]["content"][0]["image"] == str(subset / "images/000004_00.png")
    assert dataset.options["max_length"] == 2048 and dataset.options["truncate"] is True


def test_hydra_misspelled_option_is_a_type_error_naming_it(subset):
    cfg = OmegaConf.create(
        yaml.safe_load(AUTOMODEL_YAML.format(path=subset).replace("num_samples", "num_sample"))
    )
    with pytest.raises(Exception, match=r"'num_sample' \(did you mean 'num_samples'\?\)") as info:
        instantiate(cfg.dataset)
    cause = info.value if isinstance(info.value, TypeError) else info.value.__cause__
    assert isinstance(cause, TypeError)
    with pytest.raises(TypeError, match="'shuffle'"):
        load_materialized_conversation_dataset(subset, shuffle=True)


def test_round_robin_keeps_each_group_order():
    assert round_robin_order([0, 0, 0, 1, 1, 2]) == [0, 3, 5, 1, 4, 2]
    assert round_robin_order([1, 0, 1, 0]) == [0, 1, 2, 3]
    assert round_robin_order([]) == []


def test_all_samples_without_num_samples(subset):
    assert _ids(load_materialized_conversation_dataset(subset)) == ["s0", "m0", "s1", "m1", "s2", "s3"]


@pytest.mark.parametrize("bad", [0, -1, 7, True])
def test_num_samples_must_be_positive_and_available(subset, bad):
    # a ValueError as the contract says, and one of the library's (ConfigError) like every other error
    with pytest.raises(ConfigError, match="num_samples"):
        load_materialized_conversation_dataset(subset, num_samples=bad)


def test_items_are_private_copies(subset):
    dataset = load_materialized_conversation_dataset(subset, num_samples=2)
    dataset[0]["conversation"].clear()
    dataset[0]["source"]["row_id"] = "changed"
    assert dataset[0]["source"]["row_id"] == "s0" and dataset[0]["conversation"]
    in_memory = single_samples(2)
    from_list = load_materialized_conversation_dataset(in_memory)
    from_list[0]["conversation"].clear()
    assert in_memory[0]["conversation"] and from_list[0]["conversation"]


def test_dataset_reads_lazily(subset):
    lines = (subset / "samples.jsonl").read_bytes().split(b"\n")
    lines[3] = b" " * len(lines[3])  # sample 3 (s3) unreadable; the first 4 in order do not need it
    (subset / "samples.jsonl").write_bytes(b"\n".join(lines))
    dataset = load_materialized_conversation_dataset(subset, num_samples=4)
    assert _ids(dataset) == ["s0", "m0", "s1", "m1"]


def test_works_with_a_dataloader_and_pickles(subset):
    dataset = load_materialized_conversation_dataset(subset, num_samples=4)
    clone = pickle.loads(pickle.dumps(dataset))
    assert _ids(clone) == _ids(dataset)
    batches = list(DataLoader(dataset, batch_size=2, collate_fn=list))
    assert [[s["source"]["row_id"] for s in b] for b in batches] == [["s0", "m0"], ["s1", "m1"]]


def test_bad_control_types_are_rejected(subset):
    with pytest.raises(ConfigError, match="max_length"):
        load_materialized_conversation_dataset(subset, max_length="long")
    with pytest.raises(ValueError, match="truncate"):
        load_materialized_conversation_dataset(subset, truncate="yes")


@given(st.lists(st.integers(0, 4), max_size=60))
def test_round_robin_is_a_permutation_that_keeps_each_group_order(groups):
    order = round_robin_order(groups)
    assert sorted(order) == list(range(len(groups)))
    for g in set(groups):
        assert [i for i in order if groups[i] == g] == [i for i, x in enumerate(groups) if x == g]
    # Each prefix takes from every group as evenly as the groups allow (counts differ by at most one
    # among groups that still have samples left).
    for n in range(len(order) + 1):
        taken = {g: sum(groups[i] == g for i in order[:n]) for g in set(groups)}
        left = {g for g in taken if taken[g] < groups.count(g)}
        assert all(taken[g] >= max(taken.values()) - 1 for g in left)


def test_numpy_and_torch_integer_indices_work(subset):
    import numpy as np
    import torch

    dataset = load_materialized_conversation_dataset(subset)
    assert dataset[np.int64(1)]["source"]["row_id"] == "m0"
    assert dataset[torch.tensor(2)]["source"]["row_id"] == "s1"
    with pytest.raises(TypeError):
        dataset["1"]


def test_factory_docstring_examples_run():
    import doctest

    import puzzletron.dataset.clients.automodel.vlm_factory as factory

    result = doctest.testmod(factory)
    assert result.attempted >= 1 and result.failed == 0


def test_an_in_memory_sample_without_source_is_a_conversation_error():
    samples = single_samples(2)
    del samples[1]["source"]
    with pytest.raises(ConversationError, match="sample 1: missing 'source' mapping"):
        load_materialized_conversation_dataset(samples)

"""The public API of `puzzletron.dataset` matches the seed list, name for name and parameter for parameter."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import puzzletron.dataset as api

SEED = Path(__file__).parent / "golden" / "seed-api.txt"


def _seed_signatures() -> dict[str, list[tuple[str, bool, bool]]]:
    """`name -> [(param, keyword_only, has_default)]`; methods keyed `Class.method`, classes by `__init__`."""
    lines = [ln.strip().rstrip("\uf0c1").strip() for ln in SEED.read_text().splitlines()]
    head = lines[: lines.index("class DataLayout")]
    functions = {ln.split()[0].strip("`") for ln in head[head.index("Functions") + 1 :] if ln}
    out: dict[str, list[tuple[str, bool, bool]]] = {}
    current = None
    for line in lines:
        if m := re.match(r"^class (\w+)$", line):
            current = m.group(1)
            continue
        m = re.match(r"^(?:classmethod )?(\w+)\((.*)\)$", line)
        if not m or m.group(1) == "__new__":
            continue
        name, args = m.groups()
        key = name if name in functions else current if name == "__init__" else f"{current}.{name}"
        params, kw_only, depth, token = [], False, 0, ""
        for ch in args + ",":
            depth += (ch in "(<[{") - (ch in ")>]}")
            if ch == "," and depth == 0:
                token = token.strip()
                if token.startswith("*") and not token.startswith("**"):
                    kw_only = True
                elif token and not token.startswith("**"):
                    params.append((token.split("=")[0].strip(), kw_only, "=" in token))
                token = ""
            else:
                token += ch
        out.setdefault(key, params)
    return out


def _seed_names() -> set[str]:
    """The names of the seed's "Classes" and "Functions" index, one backticked name per line."""
    return set(re.findall(r"^`(\w+)`", SEED.read_text().split("class DataLayout")[0], flags=re.M))


SIGNATURES = _seed_signatures()


def test_seed_list_parses_into_every_public_name() -> None:
    assert len(_seed_names()) == 20
    assert {key.split(".")[0] for key in SIGNATURES} == _seed_names() - {"DataLayout", "Modality"}
    assert "PuzzletronBatch.dp_slice" in SIGNATURES


# Names an issue asked to add to the seed API (issue 16: the native VLM path).
ADDED = {"build_mixture_batches", "build_vlm_batches"}


def test_package_exports_exactly_the_seed_names_and_the_asked_additions() -> None:
    assert sorted(api.__all__) == sorted(_seed_names() | ADDED)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_matches_seed(name: str) -> None:
    obj = api
    for part in name.split("."):
        obj = getattr(obj, part)
    got = [
        (p.name, p.kind is inspect.Parameter.KEYWORD_ONLY, p.default is not inspect.Parameter.empty)
        for p in inspect.signature(obj).parameters.values()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in ("self", "cls")
    ]
    want = SIGNATURES[name]
    # Additions an issue asks for are allowed only as optional keyword-only parameters after the seed's.
    assert got[: len(want)] == want
    assert all(kw and default for _, kw, default in got[len(want) :]), got


def test_seed_defaults_have_the_listed_values() -> None:
    assert api.TextAcquisitionSpec.__dataclass_fields__["seed"].default == 408
    assert api.VlmAcquisitionSpec.__dataclass_fields__["subsets"].default == (
        "sparsetables",
        "plotqa_cot",
        "wiki_en",
    )
    assert api.VlmAcquisitionSpec.__dataclass_fields__["seed"].default == 42
    assert inspect.signature(api.materialize_intersyn_subset).parameters["rows_per_source"].default == 8
    assert inspect.signature(api.PackingSpec).parameters["packing_ratio"].default == 1.0
    assert api.DataLayout.PACKED_VARLEN.value == "packed_varlen"
    assert api.Modality.MULTIMODAL.value == "multimodal"


def test_every_public_name_resolves_and_star_import_works() -> None:
    namespace: dict[str, object] = {}
    exec("from puzzletron.dataset import *", namespace)
    assert set(api.__all__) <= set(namespace)
    assert set(api.__all__) <= set(dir(api))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        _ = api.not_a_name


def test_reading_subsets_offline_does_not_import_torch_or_the_hub() -> None:
    code = (
        "import sys\n"
        "from puzzletron.dataset import load_materialized_conversation_subset, normalize_intersyn_single\n"
        "heavy = [m for m in ('torch', 'datasets', 'huggingface_hub') if m in sys.modules]\n"
        "print(','.join(heavy) or 'none')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "none"


# Every name these modules exported before the package was reshaped into sub-packages (issue 15), by its
# old path (the aliases of `puzzletron.dataset._aliases`, and the packages that kept their path).
DOCUMENTED_PATHS = {
    "parallel": [
        "batch_cp_indices",
        "gather_cp_partitions",
        "inverse_cp_permutation",
        "load_balanced_cp_indices",
    ],
    "text": [
        "TextBatches",
        "TokenizedText",
        "assistant_token_mask",
        "build_batches",
        "load_text_split",
        "load_tokenizer",
        "shift_labels",
        "tokenize_conversation",
        "tokenize_conversations",
    ],
    "tokenize": [
        "TokenizedRows",
        "TokenizedText",
        "assistant_token_mask",
        "labels_from_mask",
        "load_tokenizer",
        "map_tasks",
        "pad_token_id",
        "select_rows",
        "shift_labels",
        "tokenize_conversation",
        "tokenize_conversations",
        "tokenize_rows",
    ],
    "pipeline": ["TextBatches", "build_batches", "load_text_split"],
    "build_store": ["build_token_store", "identity_sha256", "short_hash", "store_identity"],
    "packing": ["PackingError", "PackingPlan", "TokenizedSamples", "build_batch", "plan_packing"],
    "sampler": ["BatchKey", "DistributedPackSampler", "PackedBatches", "deal_epoch", "steps_per_epoch"],
    "sharding": ["check_sharding"],
    "attention": ["Backend", "MaskMode", "forward_kwargs", "model_inputs"],
    "automodel": ["DocumentMap", "batch_from_automodel", "document_map", "forward_kwargs"],
    "factory": ["ConversationDataset", "load_materialized_conversation_dataset", "round_robin_order"],
    "llm_factory": ["ChatRows", "make_puzzletron_chat_dataset", "resolve_text_spec"],
    "hf_trainer": [
        "BatchCollator",
        "BatchSource",
        "KeyBatchSampler",
        "PuzzletronDataLoader",
        "PuzzletronTrainer",
        "SAMPLER_STATE_FILE",
        "batch_loader",
        "check_sampler_state",
    ],
    "conversation": [
        "INTERSYN_MULTI_DATASET",
        "INTERSYN_MULTI_REVISION",
        "INTERSYN_SINGLE_DATASET",
        "INTERSYN_SINGLE_REVISION",
        "NEMOTRON_VLM_DATASET",
        "ROLES",
        "normalize_intersyn_multi",
        "normalize_intersyn_single",
        "normalize_nemotron_vlm_sample",
        "validate_conversation",
    ],
    "subset": [
        "FORMAT",
        "FORMAT_VERSION",
        "MANIFEST",
        "SubsetReader",
        "VerifyReport",
        "describe_subset",
        "load_materialized_conversation_subset",
        "load_materialized_intersyn_subset",
        "materialize_normalized_conversation_samples",
        "materialize_normalized_intersyn_samples",
        "read_manifest",
        "verify_subset",
    ],
    "acquisition": [
        "INTERSYN_ADAPTER",
        "INTERSYN_MULTI_REVISION",
        "INTERSYN_MULTI_SOURCE",
        "INTERSYN_SINGLE_REVISION",
        "INTERSYN_SINGLE_SOURCE",
        "MANIFEST_NAME",
        "NEMOTRON_VLM_ADAPTER",
        "PROGRESS_LOGGER",
        "PUZZLE_KD_ADAPTER",
        "PUZZLE_KD_DATASET",
        "RejectedRow",
        "TextAcquisitionSpec",
        "VlmAcquisitionSpec",
        "hub_vlm_rows",
        "largest_remainder_quotas",
        "materialize_intersyn_subset",
        "materialize_nemotron_vlm_dataset",
        "materialize_puzzle_kd_dataset",
        "redistribute_deficit",
        "verify_text_snapshot",
    ],
    "acquisition.specs": [
        "NEMOTRON_VLM_ADAPTER",
        "PUZZLE_KD_ADAPTER",
        "PUZZLE_KD_DATASET",
        "TextAcquisitionSpec",
        "VlmAcquisitionSpec",
        "output_path",
    ],
    "acquisition.quotas": ["largest_remainder_quotas", "redistribute_deficit"],
    "acquisition.puzzle_kd": ["materialize_puzzle_kd_dataset"],
    "acquisition.nemotron_vlm": ["hub_vlm_rows", "materialize_nemotron_vlm_dataset"],
    "acquisition.intersyn": ["INTERSYN_ADAPTER", "materialize_intersyn_subset"],
    "formats.subset_reader": [
        "SubsetReader",
        "load_materialized_conversation_subset",
        "load_materialized_intersyn_subset",
        "read_manifest",
        "subset_manifest",
    ],
    "formats.subset_writer": [
        "materialize_normalized_conversation_samples",
        "materialize_normalized_intersyn_samples",
    ],
    "formats.subset_verify": ["describe_subset", "render_subset", "verify_subset"],
    "formats.token_store": [
        "TOKEN_STORE_FORMAT",
        "TOKEN_STORE_VERSION",
        "TokenStore",
        "pread_into",
        "read_strings",
    ],
    "formats.token_store_writer": ["RECORD", "ShardWriter", "assemble_store", "read_shard_record"],
    "formats.token_store_verify": ["describe_token_store", "render_token_store", "verify_token_store"],
    "formats.text_snapshot": [
        "TEXT_SNAPSHOT_FORMAT",
        "TEXT_SNAPSHOT_KIND",
        "TEXT_SNAPSHOT_VERSION",
        "describe_text_snapshot",
        "is_unnamed_text_snapshot",
        "read_text_snapshot",
        "render_text_snapshot",
        "verify_text_snapshot",
        "write_text_snapshot",
    ],
    "config": ["PackingSpec", "PuzzletronDataSpec"],
    "errors": [
        "AcquisitionError",
        "BatchValidationError",
        "ConfigError",
        "ConversationError",
        "ImageError",
        "PuzzletronDataError",
        "SubsetError",
    ],
    "batch": [
        "DataLayout",
        "FLAT_BACKEND_KWARGS",
        "Modality",
        "PER_IMAGE_KWARGS",
        "PER_ROW_KWARGS",
        "PER_VIDEO_KWARGS",
        "PackedSequenceMetadata",
        "PuzzletronBatch",
        "ROW_KWARGS",
        "SEQUENCE_KWARGS",
        "THD_SENTINEL",
        "TOKEN_INDEX_KWARGS",
        "VIDEO_COUNT_KWARGS",
        "VIDEO_KWARGS",
    ],
}


@pytest.mark.parametrize("module", sorted(DOCUMENTED_PATHS))
def test_every_documented_name_imports_from_its_documented_path(module: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from puzzletron.dataset.{module} import {', '.join(DOCUMENTED_PATHS[module])}", namespace)
    assert all(namespace[name] is not None for name in DOCUMENTED_PATHS[module])
    # The seed names keep their identity whichever path they are imported from.
    for name in set(DOCUMENTED_PATHS[module]) & set(api.__all__):
        assert namespace[name] is getattr(api, name)


def test_every_old_path_is_an_alias_of_the_new_modules() -> None:
    from puzzletron.dataset._aliases import OLD_PATHS

    for old, targets in OLD_PATHS.items():
        alias = importlib.import_module(f"puzzletron.dataset.{old}")
        claimed: set[str] = set()
        for target in targets:  # the first target listed owns a name two of them export
            owner = importlib.import_module(f"puzzletron.dataset.{target}")
            for name in set(owner.__all__) - claimed:
                assert getattr(alias, name) is getattr(owner, name), (old, target, name)
            claimed |= set(owner.__all__)
        assert set(alias.__all__) == claimed, old


def test_an_old_path_is_not_a_new_module_and_unknown_paths_still_fail() -> None:
    import puzzletron.dataset.text as old

    import puzzletron.dataset.pipelines.text as new

    assert old is not new and old.build_batches is new.build_batches
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("puzzletron.dataset.no_such_module")


def test_subset_error_is_the_snapshot_error() -> None:
    from puzzletron.dataset.errors import SnapshotError, SubsetError

    assert SubsetError is SnapshotError and issubclass(SnapshotError, ValueError)

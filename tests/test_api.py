"""The public API of `puzzletron.dataset` matches the seed list, name for name and parameter for parameter."""

from __future__ import annotations

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


def test_package_exports_exactly_the_seed_names() -> None:
    assert sorted(api.__all__) == sorted(_seed_names())


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


# Every name these modules exported before the package was reshaped (issue 9), by its documented path.
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
    "packing": ["PackingError", "PackingPlan", "TokenizedSamples", "build_batch", "plan_packing"],
    "sampler": ["BatchKey", "DistributedPackSampler", "PackedBatches", "deal_epoch", "steps_per_epoch"],
    "automodel": ["DocumentMap", "batch_from_automodel", "document_map", "forward_kwargs"],
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
        "INTERSYN_MULTI_REVISION",
        "INTERSYN_SINGLE_REVISION",
        "MANIFEST_NAME",
        "NEMOTRON_VLM_ADAPTER",
        "PUZZLE_KD_ADAPTER",
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

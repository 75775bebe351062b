"""NeMo AutoModel 0.7.0's own finetune recipes train on this library's data factories, on the CPU.

The LLM recipe (``TrainFinetuneRecipeForNextTokenPrediction``) instantiates
`puzzletron.dataset.clients.automodel.llm_factory.make_puzzletron_chat_dataset` on a Puzzle-KD snapshot
(the fixture Hub's rows saved per split, as acquisition writes them) in each layout; the VLM recipe
(``FinetuneRecipeForVLM``) instantiates `puzzletron.dataset.load_materialized_conversation_dataset` on a
materialised subset. Tiny random models come from local ``config.json`` files (no weights, no Hub). Each
run is 3 optimizer steps; the losses the recipe writes to its ``training.jsonl`` are finite and falling,
and the LLM recipe's first loss equals the per-document loss of its first two rows under the initial
weights (float64).

AutoModel assumes CUDA in a few places; `cpu_patches` stands in for exactly those calls, in this process,
undone after the module. Each patch names the AutoModel 0.7.0 file and line it replaces.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from PIL import Image

from _tiny_models import TINY_TEXT, document_logits, qwen2_5_vl_config, reference_loss
from puzzletron.dataset import materialize_normalized_conversation_samples
from puzzletron.dataset.clients.automodel.llm_factory import make_puzzletron_chat_dataset
from puzzletron.fixtures.hub import PUZZLE_KD, FixtureHub
from puzzletron.fixtures.tokenizer import build_chat_tokenizer, build_qwen2_5_vl_processor

pytestmark = pytest.mark.slow


def _to_cpu(fn: Any) -> Any:
    """``fn`` with a CUDA ``device=`` keyword (an index or a cuda device) replaced by the CPU."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if isinstance(device, int) or (isinstance(device, torch.device) and device.type == "cuda"):
            kwargs["device"] = torch.device("cpu")
        return fn(*args, **kwargs)

    return wrapper


@pytest.fixture(scope="module")
def cpu_patches() -> Iterator[dict[str, Any]]:
    """The CUDA-only AutoModel calls, replaced for this module (process-global, undone afterwards)."""
    with pytest.MonkeyPatch.context() as patch:
        # 1. components/_peft/lora_kernel.py:491-493: `@triton.autotune(key=["S", "M", "K"])` names `S`, which
        #    is no argument of `lora_db_kernel`; triton 3.9 raises at import (imported via
        #    _transformers/auto_model.py:83 -> infrastructure.py:41 -> _peft/lora.py:33). Drop unknown keys.
        try:
            from triton.runtime.autotuner import Autotuner
        except ImportError:  # no triton: nothing to patch
            Autotuner = None
        if Autotuner is not None:
            original_init = Autotuner.__init__

            def init(
                self: Any, fn: Any, arg_names: Any, configs: Any, key: Any, *args: Any, **kw: Any
            ) -> None:
                original_init(self, fn, arg_names, configs, [k for k in key if k in arg_names], *args, **kw)

            patch.setattr(Autotuner, "__init__", init)
        # 2. recipes/llm/train_ft.py:561,1860 and recipes/vlm/finetune.py:458,1391:
        #    torch.cuda.reset_peak_memory_stats() has no CPU implementation.
        patch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
        # 3. _transformers/auto_model.py:498,770,886 and recipes/llm/train_ft.py:354,362:
        #    torch.cuda.current_device() asserts without CUDA; 0 lets `torch.device("cuda", 0)` be built ...
        patch.setattr(torch.cuda, "current_device", lambda: 0)
        import nemo_automodel._transformers.auto_model as auto_model
        import nemo_automodel._transformers.infrastructure as infrastructure
        import nemo_automodel.recipes.llm.train_ft as train_ft
        import nemo_automodel.recipes.vlm.finetune as vlm_finetune

        # 4. ... and _transformers/infrastructure.py:825 `model.to(device)` (device 0 from auto_model.py:498;
        #    instantiate_infrastructure(device=cuda) at auto_model.py:880-886 and train_ft.py:348-362) moves
        #    the model to it: those two functions get the CPU instead, where the recipes call them.
        for module in (auto_model, infrastructure, train_ft):
            for name in ("apply_model_infrastructure", "instantiate_infrastructure"):
                if hasattr(module, name):
                    patch.setattr(module, name, _to_cpu(getattr(module, name)))
        # 5. VLM only: components/datasets/vlm/collate_fns.py:608 `labels[:, 1:]` is a non-contiguous view;
        #    recipes/vlm/finetune.py:314 `_move_to_device` copies it on a GPU, not on the CPU, so
        #    components/loss/masked_ce.py:85 `labels.view(-1)` raises. Make moved tensors contiguous.
        move = vlm_finetune._move_to_device
        patch.setattr(
            vlm_finetune,
            "_move_to_device",
            lambda value, device: (
                out.contiguous() if isinstance(out := move(value, device), torch.Tensor) else out
            ),
        )
        was_initialized = torch.distributed.is_initialized()
        yield {"llm": train_ft, "vlm": vlm_finetune}
        # The recipes start a one-process gloo group; leave the process as we found it.
        if torch.distributed.is_initialized() and not was_initialized:
            torch.distributed.destroy_process_group()


def _write_yaml(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    return path


def _common(workdir: Path, model: dict[str, Any]) -> dict[str, Any]:
    """The YAML shared by both recipes: 3 steps of 2 rows, one process (gloo), no checkpoints."""
    return {
        "seed": 1234,
        "step_scheduler": {
            "global_batch_size": 2,
            "local_batch_size": 2,
            "max_steps": 3,
            "num_epochs": 1,
            "ckpt_every_steps": 1000,
            "val_every_steps": 1000,
        },
        "dist_env": {"backend": "gloo", "timeout_minutes": 1},
        "model": {
            "attn_implementation": "sdpa",
            "use_liger_kernel": False,
            "use_sdpa_patching": False,
            **model,
        },
        "distributed": {"strategy": "ddp", "dp_size": 1, "tp_size": 1, "cp_size": 1, "pp_size": 1},
        "checkpoint": {"enabled": False, "checkpoint_dir": str(workdir / "checkpoints")},
        "dataloader": {"shuffle": False},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 3.0e-3, "weight_decay": 0.0},
    }


def _run(recipe_class: Any, config_path: Path, workdir: Path) -> tuple[Any, torch.nn.Module, list[float]]:
    """Set the recipe up from its YAML with AutoModel's own loader, keep the initial model, train, and
    read the step losses back from ``training.jsonl``."""
    from nemo_automodel.components.config.loader import load_yaml_config

    recipe = recipe_class(load_yaml_config(config_path))
    recipe.setup()
    initial = copy.deepcopy(recipe.model_parts[0]).eval()
    recipe.run_train_validation_loop()
    lines = (workdir / "checkpoints" / "training.jsonl").read_text().splitlines()
    losses = [float(json.loads(line)["loss"]) for line in lines]
    assert len(losses) == 3, losses
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[0] > losses[1] > losses[2], losses
    return recipe, initial, losses


# --- LLM -----------------------------------------------------------------------------------------------

LAYOUTS = {
    "packed_varlen": {"layout": "packed_varlen"},
    "padded_varlen": {"layout": "padded_varlen"},
    "fixed": {"data": {"modality": "text", "layout": "fixed", "max_sample_length": 512}},
}


@pytest.fixture(scope="module")
def llm_files(fixture_hub: FixtureHub, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Puzzle-KD snapshot (one ``save_to_disk`` folder per split) and a Qwen2 model folder."""
    root = tmp_path_factory.mktemp("llm")
    files = sorted(str(p) for p in fixture_hub.repo_dir(PUZZLE_KD).glob("data/train-*.parquet"))
    rows = datasets.load_dataset("parquet", data_files=files, split="train").select(range(48))
    datasets.DatasetDict({"train": rows}).save_to_disk(str(root / "puzzle-kd"))
    model = build_chat_tokenizer(root / "model")  # the recipe loads its tokenizer from the model folder
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 704,
        "eos_token_id": 2,
        "pad_token_id": 0,
        **TINY_TEXT,
    }  # use_cache is left at Qwen2's default (True): the YAML must turn it off
    (model / "config.json").write_text(json.dumps(config))
    return {"snapshot": root / "puzzle-kd", "model": model, "root": root}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_llm_finetune_recipe_trains_on_the_text_factory(
    cpu_patches: dict[str, Any], llm_files: dict[str, Path], tmp_path: Path, layout: str
) -> None:
    dataset = {
        "_target_": "puzzletron.dataset.clients.automodel.llm_factory.make_puzzletron_chat_dataset",
        "dataset_path": str(llm_files["snapshot"]),
        "tokenizer_path": str(llm_files["model"]),
        "split": "train",
        "seed": 2,  # its first packed row holds one document, the second two
        "num_samples": 6,
        **({"seq_length": 1024} if "data" not in LAYOUTS[layout] else {}),
        **LAYOUTS[layout],
    }
    model = {
        "_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config",
        "config": str(llm_files["model"]),
        "force_hf": True,  # HF's Qwen2 (AutoModel also has its own)
        "torch_dtype": "float64",
        "use_cache": False,  # else HF builds a KV cache and ignores packed position ids
    }
    config = {
        **_common(tmp_path, model),
        "loss_fn": {
            "_target_": "nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy",
            "fp32_upcast": False,  # keep float64 logits: the reference check below is exact
        },
        "dataset": dataset,
    }
    recipe, initial, losses = _run(
        cpu_patches["llm"].TrainFinetuneRecipeForNextTokenPrediction,
        _write_yaml(tmp_path / "llm.yaml", config),
        tmp_path,
    )
    assert recipe.dataloader.collate_fn.__name__ == "default_collater"  # AutoModel's own collator
    # The first step's rows are items 0 and 1 of the factory (shuffle: false): each document alone.
    kwargs = {k: v for k, v in dataset.items() if k != "_target_"}
    rows = make_puzzletron_chat_dataset(**kwargs)
    want_sum, want_count, documents = 0.0, 0, 0
    for index in range(2):
        batch = rows._row(index)
        seq_ids = batch.sequence.seq_ids
        if seq_ids is None:  # one sample per row
            seq_ids = torch.where(batch.hidden_mask, 0, -1)
        documents += len(seq_ids[seq_ids >= 0].unique())
        inputs = {"input_ids": batch.input_ids, "position_ids": batch.model_kwargs["position_ids"]}
        targets = batch.labels.masked_fill(~batch.ce_mask, -100)
        loss, count = reference_loss(document_logits(initial, inputs, seq_ids), targets)
        want_sum, want_count = want_sum + loss * count, want_count + count
    assert documents == (3 if layout == "packed_varlen" else 2)  # a packed row of two documents
    assert abs(losses[0] - want_sum / want_count) <= 1e-9, (losses[0], want_sum / want_count)


# --- VLM -----------------------------------------------------------------------------------------------


def _vlm_sample(i: int) -> dict[str, Any]:
    image = Image.new("RGB", (56, 56), (30 * i % 256, 120, 200 - 20 * i))
    return {
        "conversation": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": image},
                    {"type": "text", "text": "Describe the image."},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": f"A square of colour {i}."}]},
        ],
        "image_count": 1,
        "source": {"dataset": "fixture/vlm", "revision": "r1", "row_id": str(i)},
    }


def _vlm_model_dir(directory: Path) -> Path:
    """A tiny random Qwen2.5-VL: the fixture processor files and a ``config.json``, no weights."""
    from transformers import AutoTokenizer

    build_qwen2_5_vl_processor(directory)
    config = qwen2_5_vl_config(AutoTokenizer.from_pretrained(directory))
    config["use_cache"] = config["text_config"]["use_cache"] = False
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "neat_packed"])
def test_vlm_finetune_recipe_trains_on_the_conversation_factory(
    cpu_patches: dict[str, Any], tmp_path: Path, packed: bool
) -> None:
    subset = tmp_path / "subset"
    samples = 24 if packed else 8  # neat packing puts about 3 in a pack: 3 steps of 2 packs need 18+
    materialize_normalized_conversation_samples((_vlm_sample(i) for i in range(samples)), subset)
    model_dir = _vlm_model_dir(tmp_path / "model")
    model = {
        "_target_": "nemo_automodel.NeMoAutoModelForImageTextToText.from_config",
        "config": str(model_dir),
        "torch_dtype": "float32",
    }
    config = {
        **_common(tmp_path, model),
        "processor": {
            "_target_": "puzzletron.fixtures.tokenizer.load_qwen2_5_vl_processor",
            "directory": str(model_dir),
        },
        "loss_fn": {"_target_": "nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy"},
        "dataset": {
            "_target_": "puzzletron.dataset.load_materialized_conversation_dataset",
            "path_or_dataset": str(subset),
            "num_samples": samples,
            "processor_path": str(model_dir),  # the length hints: mm_inputs_meta and exact _text_tokens
            "cache_dir": str(tmp_path / "stores"),
        },
    }
    if packed:  # AutoModel's neat VLM packing estimates every length from the hints
        config["packed_sequence"] = {"pack_size": 128, "packing_ratio": 0.9}
        config["dataset"]["inject_fake_images"] = False
    recipe, _, _ = _run(
        cpu_patches["vlm"].FinetuneRecipeForVLM, _write_yaml(tmp_path / "vlm.yaml", config), tmp_path
    )
    assert type(recipe.processor).__name__ == "Qwen2_5_VLProcessor"
    from puzzletron.dataset import load_materialized_conversation_dataset

    item = load_materialized_conversation_dataset(
        subset, processor_path=model_dir, cache_dir=tmp_path / "stores"
    )[0]
    assert item["mm_inputs_meta"] == {"images_meta": [[56, 56]]} and item["_text_tokens"] > 0

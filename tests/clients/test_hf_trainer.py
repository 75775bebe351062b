"""`PuzzletronTrainer`: the real Hugging Face Trainer, default arguments, trains on packed batches right.

A tiny random float64 Qwen2 (sdpa, ``use_cache`` at Qwen2's default True) and packed batches from
`build_batches`. The first step's loss equals the per-document reference within 1e-6 (HF's loss runs in
float32: ``transformers/loss/loss_utils.py:59``), batches arrive in `DistributedPackSampler` order, and a run
resumed from a checkpoint sees exactly the batches the uninterrupted run saw.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from transformers import TrainingArguments

from _tiny_models import conversations, document_logits, hf_loss, reference_loss, tiny_qwen2
from puzzletron.dataset.clients.attention import model_inputs
from puzzletron.dataset.clients.hf_trainer import SAMPLER_STATE_FILE, BatchCollator, PuzzletronTrainer
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec
from puzzletron.dataset.distributed import batch_loader
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.pipelines.text import TextBatches, build_batches
from puzzletron.fixtures.tokenizer import build_chat_tokenizer

pytestmark = pytest.mark.slow

SPEC = PuzzletronDataSpec("text", "packed_varlen", 128, packing=PackingSpec(pack_size=128))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tokenizer = build_chat_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    return {"tokenizer": tokenizer, "rows": datasets.Dataset.from_list(conversations(24, seed=2, longest=8))}


def _batches(source: dict[str, Any], *, batch_size: int = 2, **options: Any) -> TextBatches:
    return build_batches(
        source["rows"], tokenizer=source["tokenizer"], spec=SPEC, batch_size=batch_size, **options
    )


class Recorder:
    """Forward hooks on the model: the ``input_ids`` and loss of every forward the Trainer runs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.ids: list[torch.Tensor] = []
        self.losses: list[float] = []
        self.keys: list[set[str]] = []
        model.register_forward_pre_hook(self._before, with_kwargs=True)
        model.register_forward_hook(self._after)

    def _before(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        self.ids.append(kwargs["input_ids"].detach().clone())
        self.keys.append(set(kwargs))

    def _after(self, module: Any, args: Any, output: Any) -> None:
        self.losses.append(float("nan") if output.loss is None else float(output.loss.detach()))


def _args(path: Path, **overrides: Any) -> TrainingArguments:
    """The Trainer's defaults but for the output folder, a short run, a learning rate that moves a tiny
    random model in three steps, and no logging integrations."""
    options = {
        "max_steps": 3,
        "learning_rate": 3e-3,
        "report_to": "none",
        "disable_tqdm": True,
        "per_device_train_batch_size": 2,  # `_batches`' rows per step (checked by the Trainer)
        **overrides,
    }
    return TrainingArguments(output_dir=str(path), **options)


def test_default_trainer_trains_three_steps_with_the_per_document_loss(
    source: dict[str, Any], tmp_path: Path
) -> None:
    batches = _batches(source, seed=0)
    order = [batches.dataset[batches.sampler.key(step)] for step in range(3)]
    model = tiny_qwen2("sdpa", 800).train()
    initial = copy.deepcopy(model).eval()
    recorder = Recorder(model)
    held_out = _batches(source, seed=0, batch_size=16)  # one batch: every pack, then padding rows
    trainer = PuzzletronTrainer(
        model=model,
        args=_args(tmp_path, per_device_eval_batch_size=16),
        train_batches=batches,
        eval_batches=held_out,
    )
    assert trainer.args.remove_unused_columns and trainer.args.label_names is None  # the defaults
    trainer.train()
    assert len(recorder.losses) == 3
    for seen, batch in zip(recorder.ids, order, strict=True):
        assert torch.equal(seen, batch.input_ids)  # DistributedPackSampler order, one batch per step
    assert {"shift_labels", "labels", "position_ids", "num_items_in_batch"} <= recorder.keys[0]
    inputs = model_inputs(order[0], backend="sdpa")
    logits = document_logits(initial, inputs, order[0].sequence.seq_ids)
    want, count = reference_loss(logits, inputs["shift_labels"])
    assert abs(recorder.losses[0] - want) <= 1e-6, (recorder.losses[0], want)  # HF's float32 loss
    # The Trainer's own arithmetic (sum / num_items_in_batch, float32) on the per-document logits: exact.
    assert abs(recorder.losses[0] - hf_loss(logits, inputs["shift_labels"], num_items=count)) <= 1e-9
    assert all(math.isfinite(loss) for loss in recorder.losses)
    assert recorder.losses[0] > recorder.losses[1] > recorder.losses[2], recorder.losses
    # Evaluation reads eval_batches the same way: its loss is the trained model's per-document loss.
    (batch,) = list(held_out)
    inputs = model_inputs(batch, backend="sdpa")
    want, _ = reference_loss(
        document_logits(model.eval(), inputs, batch.sequence.seq_ids), inputs["shift_labels"]
    )
    assert abs(trainer.evaluate()["eval_loss"] - want) <= 1e-6


def test_resumed_training_sees_the_batches_the_uninterrupted_run_saw(
    source: dict[str, Any], tmp_path: Path
) -> None:
    steps = len(_batches(source, seed=0))
    assert steps >= 3  # the run crosses an epoch boundary after the checkpoint
    args = {"max_steps": steps + 1, "save_strategy": "steps", "save_steps": steps - 1}
    full = Recorder(model := tiny_qwen2("sdpa", 800).train())
    PuzzletronTrainer(
        model=model, args=_args(tmp_path / "a", **args), train_batches=_batches(source, seed=0)
    ).train()
    checkpoint = tmp_path / "a" / f"checkpoint-{steps - 1}"
    state = json.loads((checkpoint / SAMPLER_STATE_FILE).read_text())
    assert (state["epoch"], state["next_step"], state["seed"]) == (0, steps - 1, 0)
    resumed = Recorder(model := tiny_qwen2("sdpa", 800).train())
    trainer = PuzzletronTrainer(
        model=model, args=_args(tmp_path / "a", **args), train_batches=_batches(source, seed=0)
    )
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert len(resumed.ids) == 2  # the last batch of epoch 0, then the first of epoch 1
    for seen, want in zip(resumed.ids, full.ids[steps - 1 :], strict=True):
        assert torch.equal(seen, want)
    epoch1 = _batches(source, seed=0)
    epoch1.sampler.set_epoch(1)
    assert torch.equal(resumed.ids[1], epoch1.dataset[epoch1.sampler.key(0)].input_ids)
    assert resumed.losses == pytest.approx(full.losses[steps - 1 :], abs=1e-12)
    # Another deal (seed) cannot continue this checkpoint: refused before any step.
    other = PuzzletronTrainer(
        model=model, args=_args(tmp_path / "a", **args), train_batches=_batches(source, seed=1)
    )
    with pytest.raises(ConfigError, match="seed"):
        other.train(resume_from_checkpoint=str(checkpoint))


def test_batches_of_another_dp_rank_are_refused(source: dict[str, Any], tmp_path: Path) -> None:
    batches = _batches(source, seed=0, dp_rank=1, dp_size=2)
    with pytest.raises(ConfigError, match="process_index"):
        PuzzletronTrainer(model=tiny_qwen2("sdpa", 800), args=_args(tmp_path), train_batches=batches)


def test_the_loader_hands_one_batch_per_step_and_follows_set_epoch(source: dict[str, Any]) -> None:
    batches = _batches(source, seed=0)
    loader = batch_loader(
        batches, collate_fn=BatchCollator(backend="eager", mask="block_causal", dtype=torch.float64)
    )
    loader.set_epoch(1)
    first = next(iter(loader))
    assert torch.equal(first["input_ids"], batches.dataset[batches.sampler.key(0)].input_ids)
    assert batches.sampler.epoch == 1
    assert first["attention_mask"].dtype == torch.float64 and first["use_cache"] is False
    with pytest.raises(ConfigError, match="one PuzzletronBatch per step"):
        BatchCollator()([batches.dataset[batches.sampler.key(0)]] * 2)


def test_a_batch_size_that_disagrees_with_the_batches_is_refused(
    source: dict[str, Any], tmp_path: Path
) -> None:
    """The Trainer's default per_device_train_batch_size is 8; these batches hold 2 rows a step."""
    batches = _batches(source, seed=0)
    with pytest.raises(ConfigError, match=r"per_device_train_batch_size=8 but the train batches hold 2 rows"):
        PuzzletronTrainer(
            model=tiny_qwen2("sdpa", 800),
            args=_args(tmp_path, per_device_train_batch_size=8),
            train_batches=batches,
        )
    with pytest.raises(ConfigError, match=r"per_device_eval_batch_size=8 but the eval batches hold 2 rows"):
        PuzzletronTrainer(
            model=tiny_qwen2("sdpa", 800), args=_args(tmp_path), train_batches=batches, eval_batches=batches
        )


def test_the_trainer_counts_the_rows_and_the_real_tokens_it_trains_on(
    source: dict[str, Any], tmp_path: Path
) -> None:
    batches = _batches(source, seed=0)
    steps = [batches.dataset[batches.sampler.key(step)] for step in range(3)]
    trainer = PuzzletronTrainer(
        model=tiny_qwen2("sdpa", 800).train(),
        args=_args(tmp_path, include_num_input_tokens_seen="non_padding"),
        train_batches=batches,
    )
    metrics = trainer.train().metrics
    assert trainer.get_total_train_batch_size(trainer.args) == 2  # rows per step, as the batches hold
    rows = metrics["train_samples_per_second"] * metrics["train_runtime"]
    assert rows == pytest.approx(3 * 2, rel=1e-2)
    assert trainer.state.num_input_tokens_seen == sum(int(b.hidden_mask.sum()) for b in steps)
    assert trainer.state.num_input_tokens_seen < 3 * 2 * SPEC.sequence_length  # the padding is not counted


def test_a_step_of_padding_rows_gives_zero_loss_and_leaves_the_weights_alone(
    source: dict[str, Any], tmp_path: Path
) -> None:
    model = tiny_qwen2("sdpa", 800).train()
    trainer = PuzzletronTrainer(model=model, args=_args(tmp_path), train_batches=_batches(source, seed=0))
    real = _batches(source, seed=0).dataset[_batches(source, seed=0).sampler.key(0)]
    padding = real.pad_batch_to_multiple(4).pp_microbatches(2)[1]  # the 2 rows pad_batch_to_multiple added
    assert not bool(padding.hidden_mask.any())
    samples, num_items = trainer.get_batch_samples(
        iter([trainer.batch_collator(padding)]), 1, trainer.args.device
    )
    assert int(num_items) == 1  # at least 1: HF would divide the zero sum by 0
    loss = trainer.training_step(model, samples[0], num_items)
    assert loss.item() == 0.0
    assert all(p.grad is None or not bool(p.grad.any()) for p in model.parameters())

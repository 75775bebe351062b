"""The Hugging Face `Trainer` on this library's batches: its sampler's order, its labels, resumable.

A `PuzzletronBatch` stream does not fit the Trainer's own data path: the Trainer shuffles a map-style
dataset itself (bypassing `DistributedPackSampler`), ``remove_unused_columns=True`` (the default) drops a
``shift_labels`` column, and already-shifted labels passed as ``labels`` are shifted a second time. The
documented hook is a subclass that overrides ``get_train_dataloader`` (and ``get_eval_dataloader``)::

    from puzzletron.dataset.clients.hf_trainer import PuzzletronTrainer

    batches = build_batches(snapshot, tokenizer=tok, spec=spec, batch_size=4,
                            dp_rank=args.process_index, dp_size=args.world_size, seed=0)
    trainer = PuzzletronTrainer(model=model, args=args, train_batches=batches)
    trainer.train()                                   # or train(resume_from_checkpoint=True)

Each step gets one `PuzzletronBatch` (``[B, T]``, ``B`` = the ``batch_size`` given to ``build_batches``,
which ``per_device_train_batch_size`` / ``per_device_eval_batch_size`` must equal: the Trainer counts its
samples per second with them; a disagreement is a `ConfigError`) turned into `model_inputs` by
`BatchCollator` for the model (its attention backend and dtype): ``input_ids``, ``position_ids``,
``use_cache=False``, ``labels`` + ``shift_labels``. The Trainer counts ``num_items_in_batch`` from
``shift_labels`` (at least 1: a step of padding batches gives zero loss and gradient, not NaN), so a step's
loss is the token mean over all its gradient-accumulation batches. The Trainer's "samples" are rows (packs
for ``packed_varlen``); ``include_num_input_tokens_seen="non_padding"`` counts the real tokens (without
padding; ``"all"`` counts ``B*T``). Nothing goes through ``accelerator.prepare``: it would re-shard a
sampler that is already rank-aware.

Resume: the loader (`puzzletron.dataset.distributed.batch_loader`) has a ``batch_sampler`` that yields one
`BatchKey` list per step, so the
Trainer's own fast-forward (``accelerate.skip_first_batches``, ``global_step`` batches into the epoch)
skips keys without building their batches, and ``set_epoch`` reaches the sampler. The deal depends only on
``(seed, epoch)``, so the resumed run sees exactly the batches the interrupted one would have. Every
checkpoint also holds the sampler's state (``puzzletron_sampler.json``, `DistributedPackSampler.state_dict`
at the checkpoint's step); resuming checks it against this run's sampler and raises `ConfigError` when the
deal settings (items, batch size, DP size, seed, shuffle, drop_last) differ. Not supported: changing those
settings across a resume, and ``ignore_data_skip=True`` (the Trainer then restarts the epoch; the sampler
state in the checkpoint is informational).

Importing this module imports `transformers` (the ``text`` extra; its Trainer also needs ``accelerate``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from puzzletron.dataset.batch import PuzzletronBatch
from puzzletron.dataset.clients.attention import MaskMode, model_inputs
from puzzletron.dataset.clients.hf_model import model_backend, model_dtype, quiet_imports
from puzzletron.dataset.distributed import (
    BatchSource,
    DistributedPackSampler,
    PuzzletronDataLoader,
    batch_loader,
    only_batch,
)
from puzzletron.dataset.errors import ConfigError

with quiet_imports():  # torchao import noise (clients.hf_model)
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

    Trainer, TrainerCallback = transformers.Trainer, transformers.TrainerCallback


__all__ = ["SAMPLER_STATE_FILE", "TOKENS_KEY", "BatchCollator", "PuzzletronTrainer", "check_sampler_state"]

SAMPLER_STATE_FILE = "puzzletron_sampler.json"
TOKENS_KEY = "puzzletron_num_tokens"  # the collator's count of non-padding tokens (not a model input)


@dataclass(frozen=True)
class BatchCollator:
    """``collate_fn`` of `batch_loader` for a model: one batch (or a list holding exactly one, as a
    DataLoader with a ``batch_sampler`` passes it) -> `model_inputs` (see there for ``backend``, ``mask``,
    ``dtype``). Picklable, so DataLoader workers run it; `for_model` reads ``backend`` and ``dtype`` from
    a model. ``count_tokens`` adds `TOKENS_KEY`, the batch's non-padding tokens, which `PuzzletronTrainer`
    takes out before the forward (not a model input)."""

    backend: str = "sdpa"
    mask: MaskMode = "auto"
    dtype: torch.dtype | None = None
    count_tokens: bool = False

    @classmethod
    def for_model(cls, model: Any, *, mask: MaskMode = "auto", count_tokens: bool = False) -> BatchCollator:
        """The collator for ``model``: the attention its text layers run, its dtype for an eager mask."""
        backend = model_backend(model)
        return cls(backend, mask, model_dtype(model) if backend == "eager" else None, count_tokens)

    def __call__(self, items: PuzzletronBatch | Sequence[PuzzletronBatch]) -> dict[str, Any]:
        batch = only_batch(items)
        out = model_inputs(batch, backend=self.backend, mask=self.mask, dtype=self.dtype)  # type: ignore[arg-type]
        if self.count_tokens:
            valid = batch.hidden_mask
            out[TOKENS_KEY] = valid.sum() if valid is not None else torch.tensor(batch.input_ids.numel())
        return out


def _check_batch_size(rows: int, per_device: int, kind: str) -> None:
    if rows != per_device:
        raise ConfigError(
            f"per_device_{kind}_batch_size={per_device} but the {kind} batches hold {rows} rows each "
            f"(build_batches(batch_size={rows})): set per_device_{kind}_batch_size={rows} in "
            "TrainingArguments, so that the Trainer counts the samples it trains on"
        )


def _checkpoint_position(args: Any, global_step: int, steps: int) -> tuple[int, int]:
    """``(epoch, next_step)`` where the Trainer resumes after ``global_step`` optimizer steps, for an epoch
    of ``steps`` batches (``Trainer._init_training_state``, transformers 5.x)."""
    accumulation = args.gradient_accumulation_steps
    updates = max(steps // accumulation + int(steps % accumulation > 0), 1)
    return global_step // updates, min((global_step % updates) * accumulation, steps)


def check_sampler_state(checkpoint: str | Path, sampler: DistributedPackSampler) -> dict[str, Any] | None:
    """The sampler state saved in ``checkpoint`` (None when there is none), after checking it against
    ``sampler``'s deal settings (`ConfigError` naming the first that differs). ``sampler`` is not changed."""
    path = Path(checkpoint) / SAMPLER_STATE_FILE
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    copy.copy(sampler).load_state_dict(state)  # its checks, on a throwaway copy
    return state


class _SaveSamplerState(TrainerCallback):
    """Writes the sampler state into every checkpoint the Trainer saves (process zero only)."""

    def __init__(self, sampler: DistributedPackSampler) -> None:
        self.sampler = sampler

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():
            return
        epoch, next_step = _checkpoint_position(args, state.global_step, len(self.sampler))
        saved = {**self.sampler.state_dict(consumed=0), "epoch": epoch, "next_step": next_step}
        (folder / SAMPLER_STATE_FILE).write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


class PuzzletronTrainer(Trainer):
    """`transformers.Trainer` reading `PuzzletronBatch`es in `DistributedPackSampler` order.

    ``train_batches`` (required) and ``eval_batches`` (optional) are `BatchSource`s, typically from
    `build_batches` with ``dp_rank=args.process_index, dp_size=args.world_size`` (checked).
    ``per_device_train_batch_size`` (and ``per_device_eval_batch_size`` with ``eval_batches``) must equal
    their ``batch_size`` (checked). ``collator`` turns a batch into `model_inputs` (default:
    `BatchCollator.for_model` of ``model``; it counts tokens for ``include_num_input_tokens_seen``). Every
    other argument is the Trainer's, defaults included; ``train_dataset`` defaults to
    ``train_batches.dataset`` (only its length is read: the Trainer's sampler and column removal are
    bypassed).
    """

    def __init__(
        self,
        *args: Any,
        train_batches: BatchSource,
        eval_batches: BatchSource | None = None,
        collator: BatchCollator | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("train_dataset", train_batches.dataset)
        super().__init__(*args, **kwargs)
        sampler = train_batches.sampler
        if (sampler.dp_rank, sampler.dp_size) != (self.args.process_index, self.args.world_size):
            raise ConfigError(
                f"train_batches are dealt to DP rank {sampler.dp_rank} of {sampler.dp_size}, but this "
                f"process is rank {self.args.process_index} of {self.args.world_size}: build them with "
                "dp_rank=args.process_index, dp_size=args.world_size"
            )
        _check_batch_size(sampler.batch_size, self.args.per_device_train_batch_size, "train")
        if eval_batches is not None:
            _check_batch_size(eval_batches.sampler.batch_size, self.args.per_device_eval_batch_size, "eval")
        self.train_batches = train_batches
        self.eval_batches = eval_batches
        if collator is None:
            model = kwargs.get("model", args[0] if args else None)
            collator = BatchCollator.for_model(model) if model is not None else BatchCollator()
        self.batch_collator = dataclasses.replace(collator, count_tokens=True)
        self.add_callback(_SaveSamplerState(sampler))

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        inputs = {key: value for key, value in inputs.items() if key != TOKENS_KEY}
        return super()._prepare_inputs(inputs)

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        if self.args.include_num_input_tokens_seen != "non_padding" or TOKENS_KEY not in inputs:
            return super()._track_num_input_tokens(inputs)
        tokens = torch.as_tensor(inputs[TOKENS_KEY], device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += int(self.accelerator.gather(tokens).sum().item())
        return None

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        count = super()._get_num_items_in_batch(batch_samples, device)
        if isinstance(count, torch.Tensor):
            return count.clamp_min(1)  # a step of padding batches: zero loss, not 0 / 0
        return max(count, 1) if isinstance(count, int) else count

    def _loader(self, batches: BatchSource) -> PuzzletronDataLoader:
        accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
        device = accelerator.is_available() if accelerator is not None else torch.cuda.is_available()
        return batch_loader(
            batches,
            collate_fn=self.batch_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory and device,  # pinning needs a device to copy to
        )

    def get_train_dataloader(self) -> PuzzletronDataLoader:
        return self._loader(self.train_batches)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        if eval_dataset is not None or self.eval_batches is None:
            return super().get_eval_dataloader(eval_dataset)
        return self._loader(self.eval_batches)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if isinstance(checkpoint, str | os.PathLike):
            check_sampler_state(checkpoint, self.train_batches.sampler)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

"""The Hydra text factory NeMo AutoModel's LLM finetune recipe instantiates from a Puzzle-KD snapshot.

::

    dataset:
      _target_: puzzletron.dataset.clients.automodel.llm_factory.make_puzzletron_chat_dataset
      dataset_path: snapshots/puzzle-kd        # a text snapshot folder, or a token store (no tokenizer then)
      tokenizer_path: path/to/model            # the chat template and vocabulary to tokenise with
      cache_dir: stores                        # tokenise once: the store of this identity found or built here
      split: train
      seq_length: 4096                         # row length: pack_size (packed) or max_sample_length
      layout: packed_varlen                    # fixed | padded_varlen | packed_varlen (default)
      seed: 0
      num_samples: null                        # the first N items (rows the recipe reads), null = all
    dataloader:
      shuffle: false                           # keep this library's seeded order (true reshuffles it)
    model:
      use_cache: false                         # REQUIRED for packed_varlen with HF models, see below

With ``cache_dir`` (or a token store as ``dataset_path``) the recipe reads a token store
(``docs/token-store-format.md``): tokenised once, then every rank and every run reads it; a store
``puzzletron-data tokenize --output stores/puzzle-kd`` wrote is found there by its identity. Without either,
every rank tokenises the split in memory on every run.

Or a ``data:`` block instead of ``layout``/``seq_length``: ``data: {modality: text, layout: ...,
max_sample_length: ..., packing: {pack_size: ...}}`` (`PuzzletronDataSpec.from_mapping`). AutoModel 0.7.0
resolves any importable ``_target_`` (``NEMO_ENABLE_USER_MODULES=1`` is needed only for a ``file.py:name``
target or a private name).

The recipe (``recipes/llm/train_ft.py``, AutoModel 0.7.0) calls the target with the YAML keys only, plus
``tokenizer=`` when the target declares that parameter. This one does not: AutoModel's tokenizer wrapper
enforces BOS/EOS tokens, and the library tokenises with the chat template of ``tokenizer_path`` itself.
Its collator, ``default_collater``, stacks the items; ``MaskedCrossEntropy`` reads ``labels`` unshifted
(they are already shifted: ``labels[t]`` is the target of ``input_ids[t]``).

Items (`ChatRows`), per layout (``T`` the row length, int64):

- ``packed_varlen``: one pack per item: ``input_ids``, ``labels``, ``position_ids`` ``[T]`` tensors
  (positions restart at 0 in every document, 0 on padding), no ``attention_mask``: HF finds the documents
  from the position ids, but only without a KV cache, hence ``model.use_cache: false`` (Qwen2's config says
  true; AutoModel sets it false only when the attribute is missing). With a cache every token also attends to
  the earlier documents of its row, silently.
- ``padded_varlen``: one sample per item, ``input_ids``/``labels``/``attention_mask`` lists of the sample's
  own length (truncated to ``max_sample_length``); ``default_collater`` pads them to the batch's longest.
- ``fixed``: one sample per item padded or truncated to ``T``: ``input_ids``, ``labels``, ``attention_mask``
  ``[T]`` tensors.

Each item also carries ``___PAD_TOKEN_IDS___`` (AutoModel's padding values per key).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from puzzletron.dataset._checks import (
    refuse_unknown,
    require_bool,
    require_int,
    require_positive,
    require_seed,
)
from puzzletron.dataset.batch import IGNORE_INDEX, DataLayout, Modality, PuzzletronBatch
from puzzletron.dataset.config import PackingSpec, PuzzletronDataSpec, TokenizeOptions, as_spec
from puzzletron.dataset.distributed import BatchKey
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.pipelines.text import TextBatches, build_batches, is_token_store
from puzzletron.dataset.tokenize.matching import UNSAID_SPLIT

__all__ = ["ChatRows", "make_puzzletron_chat_dataset", "resolve_text_spec"]


class ChatRows(torch.utils.data.Dataset):
    """Map-style dataset of AutoModel LLM items, one training row each (see the module docstring).

    ``batches`` were built with ``batch_size=1`` on one DP rank of one: item ``i`` is the batch of the
    ``i``-th key of epoch 0 (the library's seeded order), built when read. ``len`` = the rows.
    """

    def __init__(
        self, batches: TextBatches, keys: list[BatchKey], *, layout: DataLayout | str, pad_token_id: int
    ) -> None:
        self.batches = batches
        self.keys = keys
        self.layout = DataLayout(layout)
        self.pad_token_id = int(pad_token_id)

    def __len__(self) -> int:
        return len(self.keys)

    def _row(self, index: int) -> PuzzletronBatch:
        if isinstance(index, bool):
            raise TypeError("ChatRows index must be an integer, got a bool")
        return self.batches.dataset[self.keys[operator.index(index)]]

    def __getitem__(self, index: int) -> dict[str, Any]:
        batch = self._row(index)
        labels = batch.labels.masked_fill(~batch.ce_mask, IGNORE_INDEX)[0]
        ids = batch.input_ids[0]
        pads = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX}
        if self.layout is DataLayout.PACKED_VARLEN:
            item: dict[str, Any] = {
                "input_ids": ids,
                "labels": labels,
                "position_ids": batch.model_kwargs["position_ids"][0],
            }
            pads["position_ids"] = 0
        else:
            valid = batch.hidden_mask[0]
            item = {"input_ids": ids, "labels": labels, "attention_mask": valid.long()}
            if self.layout is DataLayout.PADDED_VARLEN:  # lists: the collator pads across items
                length = int(valid.sum())
                item = {key: value[:length].tolist() for key, value in item.items()}
            pads["attention_mask"] = 0
        item["___PAD_TOKEN_IDS___"] = pads
        return item


def resolve_text_spec(
    *,
    data: Mapping[str, Any] | PuzzletronDataSpec | None,
    seq_length: int | None,
    layout: str | None,
    pack_size: int | None,
    drop_long_samples: bool,
) -> PuzzletronDataSpec:
    """The text `PuzzletronDataSpec` of the factory's options: ``data`` (a spec or a ``data:`` mapping), or
    the flat ``layout`` (default ``packed_varlen``), ``seq_length`` and ``pack_size`` (default
    ``seq_length``). Both at once is an error, except a ``seq_length`` equal to the spec's row length."""
    if data is not None:
        if layout is not None or pack_size is not None:
            raise ConfigError("give either data: (a PuzzletronDataSpec block) or layout/pack_size, not both")
        spec = as_spec(data, owner="make_puzzletron_chat_dataset(data=)")
        if seq_length is not None and seq_length != spec.sequence_length:
            raise ConfigError(
                f"seq_length={seq_length} disagrees with the data block's row length {spec.sequence_length}"
            )
    else:
        if seq_length is None:
            raise ConfigError("seq_length is required without a data: block (tokens per row)")
        require_positive(seq_length, "seq_length", error=ConfigError)
        chosen = DataLayout.PACKED_VARLEN.value if layout is None else layout
        packing = None
        if chosen == DataLayout.PACKED_VARLEN.value:
            size = (
                seq_length
                if pack_size is None
                else require_positive(pack_size, "pack_size", error=ConfigError)
            )
            packing = PackingSpec(pack_size=size, drop_long_samples=drop_long_samples)
        elif pack_size is not None:
            raise ConfigError(f"pack_size is for layout packed_varlen only; layout is {chosen}")
        spec = PuzzletronDataSpec("text", chosen, seq_length, packing=packing)
    if Modality(spec.modality) is not Modality.TEXT:
        raise ConfigError(
            f"make_puzzletron_chat_dataset builds text rows; data.modality is {spec.modality.value}"
        )
    return spec


def make_puzzletron_chat_dataset(
    dataset_path: str | Path | Any,
    split: str = UNSAID_SPLIT,
    seq_length: int | None = None,
    seed: int = 0,
    num_samples: int | None = None,
    *,
    tokenizer_path: str | Path | None = None,
    data: Mapping[str, Any] | PuzzletronDataSpec | None = None,
    layout: str | None = None,
    pack_size: int | None = None,
    drop_long_samples: bool = True,
    shuffle: bool = True,
    pad_to_multiple_of: int = 1,
    num_proc: int = 1,
    options: Mapping[str, Any] | TokenizeOptions | None = None,
    cache_dir: str | Path | None = None,
    **unknown: Any,
) -> ChatRows:
    """AutoModel LLM dataset `_target_`: a text snapshot -> `ChatRows` in one `PuzzletronDataSpec` layout.

    ``dataset_path``: anything `build_batches` reads as ``source`` (a Puzzle-KD snapshot folder, a token
    store, a saved ``datasets`` split, rows with a ``messages`` column). ``cache_dir``: tokenise a snapshot
    once into a token store there, or reuse the one of the same identity found anywhere under it (as in
    `build_batches`; under ``torch.distributed`` every rank calls the factory and the ranks share the
    build). ``split``, ``seed`` (packing order and the row order), ``shuffle``, ``pad_to_multiple_of``,
    ``num_proc``: as in `build_batches`; ``options``: a `TokenizeOptions` or its mapping
    (``{messages_field: ..., id_field: ...}`` in YAML). ``tokenizer_path`` (required unless
    ``dataset_path`` is a token store): the tokenizer folder (a Hub id only without ``cache_dir``) whose
    chat template tokenises the conversations (assistant turns supervised, labels shifted). Spec: ``data``
    or the flat ``seq_length``/``layout``/``pack_size``/``drop_long_samples`` (`resolve_text_spec`).
    ``num_samples``: keep the first N items (packs for ``packed_varlen``, samples otherwise); more than
    there are is an error.
    A superset of the original ``make_puzzletron_chat_dataset(dataset_path, split, seq_length, seed,
    num_samples)``: the added options are keyword-only. Any other key (a YAML typo) is a `TypeError` naming
    the closest option (`refuse_unknown`, as the VLM factory does).
    """
    refuse_unknown(make_puzzletron_chat_dataset, unknown)
    if tokenizer_path is None and not is_token_store(dataset_path):
        raise ConfigError(
            f"tokenizer_path is required: {dataset_path} is not a token store, and its conversations are "
            "tokenised with this chat template (AutoModel's own tokenizer wrapper adds BOS/EOS, so the "
            "factory does not take it)"
        )
    seed = require_seed(seed, error=ConfigError)
    require_bool(shuffle, "shuffle", error=ConfigError)
    spec = resolve_text_spec(
        data=data,
        seq_length=seq_length,
        layout=layout,
        pack_size=pack_size,
        drop_long_samples=drop_long_samples,
    )
    batches = build_batches(
        dataset_path,
        tokenizer=tokenizer_path,
        spec=spec,
        batch_size=1,
        split=split,
        seed=seed,
        shuffle=shuffle,
        pad_to_multiple_of=pad_to_multiple_of,
        num_proc=num_proc,
        options=TokenizeOptions.from_mapping(options),
        cache_dir=cache_dir,
    )
    keys = [batches.sampler.key(step) for step in range(len(batches.sampler))]
    if num_samples is not None:
        require_int(num_samples, "num_samples", minimum=1, error=ConfigError)
        if num_samples > len(keys):
            raise ConfigError(f"num_samples={num_samples} exceeds the {len(keys)} rows of split {split!r}")
        keys = keys[:num_samples]
    return ChatRows(batches, keys, layout=spec.layout, pad_token_id=batches.dataset.pad_token_id)

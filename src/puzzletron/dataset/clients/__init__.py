"""Clients: what hands batches to a model or a training framework. `attention` (`model_inputs`,
`forward_kwargs` for sdpa / eager / flash / Transformer Engine / Megatron), `hf_trainer` (the Hugging Face
Trainer in this library's order), `automodel` (NeMo AutoModel's collate adapter and dataset factories).
Each is imported where it is used; nothing is re-exported here."""

from __future__ import annotations

__all__: list[str] = []

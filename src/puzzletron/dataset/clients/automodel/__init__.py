"""NeMo AutoModel as a client: `adapter` turns any AutoModel collator output into a `PuzzletronBatch`;
`vlm_factory` and `llm_factory` are the Hydra dataset targets AutoModel's VLM and LLM recipes instantiate.

Names are imported on first use (PEP 562): the VLM factory reads a subset without the text pipeline's
imports, and the adapter without either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from puzzletron.dataset._checks import lazy_attribute

if TYPE_CHECKING:
    from puzzletron.dataset.clients.automodel.adapter import DocumentMap, batch_from_automodel, document_map
    from puzzletron.dataset.clients.automodel.llm_factory import (
        ChatRows,
        make_puzzletron_chat_dataset,
        resolve_text_spec,
    )
    from puzzletron.dataset.clients.automodel.vlm_factory import (
        ConversationDataset,
        load_materialized_conversation_dataset,
        round_robin_order,
    )

__all__ = [
    "ChatRows",
    "ConversationDataset",
    "DocumentMap",
    "batch_from_automodel",
    "document_map",
    "load_materialized_conversation_dataset",
    "make_puzzletron_chat_dataset",
    "resolve_text_spec",
    "round_robin_order",
]

# name -> the module that defines it
_OWNERS = {
    "DocumentMap": "adapter",
    "batch_from_automodel": "adapter",
    "document_map": "adapter",
    "ChatRows": "llm_factory",
    "make_puzzletron_chat_dataset": "llm_factory",
    "resolve_text_spec": "llm_factory",
    "ConversationDataset": "vlm_factory",
    "load_materialized_conversation_dataset": "vlm_factory",
    "round_robin_order": "vlm_factory",
}


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _OWNERS, name, globals())

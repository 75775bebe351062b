"""The files the README's "try it" examples read, written by ``puzzletron-data demo`` into its workdir:

- ``tokenizer/``: the fixture chat tokenizer (``tokenize --tokenizer``, ``build_batches(tokenizer=...)``);
- ``processor/``: a Qwen2.5-VL processor over it (`puzzletron.fixtures.tokenizer.load_qwen2_5_vl_processor`);
- ``model/``: a tiny random Qwen2 (2 layers, hidden 64, grouped-query attention, RoPE; seeded) with that
  tokenizer's vocabulary, saved as a Hub model folder is (``AutoModelForCausalLM.from_pretrained``).

On a real cluster these are a model's own tokenizer, processor and weights (a Hub id or a local folder).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TINY_MODEL", "write_try_it_files"]

# A real Qwen2 decoder, small enough to train a step on a CPU in a fraction of a second.
TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def write_try_it_files(workdir: Path, *, seed: int) -> dict[str, Any]:
    """Write (or overwrite) ``workdir/{tokenizer,processor,model}``; their paths and the parameter count."""
    import torch

    from puzzletron.dataset.clients.hf_model import quiet_imports
    from puzzletron.fixtures.tokenizer import build_chat_tokenizer, build_qwen2_5_vl_processor

    with quiet_imports():
        from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok_dir = build_chat_tokenizer(Path(workdir) / "tokenizer")
    processor = build_qwen2_5_vl_processor(Path(workdir) / "processor")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    config = Qwen2Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **TINY_MODEL)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model_dir = Path(workdir) / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)  # a model folder carries its tokenizer and chat template
    return {
        "tokenizer": str(tok_dir),
        "processor": str(processor),
        "model": str(model_dir),
        "parameters": sum(p.numel() for p in model.parameters()),
    }

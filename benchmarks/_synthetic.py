"""Deterministic synthetic inputs for the benchmarks: a ~32k-token byte-level BPE trained locally and
Puzzle-KD-like chat conversations (a leading empty system turn, 1-4 user/assistant exchanges, log-normal
sizes with a median of about 600 tokens). No network: the tokenizer is trained on generated pseudo-English.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ConversationGenerator", "build_tokenizer_32k", "conversations"]

_ONSETS = [
    "",
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "th",
    "st",
    "tr",
]
_VOWELS = ["a", "e", "i", "o", "u", "ea", "ou", "ai", "io", "y", "ee", "oo"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "d", "ng", "nt", "st", "ck", "m", "ss", "x"]
_ENDS = [".", ".", ".", "?", "!"]


class ConversationGenerator:
    """Pseudo-English prose with a Zipf-like vocabulary of 40,000 words, numbers and some code blocks."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        words: list[str] = []
        seen: set[str] = set()
        while len(words) < 40_000:
            parts = int(self.rng.choice([1, 1, 1, 2, 2, 3]))
            word = "".join(
                _ONSETS[self.rng.integers(len(_ONSETS))]
                + _VOWELS[self.rng.integers(len(_VOWELS))]
                + _CODAS[self.rng.integers(len(_CODAS))]
                for _ in range(parts)
            )
            if word not in seen:
                seen.add(word)
                words.append(word)
        self.words = words
        weights = 1.0 / np.arange(1, len(words) + 1) ** 1.1
        self.cdf = np.cumsum(weights / weights.sum())

    def text(self, n_words: int) -> str:
        """About ``n_words`` words in sentences of 4-21 words."""
        index = np.minimum(np.searchsorted(self.cdf, self.rng.random(max(n_words, 1))), len(self.words) - 1)
        words = [self.words[i] for i in index]
        sentences = []
        for start in range(0, len(words), 12):
            sentence = words[start : start + int(self.rng.integers(4, 22))]
            if self.rng.random() < 0.15:
                sentence.append(str(int(self.rng.integers(0, 10_000))))
            text = " ".join(sentence).capitalize() + _ENDS[self.rng.integers(len(_ENDS))]
            if self.rng.random() < 0.03:
                text += f"\n```python\ndef f(x):\n    return x + {int(self.rng.integers(99))}\n```\n"
            sentences.append(text)
        return " ".join(sentences)


def conversations(
    n: int, *, seed: int, median_tokens: float = 600.0, sigma: float = 0.8
) -> list[dict[str, Any]]:
    """``n`` Puzzle-KD-like rows ``{"uuid", "messages"}`` (about 1.8 tokens a word with the 32k tokenizer)."""
    gen = ConversationGenerator(seed)
    words = np.exp(gen.rng.normal(np.log(median_tokens / 1.8), sigma, size=n)).astype(int) + 4
    rows = []
    for i, total in enumerate(words.tolist()):
        turns = int(gen.rng.choice([1, 1, 1, 1, 2, 2, 3, 4]))
        per = max(total // turns, 2)
        messages = [{"role": "system", "content": ""}]
        for _ in range(turns):
            user = max(int(per * gen.rng.uniform(0.1, 0.5)), 1)
            messages.append({"role": "user", "content": gen.text(user)})
            messages.append({"role": "assistant", "content": gen.text(max(per - user, 1))})
        rows.append({"uuid": f"bench-{seed}-{i:08d}", "messages": messages})
    return rows


def build_tokenizer_32k(directory: Path) -> Path:
    """Train (once; reused when ``directory`` holds it) a 32,000-token byte-level BPE with the fixture chat
    template, saved as a `transformers` tokenizer folder."""
    from puzzletron.fixtures.tokenizer import train_chat_tokenizer

    directory = Path(directory)
    if (directory / "tokenizer.json").is_file():
        return directory
    gen = ConversationGenerator(12_345)
    corpus = [gen.text(200) for _ in range(8_000)]
    return train_chat_tokenizer(
        directory, corpus, vocab_size=32_000, min_frequency=2, model_max_length=1 << 20
    )

"""Two tiny conversations and their tokens under the fixture chat tokenizer, hand-checked against its
vocab: the goldens of the tokenisation tests (``tests/tokenize/``) and of the `build_batches` tests built on
them (``tests/pipelines/``)."""

from __future__ import annotations

__all__ = ["IDS_A", "IDS_B", "LABELS_A", "LABELS_B", "ROWS", "X"]

# The tokens, one by one:
#   a: <|im_start|> user \n H i <|im_end|> \n <|im_start|> as sis tant \n Y es <|im_end|> \n     16 tokens
#   b: <|im_start|> user \n N o <|im_end|> \n <|im_start|> as sis tant \n O <|im_end|> \n        15 tokens
ROWS = [
    {"uuid": "a", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"}]},
    {"uuid": "b", "messages": [{"role": "user", "content": "No"}, {"role": "assistant", "content": "O"}]},
]
IDS_A = [1, 401, 205, 46, 79, 2, 205, 1, 352, 312, 335, 205, 63, 291, 2, 205]
IDS_B = [1, 401, 205, 52, 85, 2, 205, 1, 352, 312, 335, 205, 53, 2, 205]
X = -100
# labels[t] is the target of input_ids[t]: the assistant reply and its <|im_end|>, nothing else.
LABELS_A = [X] * 11 + [63, 291, 2, X, X]  # "\n" -> Y, Y -> es, es -> <|im_end|>
LABELS_B = [X] * 11 + [53, 2, X, X]  # "\n" -> O, O -> <|im_end|>

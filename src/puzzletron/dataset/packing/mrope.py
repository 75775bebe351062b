"""Multi-axis RoPE position ids of image conversations, computed per document as the model does.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL number a document's tokens on three axes (``get_rope_index`` of the
model; images only here, every image ``t = 1``)::

    text token      (p, p, p)                     then p += 1
    image (h x w merged tokens, row-major)        (p, p + row, p + col)      then p += max(h, w)

where ``h = grid_h / merge``, ``w = grid_w / merge`` and ``p`` starts at 0 in every document. `mrope_ids`
does this for a whole flattened batch at once, every document restarting at 0, with no Python loop over
documents, images or tokens. Tests compare it with the models' own ``get_rope_index`` token for token.
"""

from __future__ import annotations

import numpy as np

from puzzletron.dataset.errors import PackingError

__all__ = ["mrope_ids"]


def mrope_ids(image: np.ndarray, doc: np.ndarray, grid: np.ndarray, merge_size: int) -> np.ndarray:
    """``[3, N]`` int64 positions of ``N`` tokens.

    ``image`` ``[N]`` bool marks image tokens; ``doc`` ``[N]`` numbers the documents (positions restart
    wherever it changes, so give padding runs ids of their own); ``grid`` ``[m, 3]`` is every image's
    ``(t, h, w)`` patch grid in token order. Each image must be one run of ``h * w / merge**2`` image tokens
    (the chat templates put text between two images); `PackingError` otherwise.

    >>> mrope_ids(np.array([0, 1, 1, 1, 1, 0], bool), np.zeros(6, int), np.array([[1, 4, 4]]), 2).tolist()
    [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]]
    """
    image = np.asarray(image, dtype=bool).reshape(-1)
    doc = np.asarray(doc).reshape(-1)
    n = image.shape[0]
    g = np.asarray(grid, dtype=np.int64).reshape(-1, 3)
    if g.size and np.any(g[:, 0] != 1):
        raise PackingError("image grids must have t = 1 (videos are not supported)")
    rows, cols = g[:, 1] // merge_size, g[:, 2] // merge_size
    tokens = rows * cols
    new_doc = np.concatenate([[True], doc[1:] != doc[:-1]]) if n else np.zeros(0, bool)
    # a run of image tokens ends where a document does: two documents' images never merge
    continues = np.concatenate([[False], image[:-1]]) & ~new_doc if n else np.zeros(0, bool)
    run_start = image & ~continues
    starts = np.flatnonzero(run_start)
    run_lengths = np.bincount(np.cumsum(run_start)[image] - 1, minlength=starts.size)
    if run_lengths.shape != tokens.shape or not np.array_equal(run_lengths, tokens):
        raise PackingError(
            f"image tokens form runs of {run_lengths[:8].tolist()} but the grids give {tokens[:8].tolist()}: "
            "every image must be one run of its grid's tokens"
        )
    step = (~image).astype(np.int64)  # how far each token moves the text cursor
    step[starts + tokens - 1] = np.maximum(rows, cols)  # an image moves it by max(h, w) at its last token
    before = np.cumsum(step) - step  # exclusive running sum over the batch
    first = np.flatnonzero(new_doc)
    base = before - np.repeat(before[first], np.diff(np.append(first, n)))  # restart in every document
    positions = np.broadcast_to(base, (3, n)).copy()
    if g.size:
        owner = np.repeat(np.arange(g.shape[0]), tokens)
        offset = np.arange(int(tokens.sum())) - np.repeat(np.cumsum(tokens) - tokens, tokens)
        positions[1, image] += offset // cols[owner]
        positions[2, image] += offset % cols[owner]
    return positions

"""Deal a mixture's epochs to data-parallel ranks, resumable at any DP size or batch size.

`MixtureSampler` yields one `BatchKey` (global row ids of the mixture, ``-1`` = padding slot) per step of
the current epoch for its rank: the epoch's stream from `puzzletron.dataset.packing.mixture_plan.MixturePlan`
(the same on every rank, computed once), dealt by `puzzletron.dataset.packing.mixture_deal` (image rows on
every rank of a step or on none, ranks even in image and real tokens). The state is where the epoch's two
queues stand (``images``, ``texts`` rows taken): it means the same rows at any DP size, so
``load_state_dict`` of a state saved with 8 ranks continues on 4 (or with another batch size) with no row
repeated or skipped. A state of another mixture (other components, weights, seed or budget) is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from puzzletron.dataset._checks import is_int, require_int
from puzzletron.dataset.distributed.sampler import BatchKey
from puzzletron.dataset.errors import ConfigError
from puzzletron.dataset.packing.mixture_deal import image_exceptions, step_cursors, step_rows
from puzzletron.dataset.packing.mixture_plan import MixturePlan

__all__ = ["MixtureSampler"]

_KIND = "puzzletron-mixture-sampler"


class MixtureSampler(torch.utils.data.Sampler[BatchKey]):
    """This rank's `BatchKey` of every step of the current epoch of ``plan`` (module docstring).

    Call `set_epoch` before each epoch; `state_dict` / `load_state_dict` resume mid-epoch at the next step,
    at this or any other DP size and batch size.
    """

    def __init__(
        self,
        plan: MixturePlan,
        *,
        batch_size: int,
        dp_rank: int,
        dp_size: int,
        drop_last: bool = False,
    ) -> None:
        require_int(batch_size, "batch_size", minimum=1, error=ConfigError)
        require_int(dp_size, "dp_size", minimum=1, error=ConfigError)
        if not is_int(dp_rank) or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank must be in 0..{dp_size - 1}, got {dp_rank!r}")
        self.plan = plan
        self.batch_size = int(batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._start: tuple[int, int, int] = (0, 0, 0)  # (step, images, texts) the iteration starts at
        self._position = 0  # next step of the current iteration (absolute)
        self._cached: tuple[Any, np.ndarray, np.ndarray] | None = None

    def for_rank(self, dp_rank: int) -> MixtureSampler:
        """A fresh sampler (epoch 0) with these settings for another DP rank."""
        return type(self)(
            self.plan,
            batch_size=self.batch_size,
            dp_rank=dp_rank,
            dp_size=self.dp_size,
            drop_last=self.drop_last,
        )

    def _deal(self) -> tuple[np.ndarray, np.ndarray]:
        """``(cursors [S + 1, 2], own rows [S, batch_size])`` of the current epoch from the start point:
        the queues' positions after each step, and this rank's column of the deal (computed once)."""
        token = (self.epoch, self._start, self.dp_size, self.batch_size, self.drop_last)
        if self._cached is None or self._cached[0] != token:
            queues = self.plan.queues(self.epoch)
            cursors = step_cursors(
                queues,
                dp_size=self.dp_size,
                batch_size=self.batch_size,
                start=self._start[1:],
                drop_last=self.drop_last,
            )
            own = np.ascontiguousarray(self._rows(queues, cursors, slice(None), rank=self.dp_rank)[:, 0])
            own.setflags(write=False)
            self._cached = (token, cursors, own)
        return self._cached[1], self._cached[2]

    def _rows(self, queues: Any, cursors: np.ndarray, steps: slice, rank: int | None = None) -> np.ndarray:
        return step_rows(queues, cursors, steps, dp_size=self.dp_size, batch_size=self.batch_size, rank=rank)

    def deal(self) -> np.ndarray:
        """The current epoch's whole deal from the start point ``[steps, dp_size, batch_size]`` (every
        rank's; for reports and tests)."""
        cursors, _ = self._deal()
        return self._rows(self.plan.queues(self.epoch), cursors, slice(None))

    def image_exceptions(self) -> int:
        """Steps of the current epoch in which some rank holds an image row and another none."""
        return image_exceptions(self._deal()[0], self.dp_size)

    def __len__(self) -> int:
        cursors, _ = self._deal()
        return self._start[0] + cursors.shape[0] - 1

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first step (a resume point of another epoch is cleared)."""
        epoch = require_int(epoch, "epoch", minimum=0, error=ConfigError)
        if epoch != self.epoch:
            self._start = (0, 0, 0)
        self.epoch = epoch
        self._position = self._start[0]

    def key(self, step: int) -> BatchKey:
        """This rank's key of absolute step ``step`` of the current epoch (at or after the start point)."""
        _, own = self._deal()
        return BatchKey(self.epoch, step, self.dp_rank, tuple(own[step - self._start[0]].tolist()))

    def __iter__(self) -> Iterator[BatchKey]:
        start = self._start[0]
        self._position = start
        for step in range(start, len(self)):
            self._position = step + 1
            yield self.key(step)

    def state_dict(self, *, consumed: int | None = None) -> dict[str, Any]:
        """The resume point: the epoch, its next step and where its queues stand.

        ``consumed``: steps of this epoch the caller has consumed (counting from the epoch's first step);
        pass it when a DataLoader prefetches. Without it, the steps this sampler has yielded are used.
        """
        consumed = self._position if consumed is None else consumed
        if not self._start[0] <= consumed <= len(self):
            raise ConfigError(f"consumed must be in {self._start[0]}..{len(self)}, got {consumed}")
        cursors, _ = self._deal()
        images, texts = (int(v) for v in cursors[consumed - self._start[0]])
        return {
            "kind": _KIND,
            "mixture": self.plan.key,
            "epoch": self.epoch,
            "next_step": int(consumed),
            "images": images,
            "texts": texts,
            "dp_size": self.dp_size,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state`` stands, at this sampler's DP size and batch size (any)."""
        if state.get("kind") != _KIND:
            raise ConfigError(
                "this is not a mixture sampler's state (another pipeline's?); resume a mixture with the "
                "state its own sampler saved"
            )
        if state.get("mixture") != self.plan.key:
            raise ConfigError(
                f"the sampler state is of another mixture ({str(state.get('mixture'))[:16]}, this is "
                f"{self.plan.key[:16]}): its components, weights, seed or num_tokens differ"
            )
        values = {k: state.get(k) for k in ("epoch", "next_step", "images", "texts")}
        for name, value in values.items():
            if not is_int(value) or value < 0:
                raise ConfigError(f"sampler state {name}={value!r} must be an integer >= 0")
        self.epoch = int(values["epoch"])
        self._start = (int(values["next_step"]), int(values["images"]), int(values["texts"]))
        self._cached = None
        self._deal()  # a position outside the epoch is refused now, naming it
        self._position = self._start[0]

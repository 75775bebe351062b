"""What `build_batches` tells its user through `logging` (logger ``puzzletron.dataset.pipelines.text``), on
rank 0 only (the ``torch.distributed`` rank when a process group is initialised, else the DP rank):

- INFO while a token store is built: ``token store <path>: 12,288/100,000 rows of <snapshot> [train]
  (12%)`` at the start, then at every tenth of the rows or every 30 s, whichever comes first, and when it is
  done; ``reusing token store <path>`` when it was there; the in-memory tokenisation's rows and time;
- the plan: INFO with its rows and efficiency; WARNING when samples longer than ``pack_size`` were dropped
  or truncated, with how many samples and tokens and their share of the split's tokens (INFO when split).

`logging.basicConfig(level=logging.INFO)` (or a training framework's logging set-up) shows them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from puzzletron.dataset.distributed.collectives import process_group

__all__ = ["BuildProgress", "is_rank_zero", "log_mixture", "log_plan"]

LOG = logging.getLogger("puzzletron.dataset.pipelines.text")
_EVERY_S = 30.0
_STEPS = 10  # log at every tenth of the rows


def is_rank_zero(dp_rank: int) -> bool:
    """Whether this process reports: rank 0 of an initialised process group, else DP rank 0."""
    dist = process_group()
    return dist.get_rank() == 0 if dist is not None else dp_rank == 0


class BuildProgress:
    """`build_token_store`'s ``progress(done, total)``, logged (see the module docstring)."""

    def __init__(self, source: Any, split: str, *, clock: Any = time.monotonic) -> None:
        self.what = f"{source} [{split}]"
        self.clock = clock
        self.calls = 0
        self.started = self.last_time = clock()
        self.last_step = -1

    def __call__(self, done: int, total: int) -> None:
        self.calls += 1
        now = self.clock()
        step = done * _STEPS // max(total, 1)
        if step > self.last_step or done == total or now - self.last_time >= _EVERY_S:
            share = 100.0 * done / max(total, 1)
            LOG.info(
                "tokenising %s into a token store: %s/%s rows (%.0f%%)",
                self.what,
                f"{done:,}",
                f"{total:,}",
                share,
            )
            self.last_step, self.last_time = step, now

    def finished(self, path: Path) -> None:
        """Say where the store is: built now (in how long) or reused."""
        if self.calls:
            LOG.info("token store %s built in %.1f s", path, self.clock() - self.started)
        else:
            LOG.info("reusing token store %s", path)


def log_plan(plan: Any) -> None:
    """The plan's rows and efficiency (INFO) and what it dropped or cut (WARNING)."""
    s = plan.summary()
    LOG.info(
        "packed %s tokens of %s samples into %s rows of %s (lower bound %s), efficiency %.2f%%",
        f"{s['tokens']:,}",
        f"{s['placed']:,}",
        f"{s['rows']:,}",
        s["pack_size"],
        f"{s['lower_bound_rows']:,}",
        100.0 * s["efficiency"],
    )
    if s["dropped"]:
        share = 100.0 * s["dropped_tokens"] / max(s["tokens"] + s["dropped_tokens"], 1)
        LOG.warning(
            "dropped %s of %s samples longer than pack_size %s: %s tokens, %.1f%% of the split's tokens "
            "(data.packing.long_samples: truncate or split keeps them)",
            f"{s['dropped']:,}",
            f"{s['samples']:,}",
            s["pack_size"],
            f"{s['dropped_tokens']:,}",
            share,
        )
    if s["cut_samples"] and s["policy"] == "truncate":
        share = 100.0 * s["cut_tokens"] / max(s["tokens"] + s["cut_tokens"], 1)
        LOG.warning(
            "truncated %s of %s samples longer than pack_size %s: %s tokens cut, %.1f%% of the split's "
            "tokens",
            f"{s['cut_samples']:,}",
            f"{s['samples']:,}",
            s["pack_size"],
            f"{s['cut_tokens']:,}",
            share,
        )
    elif s["cut_samples"]:
        LOG.info(
            "split %s of %s samples longer than pack_size %s into pieces of at most %s tokens (none lost)",
            f"{s['cut_samples']:,}",
            f"{s['samples']:,}",
            s["pack_size"],
            s["pack_size"],
        )


def log_mixture(plan: Any, sampler: Any) -> None:
    """A mixture's first epoch, one INFO line a component (rows, tokens, share asked and achieved,
    passes), and a WARNING when some step holds images on some ranks only."""
    for c in plan.report(sampler.epoch):
        LOG.info(
            "mixture component %r: %s rows, %s real tokens, share %.2f%% (asked %.2f%%), %.2f passes, "
            "%s of %s samples",
            c.name,
            f"{c.rows_used:,}",
            f"{c.real_tokens:,}",
            100.0 * c.share_achieved,
            100.0 * c.share_asked,
            c.passes,
            f"{c.samples_used:,}",
            f"{c.samples:,}",
        )
    exceptions = sampler.image_exceptions()
    if exceptions:
        LOG.warning(
            "%s step(s) of the epoch hold images on some ranks only (the images run out there)", exceptions
        )

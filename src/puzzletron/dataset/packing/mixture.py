"""A mixture's epoch: which rows of which component, in what order, so that every prefix holds each
component's share of the real tokens. Pure functions of integers (``docs/mixtures.md``).

Each component has rows (packs of its own plan, or one sample a row) of known real tokens. `MixtureWeights`
says the share of real tokens each component gets, constant or as a schedule of regimes in tokens. An epoch
(`mixture_epoch`) lays every component's rows end to end (passes of seeded permutations, as many as its
budget needs) and gives the row ``j`` of component ``c`` the key ``x = W_c^-1(y_j)``: the point of the
epoch's token stream where ``c`` has delivered ``y_j`` tokens (the middle of that row) at its share, ``W_c``
being the tokens ``c`` is owed at each point. The epoch is every row sorted by key (weighted fair queueing)
cut where the stream reaches its budget::

    shares 0.5 / 0.5, rows of 4 tokens (a) and 2 tokens (b):
    a: keys 4 12 20       b: keys 2 6 10 14 18 22
    epoch   b a b b a b b a b ...     tokens of a and b differ by at most one row at every prefix

So each component's delivered tokens stay within about one row of its share of everything delivered, at
every prefix, and the order depends on nothing but the rows, the weights, the seed and the epoch: not on the
DP size, the batch size or the workers.

Epoch length: with ``num_tokens`` the stream is cut at that many real tokens (within half a row), repeating
components as needed, each pass reshuffled; without, it ends where the first component's single pass is used
up at its share (the others sub-sampled: the prefix of their seeded permutation).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from puzzletron.dataset._checks import did_you_mean, is_int, require_int, require_seed
from puzzletron.dataset.errors import ConfigError

__all__ = ["MixtureEpoch", "MixtureWeights", "mixture_epoch"]


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(float(value)):
        raise ConfigError(f"{where} must be a finite number >= 0, got {value!r}")
    if value < 0:
        raise ConfigError(f"{where} must be >= 0, got {value!r}")
    return float(value)


def _shares(raw: Any, names: Sequence[str], where: str) -> tuple[float, ...]:
    """The normalised shares of a ``{name: weight}`` mapping naming exactly ``names``."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must map each component name to a weight, got {type(raw).__name__}")
    unknown = [str(k) for k in raw if k not in names]
    if unknown:
        raise ConfigError(
            f"{where} names unknown component {unknown[0]!r}{did_you_mean(unknown[0], names)}; the "
            f"components are {sorted(names)}"
        )
    missing = [n for n in names if n not in raw]
    if missing:
        raise ConfigError(f"{where} has no weight for component(s) {missing} (give 0 to leave one out)")
    values = [_number(raw[n], f"{where}[{n!r}]") for n in names]
    total = math.fsum(values)
    if total <= 0:
        raise ConfigError(f"{where}: every weight is 0; at least one component needs a positive weight")
    return tuple(v / total for v in values)


@dataclass(frozen=True)
class MixtureWeights:
    """Each component's share of the real tokens (image tokens included), by regime.

    Attributes:
        names: the components, in the mixture's order.
        starts: ``[R]`` the real token of the epoch at which each regime starts (the first is 0).
        shares: ``[R][K]`` each regime's normalised shares (each row sums to 1).
    """

    names: tuple[str, ...]
    starts: tuple[int, ...]
    shares: tuple[tuple[float, ...], ...]

    @classmethod
    def parse(cls, names: Sequence[str], weights: Any) -> MixtureWeights:
        """From ``{name: weight}`` (one regime) or a schedule ``[(from_token, {name: weight}), ...]`` whose
        ``from_token`` values start at 0 and increase; `ConfigError` naming what is wrong."""
        names = tuple(str(n) for n in names)
        if not names:
            raise ConfigError("a mixture needs at least one component")
        if isinstance(weights, Mapping):
            return cls(names, (0,), (_shares(weights, names, "weights"),))
        if isinstance(weights, str | bytes) or not isinstance(weights, Sequence) or not weights:
            raise ConfigError(
                "weights must be {component: weight} or a schedule [(from_token, {component: weight}), ...]"
            )
        starts: list[int] = []
        shares: list[tuple[float, ...]] = []
        for i, entry in enumerate(weights):
            where = f"weights schedule entry {i}"
            if isinstance(entry, Mapping) and set(entry) == {"from_token", "weights"}:
                entry = (entry["from_token"], entry["weights"])
            if isinstance(entry, str | bytes) or not isinstance(entry, Sequence) or len(entry) != 2:
                raise ConfigError(f"{where} must be (from_token, {{component: weight}}), got {entry!r}")
            start = entry[0]
            if not is_int(start) or start < 0:
                raise ConfigError(f"{where}: from_token must be an integer >= 0, got {start!r}")
            if i == 0 and start != 0:
                raise ConfigError(f"{where}: the first regime must start at from_token 0, got {start}")
            if starts and start <= starts[-1]:
                raise ConfigError(f"{where}: from_token values must increase; {start} follows {starts[-1]}")
            starts.append(int(start))
            shares.append(_shares(entry[1], names, f"{where} weights"))
        return cls(names, tuple(starts), tuple(shares))

    def identity(self) -> dict[str, Any]:
        """What the order depends on: names, regime starts and shares (JSON-ready)."""
        shares = [list(s) for s in self.shares]
        return {"names": list(self.names), "starts": list(self.starts), "shares": shares}

    def share_at(self, token: float) -> tuple[float, ...]:
        """The shares of the regime that holds real token ``token`` of the epoch."""
        return self.shares[int(np.searchsorted(self.starts, token, side="right")) - 1]

    def owed(self, upto: float) -> np.ndarray:
        """``[K]`` float64: each component's tokens in the first ``upto`` real tokens of the epoch."""
        starts = np.asarray(self.starts, dtype=np.float64)
        ends = np.append(starts[1:], np.inf)
        spans = np.clip(np.minimum(ends, upto) - starts, 0, None)  # [R] tokens of each regime before upto
        return spans @ np.asarray(self.shares, dtype=np.float64)

    def inverse(self, c: int, owed: np.ndarray) -> np.ndarray:
        """The epoch point at which component ``c`` is owed ``owed`` tokens (``inf`` past its last
        positive regime): the inverse of `owed`, float64, vectorised."""
        starts = np.asarray(self.starts, dtype=np.float64)
        slope = np.asarray([s[c] for s in self.shares], dtype=np.float64)
        at_start = np.concatenate([[0.0], np.cumsum(np.diff(starts) * slope[:-1])])  # owed at each start
        # the last regime holding `owed` with a positive slope (a flat regime owes nothing more)
        regime = np.searchsorted(at_start, owed, side="right") - 1
        regime = np.clip(regime, 0, len(starts) - 1)
        rate = slope[regime]
        with np.errstate(divide="ignore", invalid="ignore"):
            x = starts[regime] + (owed - at_start[regime]) / rate
        return np.where(rate > 0, x, np.inf)


@dataclass(frozen=True, eq=False)
class MixtureEpoch:
    """One epoch's rows in stream order.

    Attributes:
        order: ``[n]`` int64 global row ids (``offsets[c]`` + row of component ``c``), stream order.
        offsets: ``[K + 1]`` int64: component ``c``'s rows are global ids ``offsets[c]..offsets[c+1]``.
        num_tokens: the real tokens the epoch was cut at (its budget).
    """

    order: np.ndarray
    offsets: np.ndarray
    num_tokens: int

    def components(self, ids: np.ndarray) -> np.ndarray:
        """The component index of each global row id."""
        return np.searchsorted(self.offsets, ids, side="right") - 1


def _budget(weights: MixtureWeights, pass_tokens: np.ndarray, num_tokens: int | None) -> int:
    """The epoch's real tokens: ``num_tokens``, else where the first component's pass runs out."""
    if num_tokens is not None:
        return require_int(num_tokens, "num_tokens", minimum=1, error=ConfigError)
    ends = [float(weights.inverse(c, np.asarray([float(t)]))[0]) for c, t in enumerate(pass_tokens)]
    return math.floor(min(ends))  # finite: the last regime gives someone a positive share


def mixture_epoch(
    row_tokens: Sequence[np.ndarray],
    weights: MixtureWeights,
    *,
    seed: int,
    epoch: int,
    num_tokens: int | None = None,
    shuffle: bool = True,
) -> MixtureEpoch:
    """The rows of epoch ``epoch`` in stream order (module docstring) for components of ``row_tokens``
    (``[R_c]`` real tokens of each row of component ``c``), weighted by ``weights``.

    Component ``c``'s pass ``p`` is its rows permuted by ``(seed, epoch, c, p)`` (plan order without
    ``shuffle``); ``num_tokens=None`` ends the epoch where the first component's pass is used up."""
    seed = require_seed(seed, error=ConfigError)
    epoch = require_int(epoch, "epoch", minimum=0, error=ConfigError)
    if len(row_tokens) != len(weights.names):
        raise ConfigError(f"{len(row_tokens)} components' rows for {len(weights.names)} weights")
    tokens = [np.asarray(t, dtype=np.int64).reshape(-1) for t in row_tokens]
    pass_tokens = np.asarray([int(t.sum()) for t in tokens], dtype=np.int64)
    owed_ever = weights.owed(np.inf)
    for c, name in enumerate(weights.names):
        if owed_ever[c] > 0 and pass_tokens[c] <= 0:
            raise ConfigError(f"component {name!r} has a positive weight but no usable row")
    budget = _budget(weights, pass_tokens, num_tokens)
    owed = weights.owed(budget)
    offsets = np.concatenate([[0], np.cumsum([t.shape[0] for t in tokens])]).astype(np.int64)
    keys: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    for c, t in enumerate(tokens):
        if owed[c] <= 0:
            continue
        # passes to cover what c is owed and one row more (the cut below takes rows by their middle)
        passes = max(1, math.ceil((owed[c] + int(t.max())) / pass_tokens[c]))
        rows = np.concatenate([_pass(t.shape[0], seed, epoch, c, p, shuffle) for p in range(passes)])
        length = t[rows]
        middle = np.cumsum(length, dtype=np.int64) - length / 2.0
        keys.append(weights.inverse(c, middle))
        ids.append(rows + offsets[c])
        lengths.append(length)
    key, gid, length = (np.concatenate(a) for a in (keys, ids, lengths))
    stream = np.argsort(key, kind="stable")  # ties: component order, then row order
    length = length[stream]
    before = np.cumsum(length) - length
    # rows whose middle is before the budget (at least one: an epoch is never empty)
    keep = max(int(np.searchsorted(before + length / 2.0, budget, side="left")), min(1, length.shape[0]))
    order = gid[stream[:keep]]
    order.setflags(write=False)
    return MixtureEpoch(order=order, offsets=offsets, num_tokens=int(budget))


def _pass(n: int, seed: int, epoch: int, component: int, index: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([seed, epoch, component, index]).permutation(n).astype(np.int64)

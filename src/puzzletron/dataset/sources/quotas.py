"""How many rows each Nemotron-VLM subset contributes: pure integer arithmetic, no floats.

>>> largest_remainder_quotas({"a": 10, "b": 30}, 7)
{'a': 2, 'b': 5}
>>> largest_remainder_quotas({"a": 1, "b": 1, "c": 1}, 2)
{'a': 1, 'b': 1, 'c': 0}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from puzzletron.dataset._checks import is_int, require_int
from puzzletron.dataset.errors import ConfigError

__all__ = ["largest_remainder_quotas", "redistribute_deficit"]


def largest_remainder_quotas(weights: Mapping[str, int], total: int) -> dict[str, int]:
    """Split `total` over `weights` proportionally with integer parts, by largest remainder.

    Exact integer arithmetic (no floats); ties go to the earlier key. Every weight must be positive.

    >>> largest_remainder_quotas({"z": 1, "a": 1, "m": 1}, 1)
    {'z': 1, 'a': 0, 'm': 0}
    """
    require_int(total, "total", minimum=0, error=ConfigError)
    names = list(weights)
    if not names:
        raise ConfigError("weights must name at least one key")
    if any(not is_int(w) or w <= 0 for w in weights.values()):
        raise ConfigError(f"weights must be positive integers, got {dict(weights)}")
    whole = sum(weights.values())
    quotas = {name: total * weights[name] // whole for name in names}
    left = total - sum(quotas.values())
    # remainder of name i is (total * w_i) mod W; sort by it descending, then by position
    order = sorted(range(len(names)), key=lambda i: (-(total * weights[names[i]] % whole), i))
    for i in order[:left]:
        quotas[names[i]] += 1
    return quotas


def redistribute_deficit(
    weights: Mapping[str, int], taken: Mapping[str, int], live: Sequence[str], deficit: int
) -> dict[str, int]:
    """Extra rows each `live` subset takes over when another runs dry `deficit` rows short: largest
    remainder over ``max(weight - taken, 1)`` so subsets furthest below their weight take the most.

    >>> redistribute_deficit({"a": 10, "b": 30, "c": 1}, {"a": 3, "b": 2, "c": 5}, ["b", "c"], 5)
    {'b': 5, 'c': 0}
    """
    if not live:
        return {}
    return largest_remainder_quotas({name: max(weights[name] - taken[name], 1) for name in live}, deficit)

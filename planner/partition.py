"""Split a chain of units into contiguous stages (pure functions over plain cost arrays).

`chain_partition`: exact dynamic program for the min-max (bottleneck) contiguous partition, the fast path
(as Alpa's stage DP, over a cost array): best[j][i] = min over split l of max(best[j-1][l], cost(l..i)).
"""
from __future__ import annotations

from typing import Sequence

from cost_models.errors import ConfigError


def chain_partition(costs: Sequence[float], k: int) -> list[tuple[int, int]]:
    """Split units 0..n-1 into k contiguous non-empty [start, end) ranges minimising the largest range sum."""
    n = len(costs)
    if k < 1 or k > n:
        raise ConfigError(f"cannot split {n} units into {k} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for l in range(j - 1, i):
                value = max(best[j - 1][l], prefix[i] - prefix[l])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, l
    ranges, i = [], n
    for j in range(k, 0, -1):
        l = cut[j][i]
        ranges.append((l, i))
        i = l
    return ranges[::-1]


def stages_from_ranges(names: Sequence[str], ranges: Sequence[tuple[int, int]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(names[a:b]) for a, b in ranges)

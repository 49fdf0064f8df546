"""Small statistics helpers shared by the benchmarks."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), as numpy's default; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Quantile q (0..1) of the observations a cumulative histogram ({upper bound: count}, +Inf
    included) gained between two scrapes, interpolated linearly within the bucket as Prometheus'
    histogram_quantile does; NaN if it gained none. In the buckets' unit."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return math.nan
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, cumulative in zip(bounds, counts, strict=True):
        if cumulative >= rank and cumulative > below:
            if math.isinf(bound):
                return lower  # beyond the last finite bucket: its bound is all that is known
            return lower + (bound - lower) * (rank - below) / (cumulative - below)
        lower, below = bound, cumulative
    return lower

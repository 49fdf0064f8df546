"""Benchmark arithmetic: percentiles and the proxy bench's bootstrap interval."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eval.bench_proxy import _bootstrap_median_ci
from eval.stats import percentile


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.5, 8.25]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile([], 50))


def test_bootstrap_interval_brackets_the_median_and_narrows_with_more_data() -> None:
    small = [float(x % 7) for x in range(20)]
    large = small * 20
    low_s, high_s = _bootstrap_median_ci(small)
    low_l, high_l = _bootstrap_median_ci(large)
    assert low_s <= np.median(small) <= high_s
    assert low_l <= np.median(large) <= high_l
    assert high_l - low_l <= high_s - low_s

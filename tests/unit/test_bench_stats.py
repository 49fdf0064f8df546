"""Benchmark arithmetic: percentiles and the proxy bench's bootstrap interval."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from eval.bench_proxy import _bootstrap_median_ci
from eval.match_latency import _cpu_ticks
from eval.stats import histogram_quantile, percentile


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


INF = float("inf")


def test_histogram_quantile_interpolates_within_the_bucket_of_the_window() -> None:
    before = {0.001: 5.0, 0.01: 5.0, 0.1: 5.0, INF: 5.0}  # observations before the window do not count
    after = {0.001: 5.0 + 50, 0.01: 5.0 + 90, 0.1: 5.0 + 100, INF: 5.0 + 100}
    assert histogram_quantile(before, after, 0.5) == pytest.approx(0.001)  # the 50th of 100 is the bucket's edge
    assert histogram_quantile(before, after, 0.7) == pytest.approx(0.001 + 0.009 * (20 / 40))
    assert histogram_quantile(before, after, 0.99) == pytest.approx(0.01 + 0.09 * (9 / 10))


def test_histogram_quantile_edges() -> None:
    assert math.isnan(histogram_quantile({}, {0.1: 0.0, INF: 0.0}, 0.5))
    assert histogram_quantile({}, {0.1: 0.0, INF: 3.0}, 0.5) == 0.1  # all above the last finite bound
    assert histogram_quantile({}, {0.1: 4.0, INF: 4.0}, 0.0) == 0.0


def test_cpu_ticks_read_the_machine_line_of_proc_stat() -> None:
    first = _cpu_ticks()
    assert first is not None  # Linux: every test machine has /proc/stat
    total, steal = first
    assert 0 <= steal <= total
    burn = time.perf_counter() + 0.05
    while time.perf_counter() < burn:  # 50 ms: every CPU's counters (idle included) advance a few jiffies
        pass
    later = _cpu_ticks()
    assert later is not None and later[0] > total and later[1] >= steal

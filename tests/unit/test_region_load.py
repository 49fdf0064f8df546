"""A region's summary (scheduler.region_summary.load_of) and the finish rate it prices a full
region's wait by (symphony.finish_rate)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eval.sim.presets import PRESETS, sim_cost_profile
from scheduler.region_summary import load_of
from scheduler.routing import NodeSnapshot
from symphony.finish_rate import FinishRate


def test_finish_rate_counts_the_window_and_forgets_what_left_it() -> None:
    rate = FinishRate(window_ms=1000.0, buckets=10)
    assert rate.per_s(0.0) == 0.0
    for t in range(0, 1000, 10):  # 100 finishes over the first second
        rate.finished(float(t))
    assert rate.per_s(1000.0) == pytest.approx(100.0, rel=0.02)
    # the window's buckets now start at 600 ms: the 40 finishes since, over 0.9 s
    assert rate.per_s(1500.0) == pytest.approx(40 / 0.9)
    assert rate.per_s(2500.0) == 0.0  # all of it left the window
    rate.finished(2500.0, count=3)
    assert rate.per_s(3000.0) == pytest.approx(3 / 0.9)  # the window from 2.1 s


def test_finish_rate_early_on_is_over_the_time_since_the_first() -> None:
    rate = FinishRate(window_ms=10_000.0)
    rate.finished(5000.0)
    rate.finished(5500.0)
    assert rate.per_s(6000.0) == pytest.approx(2.0)  # 2 in 1 s, not in the 10 s window


@given(st.lists(st.floats(0, 100_000), max_size=200), st.floats(100, 20_000))
def test_finish_rate_is_at_most_what_the_window_saw(times: list[float], window_ms: float) -> None:
    rate = FinishRate(window_ms=window_ms, buckets=8)
    for t in sorted(times):
        rate.finished(t)
    now = max(times, default=0.0) + 1.0
    span = min(window_ms + rate.bucket_ms, now - min(times, default=0.0))
    assert 0.0 <= rate.per_s(now) <= len(times) * 1000.0 / max(span - rate.bucket_ms, 1.0) + 1e-9


def test_finish_rate_refuses_a_window_of_nothing() -> None:
    with pytest.raises(ValueError, match="window"):
        FinishRate(window_ms=0.0)


A100 = PRESETS["a100-llama3.1-8b"]
PROFILE = sim_cost_profile(A100.engine, A100.link)


def _full(node_id: str) -> NodeSnapshot:
    return NodeSnapshot(node_id, True, running=256, waiting=4, inflight=260, kv_usage=0.9)


def test_a_full_regions_wait_is_the_time_for_those_held_back_to_start() -> None:
    """Every engine full and 99 requests held back: a new one starts after 100 running requests
    end, which at 50 a second is 2 s, far more than the prefills of those ahead."""
    nodes = [_full("node-0"), _full("node-1")]
    without = load_of(nodes, 99, PROFILE)
    with_rate = load_of(nodes, 99, PROFILE, finishing_per_s=50.0)
    idle = load_of(nodes, 0, PROFILE, finishing_per_s=50.0)
    assert with_rate.queue_ms == pytest.approx(idle.queue_ms + 2000.0)
    assert without.queue_ms < with_rate.queue_ms
    # nothing held back: the rate changes nothing
    assert idle.queue_ms == load_of(nodes, 0, PROFILE).queue_ms

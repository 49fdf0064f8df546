"""A region's summary (scheduler.region_summary.load_of) and the finish rate it prices a full
region's wait by (symphony.finish_rate)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eval.sim.presets import PRESETS, sim_cost_profile
from scheduler.cost_profile import DEFAULT_PROFILE
from scheduler.kv_index import NodePrefix
from scheduler.region_summary import held_prices, load_of
from scheduler.routing import NodeSnapshot
from symphony.finish_rate import FinishRate
from symphony.region_load import RegionLoad


def test_finish_rate_counts_the_window_and_forgets_what_left_it() -> None:
    rate = FinishRate(window_ms=1000.0, buckets=10)
    assert rate.per_s(0.0) == 0.0
    for t in range(0, 1000, 10):  # 100 finishes over the first second
        rate.finished(float(t))
    assert rate.per_s(1000.0) == pytest.approx(100.0, rel=0.02)
    # the window's buckets now start at 600 ms: the 40 finishes since, over 0.9 s
    assert rate.per_s(1500.0) == pytest.approx(40 / 0.9)
    assert rate.per_s(2500.0) == pytest.approx(1 / 0.9)  # all of it left the window: below one in it
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
    if not times:
        assert rate.per_s(now) == 0.0
        return
    # the window read spans at least all but its newest bucket, or the time since the first finish
    span = min(window_ms - rate.bucket_ms, now - min(times))
    assert 0.0 < rate.per_s(now) <= max(len(times), 1) * 1000.0 / max(span, 1e-9) + 1e-9


def test_finish_rate_reads_a_window_with_none_as_below_one_a_window_and_early_as_one_bucket() -> None:
    rate = FinishRate(window_ms=1000.0, buckets=10)
    rate.finished(0.0)
    assert rate.per_s(1.0) == pytest.approx(10.0)  # one finish over one bucket, not over 1 ms
    # none for a minute: below one in the window (its buckets from 59.1 s)
    assert rate.per_s(60_000.0) == pytest.approx(1 / 0.9)
    later = FinishRate(window_ms=1000.0, buckets=10)
    later.finished(9_000.0)
    later.finished(8_000.0)  # an earlier time than the last counts in the newest bucket, still in the window
    assert later.per_s(9_500.0) == pytest.approx(2 / 0.5)  # both, over the 0.5 s since the first


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


def test_a_summary_counts_its_capacity_and_reads_without_it_from_an_older_scheduler() -> None:
    load = load_of([_full("node-0"), _full("node-1")], 3, PROFILE, max_running=256)
    assert load.capacity == 512
    body = load.to_json()
    assert RegionLoad.from_json(body) == load
    del body["capacity"]  # a scheduler of the version before
    assert RegionLoad.from_json(body).capacity == 0
    body["capacity"] = "many"
    with pytest.raises(ValueError, match="capacity"):
        RegionLoad.from_json(body)
    del body["capacity"], body["running"]  # a field without a default is required
    with pytest.raises(ValueError, match="running"):
        RegionLoad.from_json(body)


def test_what_a_region_holds_is_priced_by_the_tiers_its_blocks_sit_in() -> None:
    """The CPU host's measured tiers: HBM 0.97 us a token, DRAM 1.45, SSD 11.9 (DEFAULT_PROFILE)."""
    tiers = DEFAULT_PROFILE.tier_load_ms_per_token
    # 100 blocks sampled: 40 fastest in an engine's cache, 10 in HBM, 30 in DRAM, 20 on SSD.
    mix = NodePrefix(100, engine=40, hbm=10, dram=30, ssd=20)
    load, read = held_prices(DEFAULT_PROFILE, mix)
    assert load == pytest.approx((10 * tiers.hbm + 30 * tiers.dram + 20 * tiers.ssd) / 100)
    assert read == pytest.approx(load + 40 * tiers.dram / 100)  # the engine's copy is read as DRAM
    # all on SSD against all in engines
    assert held_prices(DEFAULT_PROFILE, NodePrefix(5, ssd=5)) == pytest.approx((tiers.ssd, tiers.ssd))
    assert held_prices(DEFAULT_PROFILE, NodePrefix(5, engine=5)) == pytest.approx((0.0, tiers.dram))
    # nothing sampled: DRAM, where a node saves a session's KV
    assert held_prices(DEFAULT_PROFILE, None) == held_prices(DEFAULT_PROFILE, NodePrefix(0)) == (tiers.dram,) * 2
    summary = load_of([_full("node-0")], 0, DEFAULT_PROFILE, held=mix)
    assert (summary.held_load_ms_per_token, summary.held_read_ms_per_token) == (load, read)
    assert summary.pulled_load_ms_per_token == tiers.dram
    assert RegionLoad.from_json(summary.to_json()) == summary

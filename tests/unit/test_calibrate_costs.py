"""eval.calibrate_costs' arithmetic: rates to per-token tier costs, pulls to a link, the profile it
builds (the measurements themselves run in `symphony bench calibrate`)."""

from __future__ import annotations

import pytest

from eval.calibrate_costs import build_profile, fit_link, tier_costs
from eval.sim.engine import EngineModel
from scheduler.cost_profile import LinkCost, NodeLink, TierLoadCosts, from_json, problems, to_json

ENGINE = EngineModel(
    step_ms=18.0,
    prefill_ms_per_token=0.36,
    decode_ms_per_seq=0.9,
    decode_ms_per_kilotoken=4.4,
    kv_blocks=1456,
    block_size=32,
    request_overhead_ms=54.0,
    prefill_ms_per_token_kilotoken=1.1,
)


def test_tier_rates_become_milliseconds_per_token() -> None:
    # 20,000 bytes a token: at 20 GB/s 1 us, at 10 GB/s 2 us, at 2 GB/s 10 us.
    rates = {"memcpy_gbps": 20.0, "dram_load_gbps": 10.0, "ssd_read_gbps": 2.0}
    assert tier_costs(20_000, rates) == TierLoadCosts(engine=0.0, hbm=0.001, dram=0.002, ssd=0.01)
    # With a device, a DRAM load is the copy to it.
    assert tier_costs(20_000, {**rates, "dram_to_device_gbps": 5.0}).dram == pytest.approx(0.004)
    # A plain copy measured slower than the store's DRAM load (noise on one host's memory) is capped,
    # and so is an SSD read faster than DRAM (a cached read): the tiers stay in order.
    noisy = tier_costs(20_000, {"memcpy_gbps": 8.0, "dram_load_gbps": 10.0, "ssd_read_gbps": 40.0})
    assert noisy == TierLoadCosts(engine=0.0, hbm=0.002, dram=0.002, ssd=0.002)


def test_a_link_is_the_line_through_the_median_pull_at_each_size() -> None:
    # 1 MB in 1.5 ms and 11 MB in 6.5 ms (medians; the outliers do not move them): 0.5 ms per MB,
    # 2 GB/s, after a 1 ms round trip.
    samples = [(1e6, 1.5), (1e6, 1.4), (1e6, 9.0), (11e6, 6.5), (11e6, 6.4), (11e6, 30.0)]
    fit = fit_link(samples)
    assert fit.rtt_ms == pytest.approx(1.0) and fit.bandwidth_gbps == pytest.approx(2.0)
    with pytest.raises(RuntimeError, match="not slower"):
        fit_link([(1e6, 5.0), (11e6, 4.0)])


def test_the_built_profile_is_plausible_and_keeps_every_measured_link() -> None:
    links = [NodeLink("node-0", "node-1", 0.3, 2.0), NodeLink("node-1", "node-0", 0.5, 3.0)]
    tiers = TierLoadCosts(engine=0.0, hbm=0.001, dram=0.0015, ssd=0.012)
    profile = build_profile(ENGINE, kv_bytes_per_token=23_040, tiers=tiers, links=links, model="m", source="test")
    assert problems(profile) == []
    assert profile.engine_kv_tokens == 1456 * 32 and profile.prefill_ms_per_token_kilotoken == 1.1
    assert profile.link("node-1", "node-0") == LinkCost(0.5, 3.0)
    assert profile.default_link == LinkCost(0.4, 2.5)  # the medians stand for pairs not measured
    assert profile.model == "m" and profile.host and profile.measured_at_unix_s > 0
    assert from_json(to_json(profile)) == profile

"""scheduler.pull_costs: the link costs a move is priced at, corrected by the pulls the scheduler saw."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.cost_profile import DEFAULT_PROFILE, LinkCost, NodeLink, TierLoadCosts
from scheduler.pull_costs import MAX_MS_PER_TOKEN, MIN_PULL_TOKENS, NEWEST_WEIGHT, ObservedLink, ObservedLinks

# 1,000 bytes a token; the calibrated links move a token in 0.001 ms (1 GB/s) after a 2 ms round
# trip ("a" -> "c": 10 ms); a DRAM read or write costs 0.0005 ms a token. The engine's costs play no part.
BASE = dataclasses.replace(
    DEFAULT_PROFILE,
    kv_bytes_per_token=1_000,
    tier_load_ms_per_token=TierLoadCosts(engine=0.0, hbm=0.0001, dram=0.0005, ssd=0.01),
    default_link=LinkCost(rtt_ms=2.0, bandwidth_gbps=1.0),
    links=(NodeLink("a", "c", rtt_ms=10.0, bandwidth_gbps=1.0),),
)


def test_a_pair_is_priced_at_its_observed_rate_from_its_third_pull() -> None:
    """1,000 tokens in 12 ms: 12 - 2 (round trip) = 10 ms, 0.01 a token, less 0.001 for the DRAM
    read and write at both ends: 0.009 ms a token, 1,000 bytes / 0.009 ms = 0.111 GB/s."""
    links = ObservedLinks(BASE)
    assert links.observe("a", "b", 1_000, 12.0) is None
    assert links.observe("a", "b", 1_000, 12.0) is None
    profile = links.observe("a", "b", 1_000, 12.0)
    assert profile is not None and links.observed("a", "b") == (pytest.approx(0.009), 3)
    assert profile.link("a", "b") == LinkCost(2.0, pytest.approx(1_000 / 0.009 / 1e6))
    assert profile.link("a", "b").move_ms(1_000 * 1_000) == pytest.approx(2.0 + 9.0)
    # Other pairs keep their calibrated links, the round trip too; the rest of the profile is the same.
    assert profile.link("b", "a") == BASE.default_link and profile.link("a", "c") == LinkCost(10.0, 1.0)
    assert dataclasses.replace(profile, links=BASE.links) == BASE


def test_the_rate_follows_new_pulls_by_a_moving_average() -> None:
    links = ObservedLinks(BASE)
    for _ in range(3):
        links.observe("a", "b", 1_000, 12.0)  # 0.009 a token
    profile = links.observe("a", "b", 1_000, 42.0)  # 0.039 a token
    expected = 0.009 + NEWEST_WEIGHT * (0.039 - 0.009)
    assert links.observed("a", "b") == (pytest.approx(expected), 4)
    assert profile is not None and profile.link("a", "b").bandwidth_gbps == pytest.approx(1_000 / expected / 1e6)


def test_a_calibrated_pair_is_replaced_not_duplicated() -> None:
    links = ObservedLinks(BASE)
    for _ in range(3):
        profile = links.observe("a", "c", 1_000, 30.0)  # 30 - 10 = 20 ms: 0.02 - 0.001 = 0.019 a token
    assert profile is not None and [(x.source, x.target) for x in profile.links] == [("a", "c")]
    assert profile.link("a", "c") == LinkCost(10.0, pytest.approx(1_000 / 0.019 / 1e6))


def test_small_pulls_self_pulls_and_nonsense_are_not_observed() -> None:
    links = ObservedLinks(BASE)
    for _ in range(5):
        assert links.observe("a", "b", MIN_PULL_TOKENS - 1, 500.0) is None
        assert links.observe("a", "a", 1_000, 500.0) is None
        assert links.observe("a", "b", 1_000, float("nan")) is None
    assert links.observed("a", "b") == (0.0, 0) and links.profile() == BASE


def test_a_stall_counts_as_the_slowest_rate_believed_and_a_fast_pull_as_no_less_than_free() -> None:
    links = ObservedLinks(BASE)
    links.observe("a", "b", 1_000, 60_000.0)  # a minute: a stall
    assert links.observed("a", "b")[0] == MAX_MS_PER_TOKEN
    links.observe("c", "b", 1_000, 0.5)  # under the round trip
    links.observe("c", "b", 1_000, 0.5)
    profile = links.observe("c", "b", 1_000, 0.5)
    assert links.observed("c", "b")[0] == 0.0
    assert profile is not None and profile.link("c", "b").bandwidth_gbps == pytest.approx(1_000.0)  # 1 TB/s at most


def test_the_pairs_kept_are_bounded() -> None:
    links = ObservedLinks(BASE, max_pairs=2)
    for source in ("a", "b", "c"):
        links.observe(source, "x", 1_000, 12.0)
    assert links.observed("a", "x") == (0.0, 0)
    assert links.observed("b", "x")[1] == links.observed("c", "x")[1] == 1


def test_described_pairs_show_the_observed_rate_next_to_the_calibrated_one() -> None:
    links = ObservedLinks(BASE)
    links.observe("c", "b", 1_000, 12.0)  # 0.009 a token, not priced yet
    for _ in range(3):
        links.observe("a", "c", 1_000, 30.0)  # 0.019 a token over the calibrated 10 ms link
    assert links.describe() == [
        ObservedLink("a", "c", pytest.approx(0.019), calibrated_ms_per_token=0.001, pulls=3, priced=True),
        ObservedLink("c", "b", pytest.approx(0.009), calibrated_ms_per_token=0.001, pulls=1, priced=False),
    ]

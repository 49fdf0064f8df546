"""scheduler.advisories: pending-advisory table bounded by TTL and size, with exact per-node counts."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.advisories import AdvisoryTable
from scheduler.cost_profile import DEFAULT_PROFILE, TierLoadCosts
from scheduler.decisions import advisory_move
from scheduler.routing import HeldPrefix


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def table(clock: FakeClock, *, max_entries: int = 100, ttl_s: float = 10.0) -> AdvisoryTable:
    return AdvisoryTable(max_entries, ttl_s, clock=clock)


A = ("tenant", "session-a")
B = ("tenant", "session-b")
C = ("tenant", "session-c")


# -- put / take -------------------------------------------------------------------------------------
def test_take_returns_the_advisory_once(clock: FakeClock) -> None:
    t = table(clock)
    t.put(A, "typing", "node-1", None)
    advisory = t.take(A)
    assert advisory is not None
    assert (advisory.session, advisory.kind, advisory.node_id) == (A, "typing", "node-1")
    assert t.take(A) is None
    assert len(t) == 0


def test_take_of_unknown_session_is_none(clock: FakeClock) -> None:
    assert table(clock).take(A) is None


def test_sessions_are_keyed_by_tenant_too(clock: FakeClock) -> None:
    t = table(clock)
    t.put(("t1", "s"), "typing", "node-1", None)
    assert t.take(("t2", "s")) is None
    assert t.take(("t1", "s")) is not None


def test_put_records_creation_time_and_expected_arrival(clock: FakeClock) -> None:
    advisory = table(clock, ttl_s=10.0).put(A, "predecessor", "node-1", 2500)
    assert advisory.created_at == clock.now
    assert advisory.expected_arrival_ms == 2500
    assert advisory.expires_at == pytest.approx(clock.now + 2.5 + 10.0)


def test_new_put_replaces_the_old_advisory_for_the_session(clock: FakeClock) -> None:
    t = table(clock)
    t.put(A, "typing", "node-1", None)
    t.put(A, "predecessor", "node-2", None)
    assert len(t) == 1
    advisory = t.take(A)
    assert advisory is not None
    assert (advisory.kind, advisory.node_id) == ("predecessor", "node-2")
    assert t.evicted == 0


# -- expiry -----------------------------------------------------------------------------------------
def test_advisory_is_returned_up_to_its_ttl(clock: FakeClock) -> None:
    t = table(clock, ttl_s=10.0)
    t.put(A, "typing", "node-1", None)
    clock.advance(10.0)
    assert t.take(A) is not None
    assert t.expired == 0


def test_advisory_past_its_ttl_is_not_returned_and_counts_as_expired(clock: FakeClock) -> None:
    t = table(clock, ttl_s=10.0)
    t.put(A, "typing", "node-1", None)
    clock.advance(10.01)
    assert t.take(A) is None
    assert t.expired == 1
    assert len(t) == 0


def test_ttl_counts_from_expected_arrival(clock: FakeClock) -> None:
    t = table(clock, ttl_s=10.0)
    t.put(A, "predecessor", "node-1", 30_000)  # expected in 30 s; valid until 40 s from now
    clock.advance(39.0)
    assert t.take(A) is not None

    t.put(B, "predecessor", "node-1", 30_000)
    clock.advance(40.5)
    assert t.take(B) is None
    assert t.expired == 1


def test_put_sweeps_expired_entries_from_the_front(clock: FakeClock) -> None:
    t = table(clock, ttl_s=10.0)
    t.put(A, "typing", "node-1", None)
    t.put(B, "typing", "node-2", None)
    clock.advance(11.0)
    t.put(C, "typing", "node-3", None)
    assert len(t) == 1
    assert t.expired == 2
    assert dict(t.pending_by_node) == {"node-3": 1}


# -- size bound -------------------------------------------------------------------------------------
def test_size_bound_evicts_the_least_recently_inserted(clock: FakeClock) -> None:
    t = table(clock, max_entries=2)
    t.put(A, "typing", "node-1", None)
    t.put(B, "typing", "node-2", None)
    t.put(C, "typing", "node-3", None)
    assert len(t) == 2
    assert t.evicted == 1
    assert t.take(A) is None
    assert t.take(B) is not None
    assert t.take(C) is not None


def test_replacing_refreshes_insertion_order(clock: FakeClock) -> None:
    t = table(clock, max_entries=2)
    t.put(A, "typing", "node-1", None)
    t.put(B, "typing", "node-2", None)
    t.put(A, "typing", "node-1", None)  # A is now the newest
    t.put(C, "typing", "node-3", None)
    assert t.take(B) is None
    assert t.take(A) is not None


def test_expired_entries_go_before_live_ones_are_evicted(clock: FakeClock) -> None:
    t = table(clock, max_entries=1, ttl_s=1.0)
    t.put(A, "typing", "node-1", None)
    clock.advance(2.0)
    t.put(B, "typing", "node-2", None)
    assert (t.expired, t.evicted) == (1, 0)


@pytest.mark.parametrize("max_entries", [0, -1])
def test_non_positive_max_entries_is_rejected(max_entries: int) -> None:
    with pytest.raises(ValueError, match="max_entries"):
        AdvisoryTable(max_entries, 10.0)


# -- pending_by_node --------------------------------------------------------------------------------
def test_pending_by_node_counts_puts_per_node(clock: FakeClock) -> None:
    t = table(clock)
    t.put(A, "typing", "node-1", None)
    t.put(B, "typing", "node-1", None)
    t.put(C, "typing", "node-2", None)
    assert dict(t.pending_by_node) == {"node-1": 2, "node-2": 1}


def test_pending_by_node_moves_with_a_replacement(clock: FakeClock) -> None:
    t = table(clock)
    t.put(A, "typing", "node-1", None)
    t.put(A, "typing", "node-2", None)
    assert dict(t.pending_by_node) == {"node-2": 1}


def test_pending_by_node_drops_key_when_taken(clock: FakeClock) -> None:
    t = table(clock)
    t.put(A, "typing", "node-1", None)
    t.take(A)
    assert "node-1" not in t.pending_by_node
    t.take(A)  # a second take must not drive the count negative
    assert dict(t.pending_by_node) == {}


def test_pending_by_node_drops_expired_take(clock: FakeClock) -> None:
    t = table(clock, ttl_s=1.0)
    t.put(A, "typing", "node-1", None)
    clock.advance(5.0)
    assert t.take(A) is None
    assert dict(t.pending_by_node) == {}


def test_pending_by_node_drops_evicted(clock: FakeClock) -> None:
    t = table(clock, max_entries=1)
    t.put(A, "typing", "node-1", None)
    t.put(B, "typing", "node-2", None)
    assert dict(t.pending_by_node) == {"node-2": 1}


def test_pending_by_node_matches_table_through_a_mixed_sequence(clock: FakeClock) -> None:
    t = table(clock, max_entries=3, ttl_s=5.0)
    live: dict[tuple[str, str], str] = {}
    for step in range(60):
        session = ("tenant", f"s{step % 7}")
        node_id = f"node-{step % 3}"
        if step % 4 == 3:
            t.take(session)
        else:
            t.put(session, "typing", node_id, (step % 5) * 100)
        clock.advance(0.7 if step % 6 else 3.0)
        live = {key: adv.node_id for key, adv in t._entries.items()}
        expected: dict[str, int] = {}
        for owner in live.values():
            expected[owner] = expected.get(owner, 0) + 1
        assert dict(t.pending_by_node) == expected
        assert all(count > 0 for count in t.pending_by_node.values())
        assert len(t) <= 3


def test_purge_drops_expired_advisories_without_new_puts(clock: FakeClock) -> None:
    # Stale advisories must stop counting as load even if no further advisory ever arrives.
    t = table(clock, ttl_s=10.0)
    for i in range(50):
        t.put(("default", f"s{i}"), "typing", "node-1", None)
    clock.advance(11.0)
    t.purge()
    assert len(t) == 0 and dict(t.pending_by_node) == {}
    assert t.expired == 50


def test_a_far_ahead_hint_does_not_shield_later_expiries(clock: FakeClock) -> None:
    t = table(clock, ttl_s=10.0)
    t.put(A, "predecessor", "node-1", 3_600_000)  # valid for an hour and more
    t.put(B, "typing", "node-2", None)
    clock.advance(11.0)
    t.purge()
    assert dict(t.pending_by_node) == {"node-1": 1}
    assert t.take(A) is not None


def test_drops_are_reported_with_their_reason(clock: FakeClock) -> None:
    reasons: list[str] = []
    t = AdvisoryTable(1, 5.0, clock=clock, on_drop=reasons.append)
    t.put(A, "typing", "node-1", None)
    t.put(B, "typing", "node-1", None)  # evicts A
    clock.advance(6.0)
    t.purge()  # B expires
    assert reasons == ["evicted", "expired"]


def test_expiry_heap_stays_bounded_when_advisories_are_used(clock: FakeClock) -> None:
    t = table(clock, max_entries=4, ttl_s=1000.0)
    for i in range(100):
        key = ("default", f"s{i}")
        t.put(key, "typing", "node-1", None)
        assert t.take(key) is not None
    assert len(t._expiry) <= 2 * 4 + 1


def test_an_advisory_warms_the_engine_only_where_that_costs_less_than_loading_at_arrival() -> None:
    """A warm-up pass costs the engine `request_overhead_ms + step_ms`; it saves the request the
    load of what the node holds below the engine's cache, at the profile's tier costs."""
    profile = dataclasses.replace(
        DEFAULT_PROFILE,
        request_overhead_ms=40.0,
        step_ms=10.0,
        tier_load_ms_per_token=TierLoadCosts(engine=0.0, hbm=0.001, dram=0.01, ssd=0.1),
    )
    # 4,000 DRAM tokens: 40 ms to load, under the 50 ms a warm-up costs.
    assert advisory_move(profile, HeldPrefix(dram=4_000), from_peer=False) == "loads_on_arrival"
    assert advisory_move(profile, HeldPrefix(dram=4_000), from_peer=True) == "dram"
    # 6,000: 60 ms. Or 500 on SSD (50 ms) beside 2,000 in the engine (free) and 1,000 in DRAM (10 ms).
    assert advisory_move(profile, HeldPrefix(dram=6_000), from_peer=False) == "hbm"
    assert advisory_move(profile, HeldPrefix(engine=2_000, dram=1_000, ssd=500), from_peer=True) == "hbm"
    assert advisory_move(profile, HeldPrefix(engine=50_000), from_peer=False) == "loads_on_arrival"

"""Admission of requests that would wait for a node (scheduler.admission): the expected wait, the
rate slots free up at, the held-back queue's use of it per tier and tenant, and the scheduler's
answer (503 `overloaded` with Retry-After)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.admission import MAX_RETRY_AFTER_S, Overloaded, SlotRate, SlotTime, admit
from scheduler.decisions import rooms
from scheduler.errors import ApiError
from scheduler.held_queue import HeldQueue
from scheduler.metrics import SchedulerMetrics
from scheduler.push_queue import PushQueue
from scheduler.routing import NodeSnapshot
from symphony.finish_rate import FinishRate
from symphony.priority import Priority

NORMAL, HIGH = Priority("normal"), Priority("high")


def test_the_wait_is_the_requests_ahead_and_itself_at_the_slot_rate() -> None:
    verdict = admit(ahead=3, slots_per_s=2.0, max_wait_s=2.0)
    assert verdict.admitted and verdict.wait_s == 2.0  # (3 + 1) / 2: exactly the bound still gets in
    refused = admit(ahead=4, slots_per_s=2.0, max_wait_s=2.0)
    assert not refused.admitted and refused.wait_s == 2.5
    assert refused.retry_after_s == 1  # 0.5 s over, in whole seconds, at least 1
    assert admit(ahead=39, slots_per_s=2.0, max_wait_s=2.0).retry_after_s == 18  # 20 s, 18 over
    assert admit(ahead=10**9, slots_per_s=0.01, max_wait_s=1.0).retry_after_s == MAX_RETRY_AFTER_S


def test_without_a_rate_every_request_is_admitted() -> None:
    verdict = admit(ahead=10_000, slots_per_s=0.0, max_wait_s=0.1)
    assert verdict.admitted and verdict.wait_s is None
    with pytest.raises(ValueError):
        admit(ahead=-1, slots_per_s=1.0, max_wait_s=1.0)


def test_slot_time_is_an_exponential_average() -> None:
    slot = SlotTime(weight=0.5)
    assert slot.mean_ms is None
    slot.ended(100.0)
    assert slot.mean_ms == 100.0
    slot.ended(200.0)
    assert slot.mean_ms == 150.0
    slot.ended(-5.0)  # a clock step backwards counts as 0
    assert slot.mean_ms == 75.0
    with pytest.raises(ValueError):
        SlotTime(weight=0.0)


def test_a_burst_after_a_quiet_spell_is_priced_by_the_running_requests() -> None:
    """Two requests ended in the last 5 s (the demand was low), each after 1 s on its engine; now
    eight run: slots free up at about eight a second, not at the recent finish rate."""
    slots = SlotRate(FinishRate(window_ms=5_000.0))
    slots.ended(0.0, 1_000.0)
    slots.ended(2_500.0, 1_000.0)
    recent = slots.finishes.per_s(5_000.0)
    assert recent < 1.0
    assert slots.per_s(5_000.0, running=8, held=0) == pytest.approx(8.0)
    assert slots.per_s(5_000.0, running=0, held=0) == recent  # nothing runs: the recent rate alone
    assert SlotRate().per_s(0.0, running=8, held=3) == 0.0  # nothing ever ended: not known


def test_once_requests_were_held_a_whole_window_the_finish_rate_alone_counts() -> None:
    """Slot times from a quiet spell (1 s each, small batches) would price 8 running at 8 a second;
    held back for a whole 5 s window, the nodes were full, and they finished 1 a second."""
    slots = SlotRate(FinishRate(window_ms=5_000.0))
    slots.ended(0.0, 1_000.0)
    assert slots.per_s(1_000.0, running=8, held=2) == pytest.approx(8.0)  # held since 1 s
    for t in range(2, 7):
        slots.ended(t * 1_000.0, 8_000.0)  # full-batch requests take 8 s
    assert slots.per_s(6_000.0, running=8, held=5) == pytest.approx(1.0)  # 5 since 1 s: what they freed
    assert slots.per_s(6_500.0, running=8, held=0) > 2.0  # the queue emptied: a new spell starts


def test_a_flooding_tenant_is_refused_while_another_still_gets_in() -> None:
    """At 1 slot a second with 3 s allowed, the flooder's fourth waiting request is refused; the
    quiet tenant, whose turn comes after one of the flooder's, is admitted."""
    queue: HeldQueue[str] = HeldQueue(100, max_wait_s=3.0)
    for n in range(3):
        queue.push(f"flood{n}", NORMAL, "flood", slots_per_s=1.0)
    with pytest.raises(Overloaded) as refused:
        queue.push("flood3", NORMAL, "flood", slots_per_s=1.0)
    assert refused.value.wait_s == 4.0 and refused.value.retry_after_s == 1
    queue.push("quiet0", NORMAL, "quiet", slots_per_s=1.0)  # one ahead: 2 s
    queue.push("high0", HIGH, "flood", slots_per_s=1.0)  # a higher tier waits behind none of them
    queue.push("put-back", NORMAL, "flood", front=True, slots_per_s=1.0)  # admitted before: keeps its place
    queue.push("unknown", NORMAL, "flood", slots_per_s=0.0)  # no rate yet: admitted
    assert queue.take(3) == ["high0", "put-back", "flood0"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from([NORMAL, HIGH])), max_size=30),
    st.sampled_from("abc"),
    st.sampled_from([NORMAL, HIGH]),
    st.floats(0.1, 10.0),
    st.floats(0.1, 10.0),
)
def test_a_newcomer_is_refused_exactly_when_its_place_would_come_too_late(
    pushes: list[tuple[str, Priority]], tenant: str, tier: Priority, slots_per_s: float, max_wait_s: float
) -> None:
    """Refused iff the requests it would leave after (counted by popping) and itself take longer
    than the bound at the given rate; an admitted one waits no more than the bound's worth."""
    queue: HeldQueue[object] = HeldQueue(100, max_wait_s=max_wait_s)
    for who, level in pushes:
        queue.push(object(), level, who)  # no rate: every one admitted
    newcomer = object()
    try:
        queue.push(newcomer, tier, tenant, slots_per_s=slots_per_s)
    except Overloaded as exc:
        ahead = queue.ahead(tier, tenant)
        assert (ahead + 1) / slots_per_s > max_wait_s and exc.wait_s == (ahead + 1) / slots_per_s
        return
    before = 0
    while queue.pop() is not newcomer:
        before += 1
    assert (before + 1) / slots_per_s <= max_wait_s * (1 + 1e-9)


async def test_the_scheduler_answers_an_overloaded_newcomer_503_with_retry_after() -> None:
    metrics = SchedulerMetrics()
    queue = PushQueue(10, max_wait_s=1.0, timeout_s=60.0, metrics=metrics)
    with pytest.raises(ApiError) as refused:
        await queue.wait_for_room(NORMAL, "t", wait_until=math.inf, requeued=False, slots_per_s=0.5)
    error = refused.value
    assert error.status == 503 and error.code == "overloaded" and error.headers == {"retry-after": "1"}
    assert "scheduler.max_queue_wait_s" in error.message
    assert metrics.overloaded.labels(NORMAL)._value.get() == 1.0
    assert metrics.queued._value.get() == 0.0 and len(queue) == 0
    with pytest.raises(ApiError) as late:  # past its deadline: the queue timeout, as before
        await queue.wait_for_room(NORMAL, "t", wait_until=0.0, requeued=True, slots_per_s=0.5)
    assert late.value.status == 503 and late.value.code == "queue_timeout"


def test_a_scheduler_s_requests_beyond_the_engine_s_batch_are_pending_whatever_its_gauge() -> None:
    """The engine's waiting gauge is read once a step; the scheduler's own in-flight count is exact.
    Past the engine's batch, the node has requests waiting (selective pushing holds the next one
    in the scheduler, where admission and the tenants' turns apply)."""
    node = NodeSnapshot("n0", True, running=8, waiting=0, inflight=11, kv_usage=0.1, max_running=8)
    assert node.pending == 3 and rooms([node]) == 0
    assert replace(node, max_running=0).pending == 0 and replace(node, max_running=0).rooms == 1  # the gauge
    assert replace(node, waiting=5).pending == 5
    full = replace(node, inflight=8)
    assert full.pending == 0 and full.rooms == 0  # a full batch: nothing waits, and no room
    assert rooms([replace(node, inflight=5), full]) == 3  # the free places of a known batch


def test_a_hold_not_seen_for_a_window_starts_a_new_span() -> None:
    """Held back at 1 s, then no newcomer waited until 20 s (the queue may have drained): the burst
    at 20 s is not "held a whole window" yet, so the running requests still price it."""
    slots = SlotRate(FinishRate(window_ms=5_000.0))
    slots.ended(0.0, 1_000.0)
    assert slots.per_s(1_000.0, running=8, held=2) == pytest.approx(8.0)
    slots.ended(19_000.0, 1_000.0)
    assert slots.per_s(20_000.0, running=8, held=3) == pytest.approx(8.0)  # not the 1 finish in 5 s
    assert slots.per_s(24_000.0, running=8, held=3) == pytest.approx(8.0)  # held 4 s of 5
    assert slots.per_s(25_500.0, running=8, held=3) == pytest.approx(1000.0 / 5_500.0)  # none since 20 s


def test_a_held_cluster_s_rate_counts_its_whole_hold_not_the_last_burst() -> None:
    """Two engines of 8 whose batches end together every 9 s: 16 finishes at once, then none,
    while newcomers keep waiting (one a second). Over the last 5 s the rate swings between a burst
    and a lull; over the hold it stays near 16 / 9."""
    slots = SlotRate(FinishRate(window_ms=5_000.0))
    slots.ended(0.0, 9_000.0)
    rates, recent = [], []
    for second in range(1, 37):
        now = second * 1_000.0
        if second % 9 == 0:
            for _ in range(16):
                slots.ended(now - 1.0, 9_000.0)
        rates.append(slots.per_s(now, running=16, held=10))
        recent.append(slots.finishes.per_s(now))
    assert max(recent) / min(recent) > 10  # the last 5 s: a burst, then a lull
    held = rates[9:]  # once a burst has ended within the hold
    assert all(0.9 < rate < 2.5 for rate in held) and 1.3 < sum(held) / len(held) < 2.2, held


async def test_one_room_wakes_one_waiter_however_often_it_is_announced() -> None:
    """Every status and every request's end announces the rooms; a waiter woken for one resumes a
    loop turn later. Announcing the same room again meanwhile must not wake a second waiter, who
    would find no room and wait again at the queue's head, ahead of every tenant's newcomers."""
    metrics = SchedulerMetrics()
    queue = PushQueue(10, metrics=metrics)
    waiters = [asyncio.create_task(queue.wait(NORMAL, 60.0, tenant)) for tenant in ("a", "b", "c")]
    await asyncio.sleep(0)  # all three queued
    assert len(queue) == 3
    assert queue.wake_for(1) == 1 and queue.wake_for(1) == 0 and queue.woken == 1  # the same room, twice
    assert await waiters[0] and len(queue) == 2 and queue.woken == 0  # resumed: its wake-up spent
    assert queue.wake_for(2) == 2 and queue.woken == 2
    assert await asyncio.gather(*waiters[1:]) == [True, True] and queue.woken == 0 and len(queue) == 0


def test_a_finish_rate_since_a_moment_counts_only_its_buckets_from_then() -> None:
    rate = FinishRate(window_ms=30_000.0, buckets=30)
    rate.finished(500.0)
    for _ in range(3):
        rate.finished(2_500.0)
    assert rate.per_s(4_000.0) == pytest.approx(4 / 3.5)  # since the first finish
    assert rate.per_s(4_000.0, since_ms=2_000.0) == pytest.approx(3 / 2.0)  # the bucket of 2 s on
    # Since the middle of a bucket: its finishes count, and so does its time (from 2 s, not 2.6 s).
    assert rate.per_s(4_000.0, since_ms=2_600.0) == pytest.approx(3 / 2.0)
    assert rate.per_s(40_000.0, since_ms=2_000.0) == pytest.approx(1 / 29.0)  # none in the window (11-40 s)

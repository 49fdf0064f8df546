"""The held-back queue's order (scheduler.held_queue): tiers first, then tenants taking turns by
weight (start-time fair queueing), FIFO within a tenant, put-back requests at the head; and its
bounds, checked against a plain model of what waits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.held_queue import HeldQueue, QueueFull
from symphony.priority import Priority
from symphony.tenant_quotas import TenantLimits, TenantQuotas

NORMAL, HIGH = Priority("normal"), Priority("high")


def quotas(**by_tenant: TenantLimits) -> TenantQuotas:
    return TenantQuotas(TenantLimits(), by_tenant)


def test_one_tenant_is_fifo_within_a_tier_and_higher_tiers_go_first() -> None:
    queue: HeldQueue[str] = HeldQueue(10)
    for item in ("n1", "n2"):
        queue.push(item, NORMAL)
    queue.push("h1", HIGH)
    queue.push("n0", NORMAL, front=True)  # put back: before the rest of its tier
    assert queue.take(10) == ["h1", "n0", "n1", "n2"]
    assert len(queue) == 0 and queue.pop() is None


def test_a_flooding_tenant_waits_behind_its_own_requests() -> None:
    queue: HeldQueue[str] = HeldQueue(100)
    for n in range(5):
        queue.push(f"a{n}", NORMAL, "a")
    queue.push("b0", NORMAL, "b")
    queue.push("b1", NORMAL, "b")
    # b came after all of a's, and still gets every other turn.
    assert queue.take(7) == ["a0", "b0", "a1", "b1", "a2", "a3", "a4"]


def test_a_newest_request_giving_up_costs_its_tenant_no_turn() -> None:
    queue: HeldQueue[str] = HeldQueue(100)
    queue.push("a0", NORMAL, "a")
    queue.push("a1", NORMAL, "a")
    queue.remove("a1", NORMAL, "a")  # gave up: a's next request takes its turn
    for item in ("b0", "b1", "b2"):
        queue.push(item, NORMAL, "b")
    queue.push("a2", NORMAL, "a")
    assert queue.take(5) == ["a0", "b0", "b1", "a2", "b2"]


def test_weights_share_turns() -> None:
    queue: HeldQueue[str] = HeldQueue(100, quotas(a=TenantLimits(weight=2.0)))
    for n in range(6):
        queue.push(f"a{n}", NORMAL, "a")
        queue.push(f"b{n}", NORMAL, "b")
    first_six = queue.take(6)
    assert sum(x.startswith("a") for x in first_six) == 4


def test_bounds_the_whole_queue_and_each_tenants_share() -> None:
    queue: HeldQueue[str] = HeldQueue(3, quotas(a=TenantLimits(max_queued=2)))
    queue.push("a0", NORMAL, "a")
    queue.push("a1", HIGH, "a")  # the share counts every tier
    with pytest.raises(QueueFull) as full:
        queue.push("a2", NORMAL, "a")
    assert full.value.code == "tenant_queue_full" and "'a'" in str(full.value)
    queue.push("b0", NORMAL, "b")
    with pytest.raises(QueueFull) as full:
        queue.push("c0", NORMAL, "c")
    assert full.value.code == "queue_full"
    queue.push("a3", NORMAL, "a", front=True)  # a request put back always gets its place
    assert len(queue) == 4 and queue.waiting_of("a") == 3
    queue.remove("a0", NORMAL, "a")
    queue.remove("a3", NORMAL, "a")
    queue.remove("nothing", NORMAL, "a")  # gone already: nothing happens
    assert queue.take(10) == ["a1", "b0"]
    assert queue.waiting_of("a") == 0 and queue.waiting(NORMAL) == 0


@settings(max_examples=200, deadline=None)
@given(
    weights=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    backlog=st.integers(1, 30),
    served=st.integers(0, 60),
)
def test_backlogged_tenants_are_served_in_proportion_to_their_weights(
    weights: tuple[int, int], backlog: int, served: int
) -> None:
    """Start-time fair queueing's bound: while both lanes are backlogged, the service each got,
    divided by its weight, differs by at most one turn of each (1/wa + 1/wb)."""
    wa, wb = weights
    queue: HeldQueue[str] = HeldQueue(1000, quotas(a=TenantLimits(weight=wa), b=TenantLimits(weight=wb)))
    for n in range(backlog):
        queue.push(f"a{n}", NORMAL, "a")
        queue.push(f"b{n}", NORMAL, "b")
    got = {"a": 0, "b": 0}
    for _ in range(min(served, backlog)):  # within the first `backlog` pops neither lane runs dry
        item = queue.pop()
        assert item is not None
        got[item[0]] += 1
    assert abs(got["a"] / wa - got["b"] / wb) <= 1 / wa + 1 / wb + 1e-9


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from("abc"), st.sampled_from([NORMAL, HIGH]), st.booleans()),
        st.tuples(st.just("pop")),
        st.tuples(st.just("remove"), st.integers(0, 40)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_every_request_leaves_once_and_counts_match_a_model(ops: list[tuple[object, ...]]) -> None:
    queue: HeldQueue[int] = HeldQueue(8, quotas(a=TenantLimits(max_queued=3)))
    waiting: dict[int, tuple[str, Priority, bool]] = {}  # id -> (tenant, tier, put back)
    order: dict[str, list[int]] = {}  # each tenant's newcomers, in push order
    left: list[int] = []
    for n, op in enumerate(ops):
        if op[0] == "push":
            _, tenant, tier, front = op
            assert isinstance(tenant, str) and isinstance(tier, Priority) and isinstance(front, bool)
            try:
                queue.push(n, tier, tenant, front=front)
            except QueueFull:
                mine = sum(t == tenant for t, _, _ in waiting.values())
                assert not front and (len(waiting) >= 8 or (tenant == "a" and mine >= 3))
                continue
            waiting[n] = (tenant, tier, front)
            if not front:
                order.setdefault(tenant, []).append(n)
        elif op[0] == "pop":
            item = queue.pop()
            if not waiting:
                assert item is None
                continue
            assert item in waiting
            tenant, tier, front = waiting.pop(item)
            assert tier == HIGH or all(t != HIGH for _, t, _ in waiting.values())  # higher tiers first
            if not front:  # put-back requests first, then FIFO within a tenant's lane of a tier
                assert not any(f and t == tier for _, t, f in waiting.values())
                earlier = [m for m in order[tenant] if m < item and m in waiting and waiting[m][1] == tier]
                assert not [m for m in earlier if not waiting[m][2]]
            left.append(item)
        else:
            ids = sorted(waiting)
            if ids:
                item = ids[int(op[1]) % len(ids)]  # type: ignore[call-overload]
                tenant, tier, _ = waiting.pop(item)
                queue.remove(item, tier, tenant)
                left.append(item)
        assert len(queue) == len(waiting)
        for tenant in "abc":
            assert queue.waiting_of(tenant) == sum(t == tenant for t, _, _ in waiting.values())
        for tier in (NORMAL, HIGH):
            assert queue.waiting(tier) == sum(t == tier for _, t, _ in waiting.values())
    assert len(left) == len(set(left))
    rest = queue.take(100)
    assert sorted(rest) == sorted(waiting)


@settings(max_examples=300, deadline=None)
@given(OPS, st.sampled_from("abc"), st.sampled_from([NORMAL, HIGH]))
def test_ahead_counts_the_requests_a_newcomer_leaves_after(
    ops: list[tuple[object, ...]], tenant: str, tier: Priority
) -> None:
    """Whatever the queue went through (weights differ: tags are not plain counts), a newcomer
    pushed now is popped after exactly `ahead` requests."""
    queue: HeldQueue[object] = HeldQueue(100, quotas(a=TenantLimits(weight=2.0), c=TenantLimits(weight=0.5)))
    waiting: list[object] = []
    for n, op in enumerate(ops):
        if op[0] == "push":
            _, who, level, front = op
            assert isinstance(who, str) and isinstance(level, Priority) and isinstance(front, bool)
            entry = (n, who, level)  # one object: the queue removes by identity
            queue.push(entry, level, who, front=front)
            waiting.append(entry)
        elif op[0] == "pop":
            if (item := queue.pop()) is not None:
                waiting.remove(item)
        elif waiting:
            item = waiting.pop(int(op[1]) % len(waiting))  # type: ignore[call-overload]
            queue.remove(item, item[2], item[1])  # type: ignore[index]
    expected = queue.ahead(tier, tenant)
    newcomer = object()
    queue.push(newcomer, tier, tenant)
    before = 0
    while (item := queue.pop()) is not newcomer:
        assert item is not None
        before += 1
    assert before == expected

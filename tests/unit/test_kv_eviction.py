"""node_manager.kv.eviction: pure victim ordering for the KV tiers."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import pytest

from node_manager.kv.eviction import LRUPolicy, PageMeta, PriorityLRUPolicy, TopTierYieldPolicy
from node_manager.kv.pages import Priority


def anything(_: Hashable) -> bool:
    return True


def make_lru() -> LRUPolicy:
    return LRUPolicy()


def make_priority_lru() -> PriorityLRUPolicy:
    return PriorityLRUPolicy()


def make_top_tier() -> TopTierYieldPolicy:
    return TopTierYieldPolicy(lambda session: 1)


POLICIES: list[Callable[[], object]] = [make_lru, make_priority_lru, make_top_tier]
IDS = ["lru", "priority_lru", "top_tier_yield"]


@pytest.fixture(params=POLICIES, ids=IDS)
def policy(request: pytest.FixtureRequest):
    return request.param()


def fill(policy, items: list[int], layer: int = 0) -> None:
    for item in items:
        policy.insert(item, PageMeta(layer=layer, session="s"))


# ---- the contract every policy keeps --------------------------------------------------------------


def test_empty_policy(policy) -> None:
    assert len(policy) == 0
    assert policy.victims(1, anything) is None
    assert policy.victims(0, anything) == []


def test_victims_are_distinct_members(policy) -> None:
    fill(policy, list(range(6)))
    victims = policy.victims(4, anything)
    assert victims is not None
    assert len(victims) == 4
    assert len(set(victims)) == 4
    assert set(victims) <= set(range(6))
    assert sorted(policy.victims(6, anything)) == list(range(6))


def test_victims_is_all_or_nothing_and_changes_nothing(policy) -> None:
    fill(policy, list(range(5)))
    before = policy.victims(5, anything)
    assert policy.victims(6, anything) is None
    assert policy.victims(3, lambda item: item != 2 and item != 4) is not None
    assert policy.victims(4, lambda item: item != 2 and item != 4) is None
    assert len(policy) == 5
    # Asking does not evict: the full order is unchanged after failed and successful queries.
    assert policy.victims(5, anything) == before


def test_evictable_skips_pinned_items(policy) -> None:
    fill(policy, list(range(5)))
    pinned = {0, 3}
    victims = policy.victims(3, lambda item: item not in pinned)
    assert victims is not None
    assert set(victims) == {1, 2, 4}


def test_remove_and_reinsert_bookkeeping(policy) -> None:
    fill(policy, list(range(4)))
    policy.remove(2)
    assert len(policy) == 3
    assert 2 not in policy.victims(3, anything)
    policy.remove(2)  # removing an absent item is a no-op
    policy.remove("never inserted")
    assert len(policy) == 3
    fill(policy, [1])  # re-inserting a member does not duplicate it
    assert len(policy) == 3
    assert sorted(policy.victims(3, anything)) == [0, 1, 3]
    fill(policy, [2])
    assert len(policy) == 4
    for item in range(4):
        policy.remove(item)
    assert len(policy) == 0
    assert policy.victims(1, anything) is None


def test_touch_of_unknown_item_is_harmless(policy) -> None:
    fill(policy, [1, 2])
    policy.touch(99)
    assert len(policy) == 2
    assert sorted(policy.victims(2, anything)) == [1, 2]


def test_tuple_items(policy) -> None:
    items = [(b"k" * 32, layer) for layer in range(3)]
    for layer, item in enumerate(items):
        policy.insert(item, PageMeta(layer=layer, session=("tenant", "s1")))
    assert set(policy.victims(3, anything)) == set(items)
    policy.remove(items[1])
    assert set(policy.victims(2, anything)) == {items[0], items[2]}


# ---- LRU ------------------------------------------------------------------------------------------


def test_lru_evicts_least_recently_inserted_first() -> None:
    lru = LRUPolicy()
    for item in (10, 20, 30, 40):
        lru.insert(item)
    assert lru.victims(2, anything) == [10, 20]


def test_lru_touch_moves_to_most_recent() -> None:
    lru = LRUPolicy()
    for item in (10, 20, 30):
        lru.insert(item)
    lru.touch(10)
    assert lru.victims(3, anything) == [20, 30, 10]
    lru.insert(20)  # re-insert also counts as a use
    assert lru.victims(3, anything) == [30, 10, 20]


def test_lru_skips_pinned_but_keeps_order() -> None:
    lru = LRUPolicy()
    for item in (1, 2, 3, 4):
        lru.insert(item)
    assert lru.victims(2, lambda item: item != 1) == [2, 3]


# ---- priority LRU ---------------------------------------------------------------------------------


def test_priority_lru_equal_age_low_then_normal_then_high() -> None:
    policy = PriorityLRUPolicy()
    # Inserted high first, so by pure recency high would be the first victim.
    policy.insert("high", PageMeta(0, "s", Priority.HIGH))
    policy.insert("normal", PageMeta(0, "s", Priority.NORMAL))
    policy.insert("low", PageMeta(0, "s", Priority.LOW))
    assert policy.victims(3, anything) == ["low", "normal", "high"]
    assert policy.victims(1, anything) == ["low"]


def test_priority_lru_is_lru_within_a_priority() -> None:
    policy = PriorityLRUPolicy()
    for item in ("a", "b", "c"):
        policy.insert(item, PageMeta(0, "s", Priority.NORMAL))
    policy.touch("a")
    assert policy.victims(3, anything) == ["b", "c", "a"]


def test_priority_lru_credit_is_finite_with_default_credits() -> None:
    policy = PriorityLRUPolicy()
    policy.insert("old-high", PageMeta(0, "s", Priority.HIGH))
    policy.insert("low", PageMeta(0, "s", Priority.LOW))
    assert policy.victims(1, anything) == ["low"]  # young: the high page is protected
    for _ in range(40_001):  # age the high page past its credit
        policy.touch("low")
    assert policy.victims(1, anything) == ["old-high"]


def test_priority_lru_custom_credit() -> None:
    policy = PriorityLRUPolicy({Priority.LOW: 0, Priority.NORMAL: 3, Priority.HIGH: 6})
    policy.insert("high", PageMeta(0, "s", Priority.HIGH))  # tick 0 -> 6
    policy.insert("normal", PageMeta(0, "s", Priority.NORMAL))  # tick 1 -> 4
    for index in range(3):
        policy.insert(f"low{index}", PageMeta(0, "s", Priority.LOW))  # ticks 2, 3, 4
    policy.insert("fresh-low", PageMeta(0, "s", Priority.LOW))  # tick 5
    policy.insert("fresher-low", PageMeta(0, "s", Priority.LOW))  # tick 6
    policy.insert("newest-low", PageMeta(0, "s", Priority.LOW))  # tick 7
    order = policy.victims(8, anything)
    assert order is not None
    assert order.index("normal") < order.index("fresh-low")
    assert order.index("high") < order.index("newest-low")
    assert order.index("low0") < order.index("normal") < order.index("high")


def test_priority_lru_reinsert_changes_priority() -> None:
    policy = PriorityLRUPolicy()
    policy.insert("a", PageMeta(0, "s", Priority.LOW))
    policy.insert("b", PageMeta(0, "s", Priority.LOW))
    policy.insert("a", PageMeta(0, "s", Priority.HIGH))
    assert len(policy) == 2
    assert policy.victims(2, anything) == ["b", "a"]


# ---- top-tier yield -------------------------------------------------------------------------------


def test_top_tier_lower_priority_goes_first() -> None:
    policy = TopTierYieldPolicy(lambda session: 1)
    policy.insert("high-l3", PageMeta(3, "s", Priority.HIGH))
    policy.insert("normal-l0", PageMeta(0, "s", Priority.NORMAL))
    policy.insert("low-l0", PageMeta(0, "s", Priority.LOW))
    assert policy.victims(3, anything) == ["low-l0", "normal-l0", "high-l3"]


def test_top_tier_later_layers_first_within_a_priority() -> None:
    policy = TopTierYieldPolicy(lambda session: 1)
    for layer in (0, 2, 1, 3):
        policy.insert(("blk", layer), PageMeta(layer, "s"))
    assert policy.victims(4, anything) == [("blk", 3), ("blk", 2), ("blk", 1), ("blk", 0)]


def test_top_tier_smaller_sessions_first_within_a_layer() -> None:
    sizes = {"big": 10, "small": 1, "medium": 5}
    policy = TopTierYieldPolicy(sizes.__getitem__)
    for session in ("big", "small", "medium"):
        policy.insert(session, PageMeta(0, session))
    assert policy.victims(3, anything) == ["small", "medium", "big"]
    sizes["big"] = 0  # the callback is consulted at query time
    assert policy.victims(3, anything) == ["big", "small", "medium"]


def test_top_tier_full_order() -> None:
    sizes = {"a": 2, "b": 1}
    policy = TopTierYieldPolicy(sizes.__getitem__)
    pages = [
        ("a", 0, Priority.NORMAL),
        ("b", 0, Priority.NORMAL),
        ("a", 1, Priority.NORMAL),
        ("b", 1, Priority.NORMAL),
        ("a", 0, Priority.LOW),
        ("b", 1, Priority.HIGH),
    ]
    for session, layer, priority in pages:
        policy.insert((session, layer, int(priority)), PageMeta(layer, session, priority))
    assert policy.victims(6, anything) == [
        ("a", 0, 0),  # low first
        ("b", 1, 1),
        ("a", 1, 1),  # normal, layer 1, smaller session first
        ("b", 0, 1),
        ("a", 0, 1),  # normal, layer 0
        ("b", 1, 2),  # high last
    ]


def test_top_tier_touch_does_not_reorder() -> None:
    policy = TopTierYieldPolicy(lambda session: 1)
    policy.insert("l0", PageMeta(0, "s"))
    policy.insert("l1", PageMeta(1, "s"))
    policy.touch("l1")
    assert policy.victims(2, anything) == ["l1", "l0"]


def test_top_tier_remove_cleans_empty_buckets() -> None:
    policy = TopTierYieldPolicy(lambda session: 1)
    policy.insert("x", PageMeta(2, "s1"))
    policy.insert("y", PageMeta(2, "s2"))
    policy.remove("x")
    policy.remove("y")
    assert len(policy) == 0
    assert policy._buckets == {}
    policy.insert("x", PageMeta(1, "s1", Priority.LOW))  # reinsert under a different bucket
    policy.insert("x", PageMeta(3, "s1", Priority.HIGH))
    assert len(policy) == 1
    assert policy._buckets == {(Priority.HIGH, 3): {"s1": {"x": None}}}


def test_top_tier_skips_pinned_across_buckets() -> None:
    policy = TopTierYieldPolicy(lambda session: 1)
    for layer in range(3):
        policy.insert(layer, PageMeta(layer, "s"))
    assert policy.victims(2, lambda item: item != 2) == [1, 0]
    assert policy.victims(3, lambda item: item != 2) is None

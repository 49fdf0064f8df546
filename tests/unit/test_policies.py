"""scheduler.policies: every routing policy behind the one interface (pure logic, no I/O)."""

from __future__ import annotations

import collections
import random

import pytest

from scheduler.cost_profile import DEFAULT_PROFILE
from scheduler.policies import POLICIES, make_policy
from scheduler.policies.consistent_hash import ConsistentHashPolicy
from scheduler.policies.least_load import RecomputePolicy, RoundRobinPolicy
from scheduler.policies.prefix_trie import PrefixTriePolicy, PrefixTrieSettings
from scheduler.policies.sticky import StickyPolicy
from scheduler.policies.symphony import SymphonyPolicy
from scheduler.routing import NodeSnapshot, RouteRequest
from symphony.config import ConfigError, SchedulerConfig
from symphony.prefix_tree import PrefixTree


def node(
    node_id: str,
    *,
    available: bool = True,
    running: int = 0,
    waiting: int = 0,
    inflight: int = 0,
    kv_usage: float = 0.0,
    high: int = 0,
    prefilling: int = 0,
) -> NodeSnapshot:
    return NodeSnapshot(node_id, available, running, waiting, inflight, kv_usage, 0, high, prefilling)


def request(
    session: str | None = "s",
    *,
    tenant: str = "t",
    priority: str = "normal",
    history: int = 0,
    kv: dict[str, int] | None = None,
    text: str = "",
) -> RouteRequest:
    return RouteRequest(tenant, session, "m", priority, history, kv or {}, text)


# -- every policy -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_skips_unavailable_nodes_and_answers_none_without_any(name: str) -> None:
    policy = make_policy(name)
    nodes = [node("down", available=False), node("up", running=3)]
    for i in range(20):
        r = request(f"s{i}", text=f"hello {i}")
        decision = policy.choose(r, nodes)
        assert decision.node_id == "up"
        policy.observe(r, "up")
    assert policy.choose(request(), [node("a", available=False)]).node_id is None
    assert policy.choose(request(), []).node_id is None


def test_unknown_policy_is_a_config_error_listing_known_ones() -> None:
    with pytest.raises(ConfigError, match="least_load") as excinfo:
        make_policy("fastest")
    assert "fastest" in str(excinfo.value) and "symphony" in str(excinfo.value)


def test_only_recompute_keeps_requests_off_the_tiers_and_only_symphony_prefetches() -> None:
    assert {name for name in POLICIES if not make_policy(name).traits.uses_tiers} == {"recompute"}
    assert {name for name in POLICIES if make_policy(name).traits.prefetch_on_advisory} == {"symphony"}


# -- round robin, recompute -------------------------------------------------------------------------
def test_round_robin_cycles_through_available_nodes() -> None:
    policy = RoundRobinPolicy()
    nodes = [node("a", running=9), node("b"), node("c", available=False)]
    assert [policy.choose(request(), nodes).node_id for _ in range(4)] == ["a", "b", "a", "b"]


def test_recompute_balances_by_load_like_least_load() -> None:
    assert RecomputePolicy().choose(request(), [node("a", running=2), node("b", running=1)]).node_id == "b"


def test_policy_tables_take_their_bounds_from_the_config() -> None:
    config = SchedulerConfig(max_sessions=3, prefix_trie_max_chars=500)
    sticky = make_policy("sticky", config)
    assert isinstance(sticky, StickyPolicy) and sticky.max_sessions == 3
    trie = make_policy("prefix_trie", config)
    assert isinstance(trie, PrefixTriePolicy) and trie.tree.max_chars == 500


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_builds_itself_from_the_config(name: str) -> None:
    policy = POLICIES[name].from_config(SchedulerConfig(), DEFAULT_PROFILE)
    assert policy.name == name and type(policy) is POLICIES[name]
    assert type(make_policy(name)) is POLICIES[name]


# -- consistent hashing ------------------------------------------------------------------------------
def test_consistent_hash_keeps_a_session_on_one_node_and_spreads_sessions() -> None:
    policy = ConsistentHashPolicy()
    nodes = [node(f"n{i}") for i in range(4)]
    picks = {f"s{i}": policy.choose(request(f"s{i}"), nodes).node_id for i in range(2000)}
    assert all(policy.choose(request(s), nodes).node_id == n for s, n in list(picks.items())[:50])
    shares = collections.Counter(picks.values())
    assert set(shares) == {"n0", "n1", "n2", "n3"} and min(shares.values()) > 350  # within ~30% of 500


def test_consistent_hash_moves_only_the_down_nodes_sessions() -> None:
    policy = ConsistentHashPolicy()
    nodes = [node(f"n{i}") for i in range(4)]
    before = {f"s{i}": policy.choose(request(f"s{i}"), nodes).node_id for i in range(1000)}
    nodes[2] = node("n2", available=False)
    after = {s: policy.choose(request(s), nodes).node_id for s in before}
    moved = {s for s in before if before[s] != after[s]}
    assert moved == {s for s, n in before.items() if n == "n2"}
    assert "n2" not in after.values()


def test_consistent_hash_without_a_session_keys_on_the_prompts_start() -> None:
    policy = ConsistentHashPolicy()
    nodes = [node(f"n{i}") for i in range(4)]
    conversations = [f"user: question {i} " + "x" * 300 for i in range(400)]
    first = [policy.choose(request(None, text=c), nodes).node_id for c in conversations]
    # A later turn (the same start, more text) meets its first turn; different prompts spread.
    assert [policy.choose(request(None, text=c + "\nassistant: answer"), nodes).node_id for c in conversations] == first
    assert len(set(first)) == 4
    # Tenants hash apart: the same prompt from another tenant is another key.
    other = [policy.choose(request(None, tenant="u", text=c), nodes).node_id for c in conversations]
    assert other != first


# -- sticky -----------------------------------------------------------------------------------------
def test_sticky_pins_a_session_after_its_first_turn_whatever_the_load() -> None:
    policy = StickyPolicy()
    first = policy.choose(request("s"), [node("a", running=1), node("b")])
    assert (first.node_id, first.reason) == ("b", "sticky_first_turn")
    policy.observe(request("s"), "b")
    assert policy.choose(request("s"), [node("a"), node("b", running=50)]).node_id == "b"
    # Pinned node down: the session moves to the least-loaded node and stays there.
    moved = policy.choose(request("s"), [node("a", running=2), node("b", available=False), node("c")])
    assert moved.node_id == "c"


def test_sticky_pins_per_tenant_and_is_bounded() -> None:
    policy = StickyPolicy(max_sessions=2)
    policy.observe(request("s", tenant="t1"), "a")
    assert policy.choose(request("s", tenant="t2"), [node("a", running=5), node("b")]).node_id == "b"
    policy.observe(request("x"), "a")
    policy.observe(request("y"), "a")
    assert len(policy._pinned) == 2 and ("t1", "s") not in policy._pinned


# -- prefix trie ------------------------------------------------------------------------------------
def test_prefix_trie_sends_a_shared_prefix_where_it_went_before() -> None:
    policy = PrefixTriePolicy()
    nodes = [node("a"), node("b")]
    system = "You are a helpful assistant. " * 20
    first = request("s1", text=system + "What is 2+2?")
    chosen = policy.choose(first, nodes).node_id
    policy.observe(first, chosen)
    other = "b" if chosen == "a" else "a"
    again = policy.choose(request("s2", text=system + "Name a color."), [node(chosen, running=3), node(other)])
    assert (again.node_id, again.reason) == (chosen, "prefix_trie_hit")


def test_prefix_trie_shares_prefixes_within_a_tenant_only() -> None:
    policy = PrefixTriePolicy()
    text = "shared system prompt " * 30
    policy.observe(request("s1", tenant="acme", text=text), "a")
    decision = policy.choose(request("s2", tenant="rival", text=text), [node("a"), node("b")])
    assert decision.reason == "prefix_trie_smallest" and decision.node_id == "b"


def test_prefix_trie_falls_back_to_least_load_when_load_is_uneven() -> None:
    policy = PrefixTriePolicy(PrefixTrieSettings(balance_abs=4, balance_rel=1.5))
    text = "prompt " * 50
    policy.observe(request(text=text), "a")
    decision = policy.choose(request(text=text), [node("a", running=20), node("b", running=2)])
    assert (decision.node_id, decision.reason) == ("b", "prefix_trie_balance")


def test_prefix_tree_matches_splits_and_stays_within_its_bound() -> None:
    tree = PrefixTree(max_chars=200)
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")
    assert tree.match("hello world!") == (11, {"a": 11, "b": 6})
    assert tree.match("help") == (3, {"a": 3, "b": 3})
    assert tree.sizes == {"a": 11, "b": 11} and tree.chars == 16  # "hello " shared, "world", "there"
    rng = random.Random(1)
    for i in range(200):
        tree.insert("".join(rng.choice("abcdef") for _ in range(30)), f"n{i % 3}")
        assert tree.chars <= 200
    recent = "".join(rng.choice("abcdef") for _ in range(30))
    tree.insert(recent, "n0")
    assert tree.match(recent)[0] == 30, "the most recent path survives eviction"
    assert sum(tree.sizes.values()) >= tree.chars


def test_prefix_tree_leaf_heap_stays_bounded_under_its_char_bound() -> None:
    # Revisiting leaves (the same conversations again) while the tree stays under max_chars must not
    # grow the eviction heap without bound.
    tree = PrefixTree(max_chars=1_000_000)
    for i in range(20_000):
        tree.insert(f"conversation {i % 50} " + "x" * 20, "a")
    assert tree.chars < 2_000 and len(tree._leaves) <= 2 * 50 + 1024


def test_prefix_tree_forgets_a_node() -> None:
    tree = PrefixTree(max_chars=1000)
    tree.insert("abcdef", "a")
    tree.insert("abcxyz", "b")
    tree.forget("a")
    assert tree.match("abcdef") == (6, {"b": 3}) and "a" not in tree.sizes


# -- symphony ---------------------------------------------------------------------------------------
# Hand-computed estimates: tests/unit/test_symphony_costs.py. These check behaviour under the defaults.
def test_symphony_balances_per_request_not_per_session() -> None:
    policy = SymphonyPolicy()
    # The session's KV is on a, but two prefills run there that the new one would wait behind; moving
    # 2,048 tokens of KV to b (~30 ms at the default link) costs less.
    busy_a = [node("a", running=2, prefilling=2), node("b")]
    decision = policy.choose(request(history=2048, kv={"a": 2048}), busy_a)
    assert (decision.node_id, decision.reason) == ("b", "symphony")
    moved = policy.estimate(request(history=2048, kv={"a": 2048}), node("b"))
    assert 0 < moved.fetch_ms < DEFAULT_PROFILE.prefill_ms(2047, 2047) / 10


def test_symphony_keeps_a_session_where_its_kv_is_when_load_is_even() -> None:
    decision = SymphonyPolicy().choose(request(history=2048, kv={"b": 2048}), [node("a"), node("b")])
    assert (decision.node_id, decision.reason) == ("b", "symphony_local_kv")


def test_symphony_moves_a_request_off_a_node_busy_with_a_prefill_when_its_kv_moves_cheaply() -> None:
    policy = SymphonyPolicy()
    # Same number of requests on each node, but one on a is still in its prefill: a new request's
    # prefill would start behind it, and moving 1,000 tokens of KV to b costs less.
    busy = [node("a", running=2, prefilling=1), node("b", running=2)]
    assert policy.choose(request(history=1000, kv={"a": 1000}), busy).node_id == "b"
    # A history that costs more to move than the prefill's wait stays.
    assert policy.choose(request(history=40_000, kv={"a": 40_000}), busy).node_id == "a"
    # Both nodes prefilling: the KV's node.
    both = [node("a", running=2, prefilling=1), node("b", running=2, prefilling=1)]
    assert policy.choose(request(history=1000, kv={"a": 1000}), both).node_id == "a"


def test_symphony_queues_when_every_node_has_requests_waiting() -> None:
    policy = SymphonyPolicy()
    decision = policy.choose(request(), [node("a", running=4, waiting=1), node("b", running=4, waiting=2)])
    assert decision.queue and decision.node_id is None
    assert policy.choose(request(), [node("a", waiting=1), node("b", running=8)]).node_id == "b"
    assert (
        SymphonyPolicy(selective_push=False).choose(request(), [node("a", waiting=1), node("b", waiting=2)]).node_id
        == "a"
    )


def test_symphony_spreads_high_priority_sessions() -> None:
    policy = SymphonyPolicy()
    nodes = [node("a", high=3), node("b", running=1)]
    assert policy.choose(request(priority="high"), nodes).node_id == "b"
    assert policy.choose(request(priority="normal"), nodes).node_id == "a"


def test_symphony_prefers_the_emptier_cache_between_equal_costs() -> None:
    decision = SymphonyPolicy().choose(request(), [node("a", kv_usage=0.7), node("b", kv_usage=0.2)])
    assert decision.node_id == "b"

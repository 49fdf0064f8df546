"""scheduler.routing's NodeSnapshot.load, the least-load policy and where KV is pulled from."""

from __future__ import annotations

import itertools

from scheduler.policies import make_policy
from scheduler.policies.least_load import LeastLoadPolicy
from scheduler.routing import MoveSources, NodeSnapshot, RouteRequest, advisory_holds, kv_source, move_sources

REQUEST = RouteRequest(tenant="t", session_id=None, model="m")


def node(
    node_id: str,
    *,
    available: bool = True,
    running: int = 0,
    waiting: int = 0,
    inflight: int = 0,
    kv_usage: float = 0.0,
    announced: int = 0,
    prefilling: int = 0,
) -> NodeSnapshot:
    return NodeSnapshot(node_id, available, running, waiting, inflight, kv_usage, announced, prefilling=prefilling)


# -- NodeSnapshot.load ------------------------------------------------------------------------------
def test_load_is_running_plus_waiting_when_engine_reports_more_than_inflight() -> None:
    assert node("a", running=2, waiting=3, inflight=1).load == 5


def test_load_is_inflight_when_scheduler_count_exceeds_engine_gauges() -> None:
    assert node("a", running=1, waiting=1, inflight=7).load == 7


def test_load_takes_the_max_not_the_sum_of_engine_and_inflight() -> None:
    assert node("a", running=3, waiting=0, inflight=3).load == 3


def test_load_adds_announced_requests() -> None:
    assert node("a", running=1, waiting=1, inflight=0, announced=4).load == 6
    assert node("a", inflight=5, announced=2).load == 7


# -- choice by load ---------------------------------------------------------------------------------
def choose(nodes: list[NodeSnapshot], policy: LeastLoadPolicy | None = None) -> str | None:
    return (policy or LeastLoadPolicy()).choose(REQUEST, nodes).node_id


def test_running_requests_count_as_load() -> None:
    assert choose([node("a", running=3), node("b", running=1)]) == "b"


def test_waiting_requests_count_as_load() -> None:
    assert choose([node("a", waiting=2), node("b", waiting=1)]) == "b"


def test_inflight_counts_when_engine_gauges_lag() -> None:
    assert choose([node("a", inflight=5), node("b", running=2)]) == "b"


def test_inflight_and_engine_gauges_are_not_double_counted() -> None:
    # a: max(2, 2) = 2; b: max(0, 3) = 3. Summing would make a 4 and pick b.
    assert choose([node("a", running=2, inflight=2), node("b", inflight=3)]) == "a"


def test_announced_requests_count_as_load() -> None:
    assert choose([node("a", announced=2), node("b", running=1)]) == "b"


def test_least_loaded_among_many_is_chosen_regardless_of_order() -> None:
    nodes = [node("a", running=4), node("b", running=2, waiting=1), node("c", inflight=1), node("d", waiting=6)]
    assert choose(nodes) == "c"
    assert choose(list(reversed(nodes))) == "c"


# -- availability -----------------------------------------------------------------------------------
def test_unavailable_node_is_never_chosen_even_when_idle() -> None:
    policy = LeastLoadPolicy()
    nodes = [node("down", available=False), node("busy", running=10)]
    assert {policy.choose(REQUEST, nodes).node_id for _ in range(5)} == {"busy"}


def test_no_available_node_gives_no_decision() -> None:
    decision = LeastLoadPolicy().choose(REQUEST, [node("a", available=False), node("b", available=False)])
    assert decision.node_id is None
    assert decision.scores == {}


def test_empty_node_list_gives_no_decision() -> None:
    assert LeastLoadPolicy().choose(REQUEST, []).node_id is None


def test_scores_list_only_available_nodes_with_their_load() -> None:
    decision = LeastLoadPolicy().choose(
        REQUEST, [node("a", running=2, announced=1), node("b", available=False), node("c", inflight=4)]
    )
    assert decision.scores == {"a": 3.0, "c": 4.0}
    assert decision.node_id == "a"


# -- tie-breaks -------------------------------------------------------------------------------------
def test_equal_load_is_broken_by_lower_kv_usage() -> None:
    policy = LeastLoadPolicy()
    nodes = [node("a", running=1, kv_usage=0.5), node("b", running=1, kv_usage=0.2)]
    assert [policy.choose(REQUEST, nodes).node_id for _ in range(4)] == ["b"] * 4


def test_kv_usage_does_not_override_lower_load() -> None:
    assert choose([node("a", running=1, kv_usage=0.0), node("b", running=0, kv_usage=0.9)]) == "b"


def test_idle_nodes_are_picked_in_rotation() -> None:
    policy = LeastLoadPolicy()
    nodes = [node("a"), node("b")]
    picks = [policy.choose(REQUEST, nodes).node_id for _ in range(6)]
    assert set(picks) == {"a", "b"}
    assert all(first != second for first, second in itertools.pairwise(picks))


def test_rotation_covers_every_tied_node() -> None:
    policy = LeastLoadPolicy()
    nodes = [node("a"), node("b"), node("c"), node("busy", running=1)]
    assert {policy.choose(REQUEST, nodes).node_id for _ in range(3)} == {"a", "b", "c"}


def test_nan_kv_usage_does_not_crash_the_policy() -> None:
    # An unknown reading counts as a full cache, so the node with a real, lower reading wins.
    decision = LeastLoadPolicy().choose(REQUEST, [node("a", kv_usage=float("nan")), node("b", kv_usage=0.1)])
    assert decision.node_id == "b"


# -- registry ---------------------------------------------------------------------------------------
def test_make_policy_builds_least_load() -> None:
    policy = make_policy("least_load")
    assert isinstance(policy, LeastLoadPolicy)
    assert policy.name == "least_load"


def test_make_policy_returns_independent_instances() -> None:
    first, second = make_policy("least_load"), make_policy("least_load")
    nodes = [node("a"), node("b")]
    assert first.choose(REQUEST, nodes).node_id == second.choose(REQUEST, nodes).node_id


# -- kv_source ----------------------------------------------------------------------------------------
def test_kv_is_pulled_from_the_reachable_node_holding_the_most_beyond_a_margin() -> None:
    held = {"a": 100, "b": 900, "c": 500}
    assert kv_source(held, "a") == ("b", 900)
    assert kv_source(held, "a", reachable=lambda n: n != "b") == ("c", 500)
    assert kv_source(held, "b") is None  # nobody holds more than b
    assert kv_source(held, "c", at_least=401) is None and kv_source(held, "c", at_least=400) == ("b", 900)
    assert kv_source({}, "a") is None


# -- move_sources -----------------------------------------------------------------------------------
def test_a_far_copy_moves_only_past_the_whole_blocks_a_node_here_holds() -> None:
    """Blocks of 32 tokens. "far" (another region) holds 2,000 tokens of the session; here "b"
    holds 1,500 and "c" 600, the target "a" 100."""
    here, far = {"a": 100, "b": 1500, "c": 600}, ("far", 2000)
    # b's 46 whole blocks come over the region's network first; the far link carries the rest.
    assert move_sources(here, "a", far, 32) == MoveSources(far, "b", 46)
    assert move_sources(here, "a", far, 32).source is far  # the remote, as given (callers compare)
    # b out of reach: c's 18 blocks instead.
    assert move_sources(here, "a", far, 32, reachable=lambda n: n != "b") == MoveSources(far, "c", 18)
    # Nothing here beyond a's own whole blocks: all from far (a's 3 blocks; b's 95 tokens are 2).
    assert move_sources({"a": 100, "b": 95}, "a", far, 32) == MoveSources(far)
    assert move_sources({"a": 100}, "a", far, 32) == MoveSources(far)


def test_a_copy_here_as_long_as_the_far_one_is_pulled_from_here() -> None:
    assert move_sources({"a": 0, "b": 2000}, "a", ("far", 2000), 32) == MoveSources(("b", 2000))
    assert move_sources({"a": 2000}, "a", ("far", 2000), 32) == MoveSources(None)
    assert move_sources({"a": 10, "b": 700}, "a", None, 32) == MoveSources(("b", 700))


# -- advisory_holds ---------------------------------------------------------------------------------
def test_an_advisory_holds_while_its_node_is_free_to_start_the_request_and_no_busier() -> None:
    assert advisory_holds("a", [node("a", running=2), node("b", running=2)])
    assert advisory_holds("a", [node("a", running=1), node("b", running=3), node("c", available=False)])


def test_an_advisory_gives_way_to_a_queue_a_prefill_a_less_loaded_node_or_an_outage() -> None:
    assert not advisory_holds("a", [node("a", running=1, waiting=1), node("b", running=4)])
    assert not advisory_holds("a", [node("a", running=1, inflight=1, prefilling=1), node("b", running=3)])
    assert not advisory_holds("a", [node("a", running=2), node("b", running=1)])
    assert not advisory_holds("a", [node("a", available=False), node("b", running=5)])
    assert not advisory_holds("gone", [node("a"), node("b")])

"""The `symphony` policy's estimated time to first token, computed by hand from a profile of round
numbers: tiers, queues, links, move against recompute."""

from __future__ import annotations

import pytest

from scheduler.cost_profile import CostProfile, LinkCost, NodeLink, TierLoadCosts
from scheduler.policies.symphony import NEARLY_FULL_KV, CostModel, SymphonyPolicy, TtftEstimate
from scheduler.routing import HeldPrefix, NodeSnapshot, PrefillWork, RouteRequest, hints_as_held, prefill_work

# Prefill: 1 ms a token + 0.5 ms a token per 1,000 tokens of position. A step: 10 ms + 2 ms per request
# decoding + 1 ms per 1,000 tokens of their context. 1 MB of KV a token; loads of 0.01 (HBM), 0.05
# (DRAM), 0.5 (SSD) ms a token; links move 1 ms a token after a 5 ms round trip, but "far" -> "x"
# 10 ms a token after 20 ms.
PROFILE = CostProfile(
    request_overhead_ms=50.0,
    step_ms=10.0,
    prefill_ms_per_token=1.0,
    prefill_ms_per_token_kilotoken=0.5,
    decode_ms_per_seq=2.0,
    decode_ms_per_kilotoken=1.0,
    engine_kv_tokens=10_000,
    kv_bytes_per_token=1_000_000,
    tier_load_ms_per_token=TierLoadCosts(engine=0.0, hbm=0.01, dram=0.05, ssd=0.5),
    default_link=LinkCost(rtt_ms=5.0, bandwidth_gbps=1.0),
    links=(NodeLink("far", "x", rtt_ms=20.0, bandwidth_gbps=0.1),),
)


def node(node_id: str, **state: object) -> NodeSnapshot:
    fields: dict[str, object] = {"available": True, "running": 0, "waiting": 0, "inflight": 0, "kv_usage": 0.0}
    fields.update(state)
    return NodeSnapshot(node_id, **fields)  # type: ignore[arg-type]


def request(prompt: int, held: dict[str, HeldPrefix], priority: str = "normal", own: bool = True) -> RouteRequest:
    """`own`: the holders' copies are the session's own (the session table says so), so a pull can
    move them; else another session's (found by the index), which stay where they are."""
    copies = {n: h.total for n, h in held.items()} if own else {}
    return RouteRequest("t", "s", "m", priority, history_tokens=prompt, kv_tokens=copies, held=held)  # type: ignore[arg-type]


def estimate(req: RouteRequest, snapshot: NodeSnapshot) -> TtftEstimate:
    return SymphonyPolicy(PROFILE).estimate(req, snapshot)


def test_kv_on_ssd_is_priced_by_its_load_and_still_beats_recomputing_on_a_node_with_a_short_queue() -> None:
    """2,000-token prompt; a holds 1,900 tokens on SSD and is idle, b holds nothing and decodes one
    request.
    a: 50 overhead + 10 (one step, nothing under way) + 1,900 x 0.5 (SSD load) + the last 100 tokens'
       prefill, 100 x 1 + 0.5 x 100 x 1,950 / 1000 = 197.5: 1,207.5.
    b: 50 + (10 + 2) x 1.5 (half the step under way, then its own) = 68, plus either recomputing
       all 2,000 tokens (2,000 + 0.5 x 2,000 x 1,000 / 1000 = 3,000) or fetching a's 1,900 (moving:
       950 SSD read + 5 + 1,900 link + 95 DRAM load = 2,950; recomputing them: 2,802.5, cheaper) and
       prefilling the rest (197.5): 3,000 either way: 3,068.
    Scored with the delay each node's prefill puts on the requests after it (weight 1): a 1,207.5 +
    197.5 = 1,405, b 3,068 + 3,000 = 6,068."""
    req = request(2000, {"a": HeldPrefix(ssd=1900)})
    a, b = node("a"), node("b", running=1)
    assert estimate(req, a) == TtftEstimate(50.0, 10.0, 950.0, 0.0, 197.5, delay_ms=197.5)
    assert estimate(req, b) == TtftEstimate(50.0, 18.0, 0.0, 0.0, 3000.0, delay_ms=3000.0)
    assert (estimate(req, a).total_ms, estimate(req, b).total_ms) == (1207.5, 3068.0)
    decision = SymphonyPolicy(PROFILE).choose(req, [a, b])
    assert (decision.node_id, decision.reason) == ("a", "symphony_local_kv")
    assert decision.scores == {"a": 1405.0, "b": 6068.0}
    # The tier is what the load costs: the same prefix in DRAM loads for 1,900 x 0.05 = 95.
    assert estimate(request(2000, {"a": HeldPrefix(dram=1900)}), a).load_ms == pytest.approx(95.0)


def test_a_queue_outweighs_the_best_prefix() -> None:
    """a holds 1,900 of 2,000 tokens in its engine's cache, but two prefills run there: 3,000 tokens
    at positions summing to 4.5M, 3,000 x 1 + 0.5 x 4,500 = 5,250 ms ahead, after half a 10 ms step:
    a = 50 + 5 + 10 + 5,250 + 197.5 = 5,512.5. b, idle, pulls a's 1,900 tokens (95 read from a's
    store + 1,905 over the link + 95 loaded) = 2,095, less than recomputing them (2,802.5): b = 50 +
    10 + 2,095 + 197.5 = 2,352.5. Without the prefills, a (257.5) keeps it. Either computes the last
    100 tokens alone (the move is no prefill): the same delay, 197.5, on both."""
    req = request(2000, {"a": HeldPrefix(engine=1900)})
    busy_a = node("a", running=2, prefilling=2, prefilling_work=PrefillWork(3000, 4_500_000.0))
    assert estimate(req, busy_a) == TtftEstimate(50.0, 5265.0, 0.0, 0.0, 197.5, delay_ms=197.5)
    assert estimate(req, node("b")) == TtftEstimate(50.0, 10.0, 0.0, 2095.0, 197.5, delay_ms=197.5)
    assert SymphonyPolicy(PROFILE).choose(req, [busy_a, node("b")]).node_id == "b"
    assert SymphonyPolicy(PROFILE).choose(req, [node("a"), node("b")]).node_id == "a"


def test_over_a_slow_link_recomputing_wins_and_over_a_fast_one_the_move_does() -> None:
    """1,000-token prompt; "far" (down) holds 900 in DRAM. x pulls over a slow link: 45 read + 20 +
    9,000 + 45 loaded = 9,110 against 900 + 0.5 x 900 x 450 / 1000 = 1,102.5 to recompute them, then
    147.5 for the last 100: x computes all 1,000 (1,250). y's default link moves them for 45 + 5 + 900
    + 45 = 995: y = 50 + 10 + 995 + 147.5 = 1,202.5, ahead of x's 1,310. With the delays of what each
    computes, 1,250 and 147.5: x 2,560, y 1,350."""
    req = request(1000, {"far": HeldPrefix(dram=900)})
    assert estimate(req, node("x")) == TtftEstimate(50.0, 10.0, 0.0, 0.0, 1250.0, delay_ms=1250.0)
    assert estimate(req, node("y")) == TtftEstimate(50.0, 10.0, 0.0, 995.0, 147.5, delay_ms=147.5)
    decision = SymphonyPolicy(PROFILE).choose(req, [node("far", available=False), node("x"), node("y")])
    assert decision.node_id == "y" and decision.scores == {"x": 2560.0, "y": 1350.0}


def test_the_cheapest_source_is_taken_and_its_tiers_are_read_in_order() -> None:
    """x holds the first 200 tokens; "far" holds 900, 300 in its engine and 600 on SSD, over x's slow
    link; y holds 600 in DRAM over the default link. Fetching far's 700 beyond x's 200 (positions
    200-900: 100 engine, read as DRAM, and 600 SSD): 5 + 300 + 20 + 7,000 + 35 = 7,360, or 700 +
    0.5 x 700 x 550 / 1000 = 892.5 recomputed, then 147.5: 1,040. y's 400 beyond 200: 20 + 5 + 400 +
    20 = 445, then positions 600-1000 recomputed, 400 + 0.5 x 400 x 800 / 1000 = 560: 1,005, the cheapest."""
    req = request(1000, {"x": HeldPrefix(hbm=200), "far": HeldPrefix(engine=300, ssd=600), "y": HeldPrefix(dram=600)})
    got = estimate(req, node("x"))
    assert got == TtftEstimate(50.0, 10.0, 2.0, 445.0, 560.0, delay_ms=560.0)


def test_the_queue_counts_the_step_under_way_decoding_and_unknown_prefills() -> None:
    """Three running requests, half of a 10,000-token KV cache in use: a step costs 10 + 3 x 2 + 5 =
    21, and the request waits half of one under way: 31.5. An announced request decodes beside it
    too: 10 + 8 + 5 = 23, so 34.5. Two prefills of unknown size ahead (one engine-queued beyond the
    scheduler's one stream, which came without a size) cost 256 + 0.5 x 256 x 128 / 1000 = 272.384
    each."""
    policy = SymphonyPolicy(PROFILE)
    assert policy.queue_ms(node("a", running=3, kv_usage=0.5)) == pytest.approx(31.5)
    assert policy.queue_ms(node("a", running=3, kv_usage=0.5, announced=1)) == pytest.approx(34.5)
    unknown = node("a", running=1, waiting=2, prefilling=1)  # 3 requests, 2 ahead, 1 decoding
    assert policy.queue_ms(unknown) == pytest.approx(1.5 * (10 + 2) + 2 * 272.384)
    assert policy.queue_ms(node("a", inflight=2)) == pytest.approx(1.5 * (10 + 2 * 2))  # sent, not yet reported


def test_the_decoding_context_is_a_fraction_of_the_nodes_own_kv_cache() -> None:
    """Half used of a node's own 40,000-token cache is 20,000 tokens of context: a step of 10 + 3 x 2
    + 20 = 36, waited 1.5 times, 54; the profile's 10,000 tokens stand in only where the node does not
    say (0). A node with a smaller cache than the profile's is not priced as busier than it is, and
    one with a larger cache not as idler."""
    policy = SymphonyPolicy(PROFILE)
    assert policy.queue_ms(node("a", running=3, kv_usage=0.5, kv_tokens=40_000)) == pytest.approx(54.0)
    assert policy.queue_ms(node("a", running=3, kv_usage=0.5, kv_tokens=0)) == pytest.approx(31.5)
    # Equal usage, equal requests: the node whose cache is smaller holds less context, and is chosen.
    small, large = (
        node("small", running=3, kv_usage=0.5, kv_tokens=2_000),
        node("large", running=3, kv_usage=0.5, kv_tokens=40_000),
    )
    assert policy.choose(request(100, {}), [large, small]).node_id == "small"


def test_a_request_expected_later_waits_only_for_what_is_left_of_the_work_ahead() -> None:
    """One request decoding and one prefill of unknown size ahead (272.384 ms): now, 1.5 x (10 + 2)
    + 272.384. Expected 100 ms later, 100 ms of the half step under way and the prefill are over,
    and the prefilled request decodes beside it: a step of 10 + 2 x 2 = 14, plus 7 + 272.384 - 100.
    Expected after all of it, only its own step is left; the decoding requests still count."""
    policy = SymphonyPolicy(PROFILE)
    busy = node("a", running=2, inflight=2, prefilling=1)
    assert policy.queue_ms(busy) == pytest.approx(1.5 * 12 + 272.384)
    assert policy.queue_ms(busy, lead_ms=100) == pytest.approx(14 + 7 + 272.384 - 100)
    assert policy.queue_ms(busy, lead_ms=10_000) == pytest.approx(14)
    # The estimate and the choice take the lead from the request.
    later = RouteRequest("t", "s", "m", history_tokens=100, lead_ms=10_000)
    assert estimate(later, busy).queue_ms == pytest.approx(14)
    # Session s holds 100 tokens on a, in prefill behind another request; b would recompute them
    # (102.5 ms, counted twice with the delay it puts on others: cheaper than moving them, 115 ms).
    # Here now, the request goes to b (21 + 205 < 290.384); expected after a's prefill, it stays.
    held = {"a": HeldPrefix(engine=100)}
    nodes = [busy, node("b", running=2, inflight=2)]
    assert SymphonyPolicy(PROFILE).choose(request(200, held), nodes).node_id == "b"
    expected = RouteRequest("t", "s", "m", history_tokens=200, kv_tokens={"a": 100}, held=held, lead_ms=10_000)
    assert SymphonyPolicy(PROFILE).choose(expected, nodes).node_id == "a"


def test_high_priority_sessions_spread_by_half_a_request_each() -> None:
    req = request(100, {}, priority="high")
    got = estimate(req, node("a", high_sessions=2))
    assert got.spread_ms == pytest.approx(2 * 0.5 * 272.384)
    assert estimate(request(100, {}), node("a", high_sessions=2)).spread_ms == 0.0


def test_the_session_tables_hints_stand_in_as_dram() -> None:
    hinted = RouteRequest("t", "s", "m", history_tokens=2000, kv_tokens={"a": 1900, "b": 0})
    assert hinted.holdings() == hints_as_held({"a": 1900}) == {"a": HeldPrefix(dram=1900)}
    assert estimate(hinted, node("a")).load_ms == pytest.approx(1900 * 0.05)
    # The KV index's answer, when there is one, wins over the hints.
    indexed = RouteRequest("t", "s", "m", history_tokens=2000, kv_tokens={"a": 1900}, held={"a": HeldPrefix(ssd=10)})
    assert indexed.holdings() == {"a": HeldPrefix(ssd=10)}


def test_an_advisorys_prompt_is_at_least_its_history() -> None:
    """An advisory carries no prompt (0 tokens): the history a node holds stands for it, so that
    prefix is loaded, not capped to nothing."""
    req = RouteRequest("t", "s", "m", kv_tokens={"a": 500})
    got = estimate(req, node("a"))
    assert got.load_ms == pytest.approx(500 * 0.05) and got.prefill_ms == pytest.approx(1 + 0.5 * 500.5 / 1000)


def test_held_prefixes_split_by_position_in_tier_order() -> None:
    held = HeldPrefix(engine=100, hbm=50, dram=200, ssd=150)
    assert held.total == 500
    assert held.between(0, 500) == held
    assert held.between(120, 400) == HeldPrefix(engine=0, hbm=30, dram=200, ssd=50)
    assert held.between(450, 600) == HeldPrefix(ssd=50)
    assert held.between(300, 300) == HeldPrefix()


def test_a_prefills_work_is_what_the_node_lacks_or_what_no_node_holds_after_a_pull() -> None:
    req = RouteRequest("t", "s", "m", history_tokens=1000, kv_tokens={"a": 400, "b": 900})
    # a computes 600 at mean position 700; after pulling b's copy, 100 at mean position 950.
    assert prefill_work(req, "a", pulls=False) == PrefillWork(600, 600 * 700)
    assert prefill_work(req, "a", pulls=True) == PrefillWork(100, 100 * 950)
    # Never less than the last token, which the engine always computes.
    assert prefill_work(RouteRequest("t", "s", "m", history_tokens=900, kv_tokens={"a": 900}), "a", False).tokens == 1
    assert PrefillWork(3, 4.0) + PrefillWork(1, 1.0) - PrefillWork(3, 4.0) == PrefillWork(1, 1.0)


def test_the_scores_a_decision_carries_are_the_estimates() -> None:
    """choose prices nodes that hold nothing once per set of links; the totals stay estimate's."""
    policy = SymphonyPolicy(PROFILE)
    req = request(1500, {"far": HeldPrefix(dram=900), "x": HeldPrefix(engine=100)}, priority="high")
    nodes = [
        node("far", running=2, prefilling=1, prefilling_work=PrefillWork(300, 60_000.0)),
        node("x", running=1, kv_usage=0.4),
        node("y", inflight=3, high_sessions=1),
        node("z", waiting=0, announced=2),
    ]
    decision = policy.choose(req, nodes)
    assert decision.scores == {n.node_id: pytest.approx(policy.estimate(req, n).score_ms) for n in nodes}
    assert decision.node_id == min(decision.scores, key=decision.scores.__getitem__)


def test_another_sessions_prefix_is_found_where_it_is_but_never_moved() -> None:
    """As in the queue test, a holds 1,900 of 2,000 tokens in its engine, left there by another
    session of the tenant (a shared system prompt): b, idle, cannot pull another session's pages, so
    it recomputes all 2,000 (3,000), and a, with its prefills ahead, costs 5,512.5 against b's 50 + 10
    + 3,000 = 3,060: b's first token would come sooner. But b's 3,000 ms of prefill delay every request
    after it there as long, and a's 197.5 hardly: scored with those delays, a 5,710 and b 6,060, so
    the request waits for the prefix rather than compute it a second time. Counting only its own time
    to first token (weight 0), b. Idle, a costs 257.5."""
    req = request(2000, {"a": HeldPrefix(engine=1900)}, own=False)
    assert estimate(req, node("b")) == TtftEstimate(50.0, 10.0, 0.0, 0.0, 3000.0, delay_ms=3000.0)
    busy_a = node("a", running=2, prefilling=2, prefilling_work=PrefillWork(3000, 4_500_000.0))
    decision = SymphonyPolicy(PROFILE).choose(req, [busy_a, node("b")])
    assert (decision.node_id, decision.scores) == ("a", {"a": 5710.0, "b": 6060.0})
    myopic = SymphonyPolicy(PROFILE, CostModel(prefill_delay_weight=0.0)).choose(req, [busy_a, node("b")])
    assert (myopic.node_id, myopic.scores) == ("b", {"a": 5512.5, "b": 3060.0})
    assert SymphonyPolicy(PROFILE).choose(req, [node("a"), node("b", running=1)]).node_id == "a"


def test_a_node_with_requests_waiting_is_a_candidate_only_for_a_prefix_no_idle_node_holds() -> None:
    """Selective pushing keeps requests out of engine queues, but not at the price of recomputing or
    pulling a prefix an engine with a short queue holds. a holds 1,900 of 2,000 tokens, another
    session's, and has one request waiting of unknown size (256 tokens: 256 + 0.5 x 256 x 128 / 1000 =
    272.384 ms) behind one running: 50 + (10 + 2) x 1.5 + 272.384 + 197.5 = 537.884, against idle
    b's recompute, 3,060: a (scored with the delays of their prefills, 197.5 and 3,000: 735.384 and
    6,060). The same copy as the session's own, which b can pull (2,095 + 197.5 and its delay: 2,550):
    a still, its queue priced against the pull. With nothing idle, the request waits in the
    scheduler."""
    waiting_a = node("a", running=1, waiting=1)
    shared = request(2000, {"a": HeldPrefix(engine=1900)}, own=False)
    decision = SymphonyPolicy(PROFILE).choose(shared, [waiting_a, node("b")])
    assert decision.node_id == "a"
    assert decision.scores == pytest.approx({"a": 735.384, "b": 6060.0})
    own = request(2000, {"a": HeldPrefix(engine=1900)}, own=True)
    decision = SymphonyPolicy(PROFILE).choose(own, [waiting_a, node("b")])
    assert decision.node_id == "a"
    assert decision.scores == pytest.approx({"a": 735.384, "b": 2550.0})
    # Behind a queue longer than the pull, b.
    long_queue = node("a", running=1, waiting=8)
    assert SymphonyPolicy(PROFILE).choose(own, [long_queue, node("b")]).node_id == "b"
    # With a's KV cache nearly full its queue may wait for memory, which no price sees: a is a
    # candidate only for the prefix b cannot pull.
    full_a = node("a", running=1, waiting=1, kv_usage=NEARLY_FULL_KV)
    decision = SymphonyPolicy(PROFILE).choose(own, [full_a, node("b")])
    assert decision.node_id == "b" and set(decision.scores) == {"b"}
    assert SymphonyPolicy(PROFILE).choose(shared, [full_a, node("b")]).node_id == "a"
    assert SymphonyPolicy(PROFILE).choose(shared, [waiting_a, node("b", waiting=1)]).queue
    # A waiting node holding no more than an idle one is never a candidate.
    both = request(2000, {"a": HeldPrefix(engine=1900), "b": HeldPrefix(dram=1900)}, own=False)
    assert set(SymphonyPolicy(PROFILE).choose(both, [waiting_a, node("b")]).scores) == {"b"}


def test_another_sessions_prefix_moves_under_its_donors_name() -> None:
    """The case above, but the scheduler knows a session of the tenant whose history on a starts with
    the prefix (`prefix_donor`): b can pull it under that session's name. Moving a's 1,900 tokens:
    95 read (the engine's copy is read from the store's DRAM) + 5 + 1,900 over the link + 95 DRAM
    load = 2,095, against recomputing them, 2,802.5; then the last 100 tokens, 197.5. b: 50 + 10 +
    2,095 + 197.5 = 2,352.5, and only 197.5 computed: scored 2,550, against busy a's 5,710.
    With a request waiting on a (735.384, as in the test above), a: its queue is shorter than the
    pull."""
    held = {"a": HeldPrefix(engine=1900)}
    req = RouteRequest("t", "s", "m", history_tokens=2000, held=held, prefix_donor="d", prefix_copies={"a": 1900})
    assert estimate(req, node("b")) == TtftEstimate(50.0, 10.0, 0.0, 2095.0, 197.5, delay_ms=197.5)
    busy_a = node("a", running=2, prefilling=2, prefilling_work=PrefillWork(3000, 4_500_000.0))
    decision = SymphonyPolicy(PROFILE).choose(req, [busy_a, node("b")])
    assert (decision.node_id, decision.scores) == ("b", {"a": 5710.0, "b": 2550.0})
    decision = SymphonyPolicy(PROFILE).choose(req, [node("a", running=1, waiting=1), node("b")])
    assert (decision.node_id, decision.scores) == ("a", pytest.approx({"a": 735.384, "b": 2550.0}))
    # What a pull brings is the longer of the session's own copy and the donor's, per node.
    assert dict(RouteRequest("t", "s", "m", kv_tokens={"a": 50, "c": 9}, prefix_copies={"a": 900}).movable()) == {
        "a": 900,
        "c": 9,
    }
    # A request first waiting for the donor's pull prefills what no node holds beyond it.
    assert prefill_work(req, "b", pulls=True) == PrefillWork(100, 100 * 1950)

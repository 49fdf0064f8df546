"""The global layer's region policies and their costs, on hand-computed cases; the regions' session
feed and an entry's copy of it; what an entry reads of a request's body."""

from __future__ import annotations

import dataclasses

import aiohttp
import pytest

from global_layer.advised import AdvisedRegions
from global_layer.costs import MAX_FILL, fill, region_cost
from global_layer.held import HeldSessions
from global_layer.policies import Gorgo, SkyWalker, SymphonyRegions, rank_regions
from global_layer.probe import HELD_KEPT_DOWN_S, RegionProbe
from global_layer.request_content import request_content
from global_layer.views import RegionRequest, RegionView
from scheduler.region_feed import SessionFeed
from scheduler.sessions import SessionTable
from symphony.region_load import RegionLoad, SessionDelta, session_digest
from symphony.regions import build_topology

LINKS = ["us-east~eu-west:75:1000", "us-east~ap-south:190:1000", "eu-west~ap-south:120:1000"]
TOPOLOGY = build_topology(["us-east:1", "eu-west:1", "ap-south:1"], LINKS, 1.0, [])
KV_BYTES = 23_040  # SmolLM2's KV per token
IDLE = RegionLoad(
    1, 1, 0, 0, 0, 0, 0.0, queue_ms=0.0, prefill_ms_per_token=0.5, request_overhead_ms=10.0, kv_bytes_per_token=KV_BYTES
)


def view(name: str, **load: float) -> RegionView:
    return RegionView(name, True, dataclasses.replace(IDLE, **load))  # type: ignore[arg-type]


def all_idle(**per_region: dict[str, float]) -> list[RegionView]:
    return [view(name, **per_region.get(name.replace("-", "_"), {})) for name in TOPOLOGY.names]


# A session of 4,000 tokens held in ap-south, its next turn 4,100 tokens, from a us-east client.
FAR_HOLDS = RegionRequest("t", "us-east", "s", "", 4_100, {"ap-south": 4_000})


def test_a_far_region_holding_the_prefix_against_a_near_one_without_it() -> None:
    regions = all_idle()
    near = region_cost(FAR_HOLDS, regions[0], TOPOLOGY, can_move=False)
    far = region_cost(FAR_HOLDS, regions[2], TOPOLOGY, can_move=False)
    # us-east: 1 ms round trip + 10 overhead + 4,100 tokens x 0.5 ms.
    assert near.total_ms == pytest.approx(1 + 10 + 2_050)
    # ap-south: 190 ms round trip + 10 + the 100 new tokens x 0.5 ms.
    assert far.total_ms == pytest.approx(190 + 10 + 50)
    assert rank_regions(SymphonyRegions(), FAR_HOLDS, regions, TOPOLOGY).regions[0] == "ap-south"


def test_moving_the_prefix_over_the_wan_is_priced_by_the_links_rtt_and_bandwidth() -> None:
    regions = all_idle()
    near = region_cost(FAR_HOLDS, regions[0], TOPOLOGY, can_move=True)
    # 190 ms round trip, then 4,000 x 23,040 bytes at 1 Gb/s (125,000 bytes a ms), then 100 tokens.
    assert near.source == "ap-south"
    assert near.move_ms == pytest.approx(190 + 4_000 * KV_BYTES / 125_000)
    assert near.total_ms == pytest.approx(1 + 10 + 190 + 737.28 + 50)
    # Over a 10 Mb/s link the move (7.4 s) costs more than recomputing (2.05 s): no move.
    slow = build_topology(
        ["us-east:1", "eu-west:1", "ap-south:1"],
        ["us-east~eu-west:75:10", "us-east~ap-south:190:10", "eu-west~ap-south:120:10"],
        1.0,
        [],
    )
    recompute = region_cost(FAR_HOLDS, regions[0], slow, can_move=True)
    assert recompute.source is None and recompute.total_ms == pytest.approx(1 + 10 + 2_050)


# The same session's 4,000 tokens held in two regions, for a us-east client.
BOTH_HOLD = RegionRequest("t", "us-east", "s", "", 4_100, {"eu-west": 4_000, "ap-south": 4_000})


def test_a_held_copy_is_priced_by_the_tiers_it_sits_in() -> None:
    same = all_idle(eu_west={"held_load_ms_per_token": 0.001}, ap_south={"held_load_ms_per_token": 0.001})
    # eu-west: 75 + 10 + 4,000 x 0.001 + 100 x 0.5; ap-south the same but 190 ms away.
    eu = region_cost(BOTH_HOLD, same[1], TOPOLOGY, can_move=False)
    assert (eu.load_ms, eu.total_ms) == (pytest.approx(4.0), pytest.approx(75 + 10 + 4 + 50))
    assert rank_regions(SymphonyRegions(), BOTH_HOLD, same, TOPOLOGY).regions[0] == "eu-west"
    # eu-west's copy is on a slow disk (0.1 ms a token: 400 ms to load), ap-south's in memory.
    disk = all_idle(eu_west={"held_load_ms_per_token": 0.1}, ap_south={"held_load_ms_per_token": 0.001})
    assert region_cost(BOTH_HOLD, disk[1], TOPOLOGY, can_move=False).total_ms == pytest.approx(75 + 10 + 400 + 50)
    assert region_cost(BOTH_HOLD, disk[2], TOPOLOGY, can_move=False).total_ms == pytest.approx(190 + 10 + 4 + 50)
    assert rank_regions(SymphonyRegions(), BOTH_HOLD, disk, TOPOLOGY).regions[0] == "ap-south"
    # Gorgo's cost (residual prefill only) does not see tiers: it stays with the nearer copy.
    assert rank_regions(Gorgo(), BOTH_HOLD, disk, TOPOLOGY).regions[0] == "eu-west"


def test_a_move_reads_the_copy_at_its_source_and_loads_it_where_it_lands() -> None:
    # us-east's own copies sit on a slow disk (0.5 ms a token to read out); ap-south's in memory.
    regions = all_idle(us_east={"pulled_load_ms_per_token": 0.002, "held_read_ms_per_token": 0.5})
    source = dataclasses.replace(IDLE, held_read_ms_per_token=0.01)
    wire = 190 + 4_000 * KV_BYTES / 125_000  # 927.28 ms
    moved = region_cost(FAR_HOLDS, regions[0], TOPOLOGY, can_move=True, sources={"ap-south": source})
    assert moved.source == "ap-south" and moved.move_ms == pytest.approx(4_000 * (0.01 + 0.002) + wire)
    # Without the source's summary, its read is priced as the destination's own: 4,000 x 0.502 +
    # 927 ms would take longer than recomputing the 4,000 tokens (2,000 ms).
    unseen = region_cost(FAR_HOLDS, regions[0], TOPOLOGY, can_move=True)
    assert unseen.source is None and unseen.total_ms == pytest.approx(1 + 10 + 2_050)
    # The policy passes the candidates' summaries: ap-south's read when it is one (its scheduler
    # answers), else us-east's.
    advisory = dataclasses.replace(FAR_HOLDS, advisory=True, holders={"ap-south": "node-2"})
    assert SymphonyRegions().move_source(advisory, "us-east", regions[:2], TOPOLOGY) is None
    regions[2] = RegionView("ap-south", True, source)
    assert SymphonyRegions().move_source(advisory, "us-east", regions, TOPOLOGY) == ("node-2", 4_000)


@pytest.mark.parametrize(
    ("prefill_ms_per_token", "winner"),
    [
        (0.5, "ap-south"),  # 2,061 ms near against 250 far
        (0.05, "ap-south"),  # 216 against 205
        (0.04, "us-east"),  # 175 against 204: a fast prefill beats a long round trip
    ],
)
def test_the_round_trip_against_the_prefill_it_saves(prefill_ms_per_token: float, winner: str) -> None:
    regions = [view(name, prefill_ms_per_token=prefill_ms_per_token) for name in TOPOLOGY.names]
    assert rank_regions(SymphonyRegions(), FAR_HOLDS, regions, TOPOLOGY).regions[0] == winner


def test_a_queue_sends_the_request_away_from_its_prefix() -> None:
    # ap-south holds it but has 3 s of queue: us-east recomputes (2,061 ms) sooner than 3,250.
    regions = all_idle(ap_south={"queue_ms": 3_000.0, "idle_nodes": 0})
    assert rank_regions(SymphonyRegions(), FAR_HOLDS, regions, TOPOLOGY).regions[0] == "us-east"


# A us-east client's new session of 100 tokens (no region holds any of it).
NEW_SESSION = RegionRequest("t", "us-east", "n", "", 100, {})
# us-east 80% full (80 of the 100 requests its engines run at once), eu-west empty, both 50 ms of queue.
FILLING = [
    view("us-east", queue_ms=50.0, capacity=100, running=80, inflight=80),
    view("eu-west", queue_ms=50.0, capacity=100),
    view("ap-south", queue_ms=50.0, capacity=100, running=95, inflight=90, queued=10),
]


def test_fill_counts_what_runs_and_what_is_held_back_and_needs_a_capacity() -> None:
    assert fill(FILLING[0].load) == pytest.approx(0.8)  # type: ignore[arg-type]
    assert fill(FILLING[1].load) == 0.0  # type: ignore[arg-type]
    assert fill(FILLING[2].load) == MAX_FILL  # 105 of 100: past full, capped  # type: ignore[arg-type]
    assert fill(IDLE) == 0.0 and fill(dataclasses.replace(IDLE, running=500)) == 0.0  # no capacity known


def test_a_new_session_goes_where_there_is_room_before_its_region_is_full() -> None:
    home = region_cost(NEW_SESSION, FILLING[0], TOPOLOGY, can_move=False)
    away = region_cost(NEW_SESSION, FILLING[1], TOPOLOGY, can_move=False)
    # us-east: 1 ms + 50 / 0.2 + 10 + 100 x 0.5 / 0.2; eu-west: 75 + 50 + 10 + 100 x 0.5.
    assert home.total_ms == pytest.approx(1 + 250 + 10 + 250)
    assert away.total_ms == pytest.approx(75 + 50 + 10 + 50)
    assert rank_regions(SymphonyRegions(), NEW_SESSION, FILLING, TOPOLOGY).regions == ["eu-west", "us-east", "ap-south"]
    # With no capacity known, the same loads keep it home (1 + 50 + 10 + 50 against 185).
    unknown = [dataclasses.replace(v, load=dataclasses.replace(v.load, capacity=0)) for v in FILLING]  # type: ignore[arg-type]
    assert rank_regions(SymphonyRegions(), NEW_SESSION, unknown, TOPOLOGY).regions[0] == "us-east"


def test_a_session_held_in_a_filling_region_stays_rather_than_recompute_elsewhere() -> None:
    """Its wait is not scaled (it settled there already), and its history would be computed
    again in eu-west: 1 + 50 + 10 + 100 x 0.5 / 0.2 at home against 75 + 50 + 10 + 4,100 x 0.5."""
    held = RegionRequest("t", "us-east", "s", "", 4_100, {"us-east": 4_000})
    home = region_cost(held, FILLING[0], TOPOLOGY, can_move=False)
    assert home.total_ms == pytest.approx(1 + 50 + 10 + 250) and home.fill == pytest.approx(0.8)
    assert rank_regions(SymphonyRegions(), held, FILLING, TOPOLOGY).regions[0] == "us-east"
    # Recomputing it in a region 50% full costs twice its prefill there: the region's other requests wait.
    half = dataclasses.replace(FILLING[1], load=dataclasses.replace(FILLING[1].load, running=50, inflight=50))  # type: ignore[arg-type]
    assert region_cost(held, half, TOPOLOGY, can_move=False).prefill_ms == pytest.approx(4_100 * 0.5 * 2)


def test_gorgo_weighs_the_queue_and_without_it_piles_onto_the_prefix() -> None:
    regions = all_idle(ap_south={"queue_ms": 6_000.0, "idle_nodes": 0})
    # w_rtt 1, w_queue 0.5: ap-south 190 + 50 + 3,000 against us-east's 1 + 2,050.
    assert rank_regions(Gorgo(), FAR_HOLDS, regions, TOPOLOGY).regions[0] == "us-east"
    # Without the queue term ap-south looks cheapest however long its queue (reward hacking).
    hacked = Gorgo(w_queue=0.0, name="gorgo_no_queue")
    for queue in (6_000.0, 60_000.0, 600_000.0):
        loaded = all_idle(ap_south={"queue_ms": queue, "idle_nodes": 0})
        assert rank_regions(hacked, FAR_HOLDS, loaded, TOPOLOGY).regions[0] == "ap-south"


def test_skywalker_follows_the_prefix_while_its_region_has_room() -> None:
    policy = SkyWalker(trie_chars=10_000)
    text = "system: be brief\nuser: tell me about the alps\n"
    first = RegionRequest("t", "us-east", "s1", text)
    policy.observe(first, "eu-west")
    follow = RegionRequest("t", "us-east", "s1", text + "assistant: high mountains\nuser: and rivers?\n")
    assert rank_regions(policy, follow, all_idle(), TOPOLOGY).regions == ["eu-west", "us-east", "ap-south"]
    # eu-west saturated (selective pushing): the client's own region, which has room.
    busy = all_idle(eu_west={"idle_nodes": 0, "queue_ms": 500.0})
    assert rank_regions(policy, follow, busy, TOPOLOGY).regions[0] == "us-east"
    # Both saturated: the hash ring's owner among those with room (only ap-south).
    both = all_idle(eu_west={"idle_nodes": 0}, us_east={"idle_nodes": 0})
    assert rank_regions(policy, follow, both, TOPOLOGY).regions[0] == "ap-south"
    # All saturated: the shortest wait.
    full = all_idle(
        eu_west={"idle_nodes": 0, "queue_ms": 90.0},
        us_east={"idle_nodes": 0, "queue_ms": 50.0},
        ap_south={"idle_nodes": 0, "queue_ms": 70.0},
    )
    assert rank_regions(policy, follow, full, TOPOLOGY).regions[0] == "us-east"


def test_skywalker_breaks_a_tie_of_matches_by_round_trip_not_by_name() -> None:
    """Every prompt opens with the same chat template: matching only that, the nearest region with
    it wins (before, the last name: a client in ap-south was sent to us-east, 190 ms away)."""
    policy = SkyWalker(trie_chars=10_000)
    template = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    for region, session in (("us-east", "a1"), ("eu-west", "b2")):
        policy.observe(RegionRequest("t", region, session, template + session), region)
    fresh = RegionRequest("t", "ap-south", "c3", template + "c3")
    assert rank_regions(policy, fresh, all_idle(), TOPOLOGY).regions[0] == "eu-west"
    policy.observe(RegionRequest("t", "ap-south", "d4", template + "d4"), "ap-south")
    assert rank_regions(policy, fresh, all_idle(), TOPOLOGY).regions[0] == "ap-south"


def test_skywalker_without_a_match_hashes_sessions_across_regions_with_room() -> None:
    policy = SkyWalker(trie_chars=10_000)
    away = all_idle(us_east={"idle_nodes": 0})
    chosen = {
        rank_regions(policy, RegionRequest("t", "us-east", f"s{i}"), away, TOPOLOGY).regions[0] for i in range(40)
    }
    assert chosen == {"eu-west", "ap-south"}


# -- the session feed ------------------------------------------------------------------------------
def test_the_feed_sends_changes_since_a_seq_and_resets_a_reader_too_far_behind() -> None:
    feed = SessionFeed(max_sessions=2)
    feed.changed(("t", "a"), 100, "node-0")
    first = feed.since(0, "")
    assert first.reset and first.held == ((session_digest("t", "a"), 100, "node-0"),)
    feed.changed(("t", "a"), 100, "node-0")  # no change: no entry
    feed.changed(("t", "b"), 50, "node-0")
    delta = feed.since(first.seq, feed.epoch)
    assert not delta.reset and delta.held == ((session_digest("t", "b"), 50, "node-0"),)
    feed.changed(("t", "c"), 70, "node-0")  # a's change is dropped (bound 2)
    # A reader that had it goes on; one that missed it starts over with what is retained.
    assert feed.since(first.seq, feed.epoch).held == (
        (session_digest("t", "b"), 50, "node-0"),
        (session_digest("t", "c"), 70, "node-0"),
    )
    behind = feed.since(0, feed.epoch)
    assert behind.reset and {d for d, _, _ in behind.held} == {session_digest("t", "b"), session_digest("t", "c")}
    assert feed.since(delta.seq, "another-run").reset


def test_an_entry_follows_the_feed_and_forgets_on_reset() -> None:
    feed, held = SessionFeed(), HeldSessions(max_sessions=10)
    feed.changed(("t", "a"), 100, "node-0")
    feed.changed(("t", "b"), 20, "node-0")
    held.apply(feed.since(held.seq, held.epoch))
    feed.changed(("t", "b"), 0, "")
    held.apply(feed.since(held.seq, held.epoch))
    assert held.tokens(session_digest("t", "a")) == 100 and held.tokens(session_digest("t", "b")) == 0
    assert held.holder(session_digest("t", "a")) == "node-0" and held.holder(session_digest("t", "b")) == ""
    held.apply(SessionDelta("other", 1, True, ((session_digest("t", "c"), 5, "node-2"),)))
    assert held.tokens(session_digest("t", "a")) == 0 and len(held) == 1


def test_the_session_table_feeds_every_change_of_a_sessions_best_copy() -> None:
    changes: list[tuple[tuple[str, str], int, str]] = []
    table = SessionTable(1, ttl_s=60, on_change=lambda key, tokens, node: changes.append((key, tokens, node)))
    undo = table.served(("t", "a"), "node-0", 300, fingerprint=b"f")
    table.moved(("t", "a"), "node-1", 500, b"f")
    undo()
    table.served(("t", "b"), "node-0", 10, fingerprint=b"f")  # the bound drops a
    assert changes == [
        (("t", "a"), 300, "node-0"),
        (("t", "a"), 500, "node-1"),  # the move's copy is the best one
        (("t", "a"), 500, "node-1"),  # the undone turn leaves it so
        (("t", "a"), 0, ""),
        (("t", "b"), 10, "node-0"),
    ]


def test_session_digests_never_collide_across_tenants() -> None:
    assert session_digest("ab", "c") != session_digest("a", "bc")
    assert len(session_digest("t", "s")) == 16


# -- what an entry reads of a body -----------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"[]",
        b"null",
        b'{"messages": 3}',
        b'{"messages": [1, "x", {"content": {}}]}',
        b'{"prompt": {"a": 1}}',
        b'{"session_id": 5}',
        b"[" * 100_000,
    ],
)
def test_any_body_is_read_without_failing(body: bytes) -> None:
    for endpoint in ("chat", "completions", "advisories"):
        content = request_content(body, endpoint)
        assert content.session_id is None or isinstance(content.session_id, str)


def test_a_chat_body_gives_its_session_text_and_size() -> None:
    body = b'{"session_id": "s1", "messages": [{"role": "user", "content": "hello there, friend"}]}'
    content = request_content(body, "chat")
    assert content.session_id == "s1"
    assert content.text == "user: hello there, friend\n"
    assert content.tokens == 5 + 4  # 19 characters / 4, rounded up, and the template's 4


# -- an entry's probe of a region ------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Answer:
    """A /summary answer that arrives after the probe's region was marked unreachable."""

    def __init__(self, probe: RegionProbe, clock: _Clock) -> None:
        self.probe, self.clock, self.status = probe, clock, 200

    async def __aenter__(self) -> _Answer:
        self.clock.now += 0.05
        self.probe.mark_unreachable("connection refused")  # a request failed meanwhile
        self.clock.now += 0.05
        return self

    async def __aexit__(self, *_: object) -> None:
        return None

    async def json(self) -> dict[str, object]:
        return IDLE.to_json()


async def test_a_summary_asked_for_before_a_failure_does_not_bring_the_region_back() -> None:
    clock = _Clock()
    probe = RegionProbe("eu-west", "http://x", None, interval_s=0.1, down_after_s=0.5, clock=clock)  # type: ignore[arg-type]
    probe.session = type("S", (), {"get": lambda _self, *a, **k: _Answer(probe, clock)})()  # type: ignore[assignment]
    await probe.probe_once()
    assert probe.load == IDLE and probe.view().up is False
    probe.session = type("S", (), {"get": lambda _self, *a, **k: _Later(clock)})()  # type: ignore[assignment]
    await probe.probe_once()  # asked for after the failure: up again
    assert probe.view().up is True


class _Later(_Answer):
    def __init__(self, clock: _Clock) -> None:
        self.clock, self.status = clock, 200

    async def __aenter__(self) -> _Later:
        self.clock.now += 0.05
        return self


def test_an_advisory_moves_the_far_copy_when_its_region_is_loaded_or_down() -> None:
    policy = SymphonyRegions()
    advisory = dataclasses.replace(FAR_HOLDS, advisory=True, holders={"ap-south": "node-2"})
    # ap-south idle: serving there (250 ms) beats any move; nothing to move.
    regions = all_idle()
    assert rank_regions(policy, advisory, regions, TOPOLOGY).regions[0] == "ap-south"
    assert policy.move_source(advisory, "ap-south", regions, TOPOLOGY) is None
    # ap-south with 3 s of queue: us-east with the copy moved (988 ms) beats both.
    loaded = all_idle(ap_south={"queue_ms": 3_000.0, "idle_nodes": 0})
    assert rank_regions(policy, advisory, loaded, TOPOLOGY).regions[0] == "us-east"
    assert policy.move_source(advisory, "us-east", loaded, TOPOLOGY) == ("node-2", 4_000)
    # ap-south down (its scheduler): its node's copy still moves.
    down = [v for v in all_idle() if v.name != "ap-south"]
    assert rank_regions(policy, advisory, down, TOPOLOGY).regions[0] == "us-east"
    assert policy.move_source(advisory, "us-east", down, TOPOLOGY) == ("node-2", 4_000)
    # A request (no advisory) never counts on a move: us-east recomputes (2,061 ms), eu-west too.
    assert policy.move_source(FAR_HOLDS, "us-east", down, TOPOLOGY) is None
    # Residency: a copy in a region the tenant may not use never moves.
    eu_topology = build_topology(["us-east:1", "eu-west:1", "ap-south:1"], LINKS, 1.0, ["t=us-east|eu-west"])
    assert policy.move_source(advisory, "us-east", loaded, eu_topology) is None


def test_an_advised_region_is_kept_until_dropped_or_too_old() -> None:
    clock = _Clock()
    advised = AdvisedRegions(2, ttl_s=10, clock=clock)
    advised.put("a", "us-east")
    advised.put("b", "eu-west")
    advised.put("c", "ap-south")  # a is dropped (bound 2)
    assert advised.peek("a") is None and advised.peek("b") == "eu-west" and advised.peek("b") == "eu-west"
    advised.drop("b")
    assert advised.peek("b") is None
    clock.now += 11
    assert advised.peek("c") is None and len(advised) == 0  # too old


class _Refused:
    def get(self, *_: object, **__: object) -> object:
        raise aiohttp.ClientConnectionError("connection refused")


async def test_a_region_silent_for_long_stops_being_offered_as_a_moves_source() -> None:
    clock = _Clock()
    probe = RegionProbe("eu-west", "http://x", _Refused(), interval_s=0.1, down_after_s=0.5, clock=clock)  # type: ignore[arg-type]
    feed = SessionFeed()
    feed.changed(("acme", "s"), 640, "node-1")
    probe.held.apply(feed.since(probe.held.seq, probe.held.epoch))
    probe.last_ok_at = clock.now
    clock.now += HELD_KEPT_DOWN_S / 2  # down, but briefly: its nodes may still serve a pull
    await probe.probe_once()
    assert probe.held.tokens(session_digest("acme", "s")) == 640
    clock.now += HELD_KEPT_DOWN_S
    await probe.probe_once()
    assert probe.held.tokens(session_digest("acme", "s")) == 0 and probe.held.epoch == ""

"""The live scheduler and the cluster simulator decide alike.

One sequence of events (engine status changes, advisories, requests) goes through both:
- the live side: the scheduler's `Dispatcher` itself (`advise`, `dispatch`, `wake_queued`, which
  `NodeMonitor.on_status` calls after each status), over a real `NodeMonitor`, advisory, session and
  priority tables; faked are only its I/O: the engines' HTTP (a session that answers at once) and
  the nodes' KV stores (none, so no move starts and no pull is waited for);
- the simulated side: `ClusterSim`'s own event handlers, over stand-in engines whose reported state
  the test sets.
On each side the policy and the pull rule are wrapped, unchanged, to record in order every request
sent (session, node: `observe`) and every pull planned (node, source, tokens, wait); with every
advisory's node, every request refused and how many are held back after each event, the two
records must be equal. Sessions send one request each: the scheduler books a turn's KV on its node
as the turn is sent, the simulator once it is computed (bookkeeping, not a decision).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eval.sim.cluster import ClusterSim, LinkModel
from eval.sim.engine import EngineModel, SimRequest
from eval.sim.presets import sim_cost_profile
from eval.sim.turns import Turn
from scheduler.advisories import AdvisoryTable
from scheduler.decisions import Pull, PullRule
from scheduler.dispatch import Dispatcher
from scheduler.errors import ApiError
from scheduler.metrics import SchedulerMetrics
from scheduler.node_monitor import READY, NodeMonitor
from scheduler.policies import POLICIES, make_policy
from scheduler.routing import NO_WORK, PRIORITIES, NodeSnapshot, RouteDecision, RouteRequest, RoutingPolicy
from scheduler.validation import AdvisoryRequest, InferenceRequest
from symphony.config import SchedulerConfig
from symphony.tenant_quotas import TenantLimits, TenantQuotas

MODEL, FINGERPRINT = "model", b"f" * 32
MAX_QUEUED = 3  # small, so that some cases fill the held-back queue
CONFIG = SchedulerConfig(max_queued_requests=MAX_QUEUED)
# Two tenants, one weighing twice the other in the held-back queue with a share of its own there:
# both sides order and refuse held requests by the same quotas.
QUOTAS = TenantQuotas(TenantLimits(), {"t0": TenantLimits(weight=2.0, max_queued=2)})


def tenant_of(session: str) -> str:
    """Sessions "x<n>" alternate between tenants t0 and t1 by n; any other is t1's."""
    number = session[1:]
    return f"t{int(number) % 2}" if number.isdigit() else "t1"


ENGINE = EngineModel(step_ms=10, prefill_ms_per_token=1, decode_ms_per_seq=2, decode_ms_per_kilotoken=0, kv_blocks=100)
LINK = LinkModel(kv_bytes_per_token=1_000_000, bandwidth_gbps=1.0, rtt_ms=5.0)
PROFILE = sim_cost_profile(ENGINE, LINK)  # the simulator's costs, which both sides' policies price by
# Policies that route on what both sides give them (the simulator passes no prompt text).
PARITY_POLICIES = sorted(name for name, make in POLICIES.items() if not make().traits.needs_routing_text)


@dataclass(frozen=True)
class Status:
    """A node's engine reports this (and room may have opened)."""

    node: str
    running: int
    waiting: int
    prefilling: int
    kv_usage: float


@dataclass(frozen=True)
class Advise:
    session: str


@dataclass(frozen=True)
class Arrive:
    session: str


Event = Status | Advise | Arrive


@dataclass
class Case:
    policy: str
    nodes: tuple[str, ...]
    kv: dict[str, dict[str, int]]  # session -> node -> history tokens its tiers hold at the start
    priority: dict[str, str]  # session -> its tier
    events: list[Event] = field(default_factory=list)

    def prompt(self, session: str) -> int:
        return max(self.kv[session].values(), default=0) + 50


class RecordedPolicy:
    """A policy, unchanged, that logs each request sent (both sides call `observe` as it goes)."""

    def __init__(self, policy: RoutingPolicy, log: list[tuple]) -> None:
        self.name, self.traits, self._policy, self._log = policy.name, policy.traits, policy, log

    def choose(self, request: RouteRequest, nodes: Sequence[NodeSnapshot]) -> RouteDecision:
        return self._policy.choose(request, nodes)

    def observe(self, request: RouteRequest, node_id: str) -> None:
        self._log.append(("sent", request.session_id, node_id))
        self._policy.observe(request, node_id)


class RecordedPulls:
    """A pull rule, unchanged, that logs each pull it plans."""

    def __init__(self, rule: PullRule, log: list[tuple]) -> None:
        self._rule, self._log = rule, log

    def plan(self, *args: Any, **kwargs: Any) -> Pull | None:
        pull = self._rule.plan(*args, **kwargs)
        if pull is not None:
            self._log.append(("pull", args[2], pull.source, pull.tokens, pull.wait_ms))  # args[2]: the node
        return pull


# -- the live scheduler ----------------------------------------------------------------------------
class _Answer:
    status = 200

    def close(self) -> None:
        pass


class _Engines:
    """The engines' HTTP: every request is taken and prefilled at once, so the scheduler's count of
    a node's requests in their prefill stays what the test's statuses set, as the simulator's
    stand-in engines report it."""

    def __init__(self, cluster: NodeMonitor) -> None:
        self.cluster = cluster
        self.posted: list[tuple[str | None, str]] = []  # (session, engine URL)

    async def post(self, url: str, data: bytes, headers: dict[str, str]) -> _Answer:
        self.posted.append((headers.get("x-session-id"), url))
        for view in self.cluster.nodes:
            if url.startswith(view.engine_url + "/"):
                view.gauged(math.inf)  # its gauges count the plain request already
        return _Answer()

    async def close(self) -> None:
        pass


async def _settle() -> None:
    for _ in range(20):  # woken waiters need a few turns of the loop to route
        await asyncio.sleep(0)


async def live(case: Case) -> list[tuple]:
    log: list[tuple] = []
    cluster = NodeMonitor([f"addr-{n}" for n in case.nodes], poll_interval_s=1.0, down_after_s=3600.0)
    for view, node in zip(cluster.nodes, case.nodes, strict=True):
        view.node_id, view.engine_state, view.engine_url = node, READY, f"http://{node}"
        view.served_model, view.model_fingerprint, view.last_status_at = MODEL, FINGERPRINT, time.monotonic()
    dispatcher = Dispatcher(
        cluster,
        RecordedPolicy(make_policy(case.policy, CONFIG, PROFILE), log),
        AdvisoryTable(CONFIG.max_advisories, CONFIG.advisory_ttl_s),
        SchedulerMetrics(),
        CONFIG,
        quotas=QUOTAS,
    )
    engines = _Engines(cluster)
    dispatcher._session = engines  # type: ignore[assignment]
    dispatcher.pulls = RecordedPulls(dispatcher.pulls, log)  # type: ignore[assignment]
    for session, copies in case.kv.items():
        tenant = tenant_of(session)
        dispatcher.priorities.set(tenant, case.priority[session], session)
        for index, (node, tokens) in enumerate(copies.items()):
            if index == 0:
                dispatcher.sessions.served((tenant, session), node, tokens, fingerprint=FINGERPRINT, model=MODEL)
            else:
                dispatcher.sessions.moved((tenant, session), node, tokens, FINGERPRINT)

    async def send(session: str) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        request = InferenceRequest("chat", MODEL, False, session, body, case.prompt(session))
        try:
            await dispatcher.dispatch(request, tenant_of(session), time.perf_counter())
        except ApiError as exc:
            # The simulator counts a refusal, not which bound refused it: the whole queue or the tenant's share.
            log.append(("refused", session, "queue_full" if exc.code == "tenant_queue_full" else exc.code))

    tasks = []
    for event in case.events:
        if isinstance(event, Status):
            view = cluster.by_id(event.node)
            assert view is not None
            view.running, view.waiting, view.prefilling, view.kv_usage = (
                event.running,
                event.waiting,
                event.prefilling,
                event.kv_usage,
            )
            dispatcher.wake_queued()  # as `NodeMonitor.on_status` does after a status
        elif isinstance(event, Advise):
            reply = dispatcher.advise(AdvisoryRequest(event.session, "typing", None, MODEL), tenant_of(event.session))
            log.append(("advised", event.session, reply["node"]))
        else:
            tasks.append(asyncio.create_task(send(event.session)))
        await _settle()
        log.append(("held", len(dispatcher.queue)))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    sent = [(entry[1], f"http://{entry[2]}/v1/chat/completions") for entry in log if entry[0] == "sent"]
    assert engines.posted == sent  # what `observe` recorded is where the requests went
    return log


# -- the simulator ---------------------------------------------------------------------------------
class _Engine:
    """An engine whose reported state the test sets; it takes requests and never steps."""

    def __init__(self) -> None:
        self.model = ENGINE
        self.running: list[SimRequest] = []
        self.waiting: list[SimRequest] = []
        self.prefilling = 0
        self.prefilling_work = NO_WORK
        self.kv_usage = 0.0

    def add(self, request: SimRequest) -> None:
        pass

    def has_work(self) -> bool:
        return False


def simulated(case: Case) -> list[tuple]:
    log: list[tuple] = []
    sim = ClusterSim(
        RecordedPolicy(make_policy(case.policy, profile=PROFILE), log),  # type: ignore[arg-type]
        dict.fromkeys(case.nodes, ENGINE),
        LINK,
        max_queued_requests=MAX_QUEUED,
        quotas=QUOTAS,
    )
    engines = {node: _Engine() for node in case.nodes}
    sim.engines = engines  # type: ignore[assignment]
    sim.pulls = RecordedPulls(sim.pulls, log)  # type: ignore[assignment]
    for session, copies in case.kv.items():
        for node, tokens in copies.items():
            sim.seed_kv(session, node, tokens)

    def turn(session: str) -> Turn:
        tenant, priority = tenant_of(session), case.priority[session]
        return Turn(session, sim.now_ms, case.prompt(session), 1, tenant=tenant, priority=priority)

    for index, event in enumerate(case.events):
        if isinstance(event, Status):
            engine = engines[event.node]
            engine.running = [SimRequest(-1, "other", 0, 1, 1)] * event.running
            engine.waiting = [SimRequest(-1, "other", 0, 1, 1)] * event.waiting
            engine.prefilling, engine.kv_usage = event.prefilling, event.kv_usage
            sim._wake_held()  # as at the end of an engine step
        elif isinstance(event, Advise):
            log.append(("advised", event.session, sim.advise(turn(event.session))))
        else:
            refused = len(sim.refused)
            sim._arrive(index, turn(event.session))
            log.extend(("refused", r.session, "queue_full") for r in sim.refused[refused:])
        log.append(("held", len(sim._queue)))
    return log


# -- the cases -------------------------------------------------------------------------------------
@st.composite
def cases(draw: st.DrawFn) -> Case:
    nodes = ("a", "b", "c")[: draw(st.integers(2, 3))]
    sessions = [f"s{i}" for i in range(draw(st.integers(1, 8)))]
    tokens = st.sampled_from([40, 100, 500, 2000])
    kv = {s: draw(st.dictionaries(st.sampled_from(nodes), tokens, max_size=len(nodes))) for s in sessions}
    # Symphony at least half the time: the policy that holds requests back, follows advisories and pulls.
    policy = draw(st.one_of(st.just("symphony"), st.sampled_from(PARITY_POLICIES)))
    case = Case(policy, nodes, kv, {s: draw(st.sampled_from(PRIORITIES)) for s in sessions})

    def status(node: st.SearchStrategy[str]) -> st.SearchStrategy[Status]:
        return st.builds(
            Status,
            node,
            st.integers(0, 3),
            st.sampled_from([0, 1, 1, 2]),  # mostly waiting: every node with a queue is common
            st.integers(0, 1),
            st.sampled_from([0.0, 0.5, 0.9]),
        )

    case.events = [draw(status(st.just(n))) for n in nodes]  # every node's first status
    waiting = list(sessions)  # sessions that have not sent their request yet
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["status", "advise", "arrive", "arrive"] if waiting else ["status"]))
        if kind == "status":
            case.events.append(draw(status(st.sampled_from(nodes))))
        else:
            session = draw(st.sampled_from(waiting))
            case.events.append(Advise(session) if kind == "advise" else Arrive(session))
            if kind == "arrive":
                waiting.remove(session)
    return case


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_the_scheduler_and_the_simulator_decide_alike(case: Case) -> None:
    assert simulated(case) == asyncio.run(live(case))


def test_an_advisory_while_every_node_has_a_queue_counts_the_kv_move_on_both_sides() -> None:
    """Every node has requests waiting, equally many; the session's KV is on b: the advisory goes
    there (the policy chosen as if nothing waited, so the move's cost counts), not to the first of
    the least loaded. The request is held back (b has a queue). When room opens on a, b's queue (one
    request) still costs less than pulling the history to a: the request goes to b, its KV's node."""
    case = Case(
        "symphony",
        ("a", "b"),
        {"s": {"b": 2000}},
        {"s": "normal"},
        [
            Status("a", 1, 1, 0, 0.0),
            Status("b", 1, 1, 0, 0.0),
            Advise("s"),
            Arrive("s"),
            Status("a", 1, 0, 0, 0.0),
        ],
    )
    expected = [
        ("held", 0),
        ("held", 0),
        ("advised", "s", "b"),
        ("held", 0),
        ("held", 1),  # the advised node has a queue: rerouted, and every node has one: held back
        ("sent", "s", "b"),
        ("held", 0),
    ]
    assert simulated(case) == expected
    assert asyncio.run(live(case)) == expected


def test_held_back_requests_go_by_tier_then_arrival_on_both_sides() -> None:
    case = Case(
        "symphony",
        ("a",),
        {"n1": {}, "l1": {}, "h1": {}, "n2": {}},
        {"n1": "normal", "l1": "low", "h1": "high", "n2": "normal"},
        [Status("a", 1, 1, 0, 0.0), Arrive("n1"), Arrive("h1"), Arrive("n2"), Arrive("l1")],
    )
    case.events += [Status("a", 1, 0, 0, 0.0)] * 4
    sent = [entry[1] for entry in simulated(case) if entry[0] == "sent"]
    assert sent == ["h1", "n1", "n2"]  # l1 found the queue full (3 held) and was refused
    assert ("refused", "l1", "queue_full") in simulated(case)
    assert simulated(case) == asyncio.run(live(case))

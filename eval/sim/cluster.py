"""A discrete-event simulation of a cluster of engines, routed by the real scheduler policies.

The loop keeps one heap of timed events: a request arriving (it is routed at once, by the policy
object `scheduler.policies` builds, through the same `RouteRequest`/`NodeSnapshot` values the
scheduler gives it), an advisory (for policies that prefetch on advisories, the policy picks the
node ahead of the request and the session's KV starts moving there), a KV move ending, an engine step
ending. What a request finds in the engine's KV when it is admitted is what its session's KV holds
on that node: history a move brought, or its last turn left there. As in the scheduler, a request
sent to a node that lacks its KV (no advisory moved it there, or the advisory's move is still under
way) first waits for a pull (bounded), which joins the move if one runs.

Every decision the scheduler makes is made here by the same code, `scheduler.decisions`: the
advisory's node, where a request goes, the pull it waits for, and the held-back queue of selective
pushing, whose requests get another try (one per node with nothing waiting, as the scheduler wakes
them) whenever an engine step ends, and admission (`scheduler.admission`): a newcomer that would
wait there past `max_queue_wait_s`, at the rate engine slots free up, is refused. The snapshots those
decisions read also count what the scheduler counts: announced advisories and each node's
high-priority sessions.

Kept simple on purpose, and said so: a node's tiers keep every session's KV that reached it (assumed
large enough), a move's time is the history's bytes over the link's bandwidth plus its RTT, and KV
loaded from a node's own tiers is as good as cached (the connector loads it layer by layer under the
forward pass: docs/benchmarks.md#bench-resume). Policies without the
tiers (`recompute`) find only the engine's own prefix cache: finished requests' KV in whole blocks,
least recently used first out, within the engine's KV capacity.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from eval.sim.engine import EngineModel, SimEngine, SimRequest, StepPlan
from eval.sim.events import EventLoop
from eval.sim.turns import Script, Turn
from scheduler.admission import Overloaded, SlotRate
from scheduler.decisions import PullRule, Routing, advisory_choice, rooms
from scheduler.held_queue import HeldQueue, QueueFull
from scheduler.routing import PRIORITY_RANK, HeldPrefix, NodeSnapshot, Priority, RouteRequest, RoutingPolicy, kv_source
from symphony.config import SchedulerConfig
from symphony.tenant_quotas import TenantQuotas

_SCHEDULER = SchedulerConfig()  # the scheduler's defaults, which the simulated one follows


@dataclass(frozen=True, slots=True)
class LinkModel:
    """Moving one session's KV between two nodes."""

    kv_bytes_per_token: int  # all layers, K and V
    bandwidth_gbps: float  # GB/s
    rtt_ms: float

    def move_ms(self, tokens: int) -> float:
        return self.rtt_ms + tokens * self.kv_bytes_per_token / (self.bandwidth_gbps * 1e6)


@dataclass(frozen=True, slots=True)
class _Held:
    """A request on its way to a node (held back, or being routed)."""

    request: SimRequest
    turn: Turn
    routing: Routing


@dataclass(slots=True)
class SimResult:
    requests: list[SimRequest]
    busy_ms: dict[str, float]
    preemptions: int
    refused: list[SimRequest] = field(default_factory=list)


class ClusterSim:
    def __init__(
        self,
        policy: RoutingPolicy,
        engines: dict[str, EngineModel],
        link: LinkModel,
        engine_priority_scheduling: bool = False,
        route_pull_wait_ms: float = _SCHEDULER.route_pull_wait_ms,
        route_pull_min_tokens: int = _SCHEDULER.route_pull_min_tokens,
        typing_lead_ms: float = _SCHEDULER.typing_lead_ms,
        max_queued_requests: int = _SCHEDULER.max_queued_requests,
        max_queue_wait_s: float = _SCHEDULER.queue_wait_bound_s,
        quotas: TenantQuotas | None = None,
        prefix_caching: bool = True,
        loop: EventLoop | None = None,
    ) -> None:
        self.policy = policy
        # vLLM's automatic prefix caching (on by default): off, a request finds in the engine only
        # what its policy's tiers bring (for `recompute`, nothing).
        self.prefix_caching = prefix_caching
        self.pulls = PullRule(route_pull_wait_ms, route_pull_min_tokens)
        self.typing_lead_ms = typing_lead_ms  # an advisory's lead when it names no arrival, as the scheduler's
        self.engines = {
            node_id: SimEngine(node_id, model, engine_priority_scheduling) for node_id, model in engines.items()
        }
        self.link = link
        # The clock, this cluster's own unless it shares one with others (the regions' simulator).
        self.loop = loop if loop is not None else EventLoop()
        self._kv: dict[str, dict[str, int]] = {}  # session -> node -> history tokens its tiers hold
        # node -> session -> tokens in the engine's prefix cache (LRU first), bounded by its KV capacity
        self._engine_cache: dict[str, OrderedDict[str, int]] = {node_id: OrderedDict() for node_id in engines}
        self._engine_cache_tokens: dict[str, int] = dict.fromkeys(engines, 0)
        self._advised: dict[str, str] = {}  # session -> node its advisory picked
        # (session, node) -> when an advisory's move there ends; bounded by the moves under way
        self._moves_due: dict[tuple[str, str], float] = {}
        # The scheduler's held-back queue, tenants' weights and shares included (`[quotas]`; None:
        # its defaults, every tenant weighing 1 with no share of its own).
        self._queue: HeldQueue[_Held] = HeldQueue(max_queued_requests, quotas, max_queue_wait_s)
        self._slots = SlotRate()  # how fast engine slots free up, as the scheduler's dispatcher counts
        self._inflight: dict[str, int] = dict.fromkeys(self.engines, 0)
        self._announced: dict[str, int] = dict.fromkeys(self.engines, 0)
        # As the scheduler's session table: high-priority sessions per node their last turn went to.
        self._high_node: dict[str, str] = {}  # session -> node, while its last turn ran at high priority
        self._high_sessions: Counter[str] = Counter()
        self._stepping: set[str] = set()
        self._step_ends: dict[str, float] = {}  # node -> when its current step ends
        self.requests: list[SimRequest] = []
        self.refused: list[SimRequest] = []
        self._ids = itertools.count()
        self._scripts: dict[str, tuple[Script, int]] = {}  # session -> (its script, the turn in flight)
        # request id -> its submitter's callbacks: answered, refused (None: not told)
        self._on_done: dict[int, tuple[Callable[[SimRequest], None], Callable[[SimRequest], None] | None]] = {}
        self._until_ms: float | None = None

    def seed_kv(self, session: str, node_id: str, tokens: int) -> None:
        """History the session's KV already holds on `node_id`'s tiers when the simulation starts."""
        kv = self._kv.setdefault(session, {})
        kv[node_id] = max(kv.get(node_id, 0), tokens)

    # -- the loop --------------------------------------------------------------------------------
    @property
    def now_ms(self) -> float:
        return self.loop.now_ms

    def at(self, time_ms: float, action: Callable[[], None]) -> None:
        self.loop.at(time_ms, action)

    def run(
        self, turns: Iterable[Turn] = (), scripts: Iterable[Script] = (), until_ms: float | None = None
    ) -> SimResult:
        """Open-loop `turns` at their times, and closed-loop `scripts` (each turn once the last one
        is answered and the user has thought); with `until_ms`, no turn arrives after it (those in
        flight still finish)."""
        self.start(turns, scripts, until_ms)
        self.loop.run()
        return self.result()

    def start(self, turns: Iterable[Turn] = (), scripts: Iterable[Script] = (), until_ms: float | None = None) -> None:
        """`run`'s first half, for a loop that someone else runs."""
        self._until_ms = until_ms
        for turn in sorted(turns, key=lambda t: t.arrival_ms):
            self._schedule(turn)
        for script in scripts:
            if script.steps:
                first = script.steps[0]
                self._schedule(
                    Turn(
                        script.session,
                        script.start_ms,
                        first.new_tokens,
                        first.output_tokens,
                        script.start_ms - first.typing_ms if first.advised else None,
                        script.tenant,
                        script.priority,
                    )
                )
                self._scripts[script.session] = (script, 0)

    def result(self) -> SimResult:
        return SimResult(
            self.requests,
            {n: e.busy_ms for n, e in self.engines.items()},
            sum(e.preemptions for e in self.engines.values()),
            self.refused,
        )

    def load(self) -> tuple[list[NodeSnapshot], int]:
        """The nodes' snapshots and the requests held back, as a region's summary reads them."""
        return self._snapshots(), len(self._queue)

    def kv_of(self, session: str) -> dict[str, int]:
        """Node -> tokens of `session`'s history its tiers hold."""
        return dict(self._kv.get(session, {}))

    def retract(self, session: str) -> None:
        """`session`'s advisory here will not be followed: its request went elsewhere."""
        if (node := self._advised.pop(session, None)) is not None:
            self._announced[node] -= 1

    # -- routing ---------------------------------------------------------------------------------
    def _snapshots(self) -> list[NodeSnapshot]:
        return [
            NodeSnapshot(
                node_id,
                True,
                len(engine.running),
                len(engine.waiting),
                self._inflight[node_id],
                engine.kv_usage,
                announced=self._announced[node_id],
                high_sessions=self._high_sessions[node_id],
                prefilling=engine.prefilling,
                prefilling_work=engine.prefilling_work,
                kv_tokens=engine.model.kv_blocks * engine.model.block_size,  # as a node reports it
                # max_running left unknown (0), as a live scheduler without engine.max_num_seqs
                # set: the engines' waiting counts here are exact, never a step late.
            )
            for node_id, engine in self.engines.items()
        ]

    def _route_request(self, turn: Turn) -> RouteRequest:
        """What the scheduler gives the policy, from what a cluster KV index would report: per node,
        the session's history its tiers hold, the part in the engine's prefix cache first."""
        kv = self._kv.get(turn.session, {})
        held = {}
        for node_id, tokens in kv.items():
            engine = min(self._engine_cache[node_id].get(turn.session, 0), tokens)
            held[node_id] = HeldPrefix(engine=engine, dram=tokens - engine)
        return RouteRequest(
            turn.tenant,
            turn.session,
            "model",
            turn.priority,
            turn.prompt_tokens,
            dict(kv),
            prompt_tokens=turn.prompt_tokens,
            held=held,
        )

    def submit(
        self, turn: Turn, on_done: Callable[[SimRequest], None], on_refused: Callable[[SimRequest], None] | None = None
    ) -> None:
        """A turn that another part of the workload schedules (an agent's step, once its predecessors
        are done): handled like any turn; `on_done` runs when its answer is complete, `on_refused`
        if it is refused (429, 503, or too big for the engine)."""
        if (request_id := self._schedule(turn)) is not None:
            self._on_done[request_id] = (on_done, on_refused)

    def advise(self, turn: Turn) -> str | None:
        """An advisory for `turn` now (an agent framework's predecessor hint, naming no arrival).
        Returns its node (None: the policy does not act on advisories)."""
        return self._advise(turn)

    def _schedule(self, turn: Turn) -> int | None:
        if self._until_ms is not None and turn.arrival_ms > self._until_ms:
            return None
        if turn.advisory_ms is not None and turn.advisory_ms < turn.arrival_ms:
            self.at(max(turn.advisory_ms, self.now_ms), lambda: self._advise(turn))
        request_id = next(self._ids)
        self.at(turn.arrival_ms, lambda: self._arrive(request_id, turn))
        return request_id

    def _next_turn(self, request: SimRequest) -> None:
        """A scripted session's answer is complete: its user reads, types, and sends the next turn."""
        entry = self._scripts.get(request.session)
        if entry is None:
            return
        script, index = entry
        if index + 1 >= len(script.steps):
            del self._scripts[request.session]
            following = script.after
            if following is not None and following.steps:
                first = following.steps[0]
                arrival = self.now_ms + first.think_ms
                self._scripts[following.session] = (following, 0)
                self._schedule(
                    Turn(
                        following.session,
                        arrival,
                        first.new_tokens,
                        first.output_tokens,
                        arrival - first.typing_ms if first.advised else None,
                        following.tenant,
                        following.priority,
                    )
                )
            return
        step = script.steps[index + 1]
        self._scripts[request.session] = (script, index + 1)
        arrival = self.now_ms + step.think_ms
        history = request.prompt_tokens + request.generated
        if step.history_tokens is not None:
            history = min(history, step.history_tokens)
        self._schedule(
            Turn(
                script.session,
                arrival,
                history + step.new_tokens,
                step.output_tokens,
                arrival - step.typing_ms if step.advised else None,
                script.tenant,
                script.priority,
                history if step.history_tokens is not None else None,
            )
        )

    def _advise(self, turn: Turn) -> str | None:
        previous = self._advised.pop(turn.session, None)  # replaced: no longer load about to land
        if previous is not None:
            self._announced[previous] -= 1
        if not self.policy.traits.prefetch_on_advisory:
            return None  # as the scheduler: a baseline without advisories accepts them, to no effect
        # The workload's advisories and hints name no arrival: their lead is the scheduler's guess.
        request = replace(self._route_request(turn), lead_ms=self.typing_lead_ms)
        node_id = advisory_choice(self.policy, request, self._snapshots()).node_id
        if node_id is None:
            return None
        self._advised[turn.session] = node_id
        self._announced[node_id] += 1
        held = self._kv.get(turn.session, {})
        source = kv_source(held, node_id)
        if source is not None:
            tokens = source[1]
            move = (turn.session, node_id)
            due = self.now_ms + self.link.move_ms(tokens - held.get(node_id, 0))
            self._moves_due[move] = due

            def moved() -> None:
                kv = self._kv.setdefault(turn.session, {})
                kv[node_id] = max(kv.get(node_id, 0), tokens)
                if self._moves_due.get(move) == due:  # not superseded by a later move there
                    del self._moves_due[move]

            self.at(due, moved)
        return node_id

    def _arrive(self, request_id: int, turn: Turn) -> None:
        request = SimRequest(
            request_id,
            turn.session,
            turn.arrival_ms,
            turn.prompt_tokens,
            turn.output_tokens,
            priority_rank=PRIORITY_RANK[turn.priority],
        )
        self.requests.append(request)
        advised = self._advised.pop(turn.session, None)
        if advised is not None:
            self._announced[advised] -= 1
        held = _Held(request, turn, Routing(self._route_request(turn), advised))
        if self._queue.ahead_of(turn.priority):
            self._hold(held)  # no jumping the queue of its own tier or a higher one
        else:
            self._attempt(held, front=False)

    def _attempt(self, held: _Held, front: bool) -> None:
        """Route `held` now, or hold it back (`front`: at the head of its tier, as a request the
        scheduler woke that found no room again)."""
        placement = held.routing.attempt(self.policy, self._snapshots())
        if placement.node_id is not None:
            self._dispatch(held, placement.node_id)
        elif placement.queue:
            self._hold(held, front)
        else:
            self._refuse(held.request)  # no node serves it: the scheduler answers 503

    def _hold(self, held: _Held, front: bool = False) -> None:
        slots_per_s = self._slots.per_s(self.now_ms, sum(self._inflight.values()), len(self._queue))
        try:
            self._queue.push(held, held.turn.priority, held.turn.tenant, front=front, slots_per_s=slots_per_s)
        except QueueFull:
            self._refuse(held.request)  # the scheduler answers 429
        except Overloaded:
            self._refuse(held.request)  # the scheduler answers 503 (overloaded)

    def _wake_held(self) -> None:
        """Room may have opened: as many held-back requests as there are nodes with nothing waiting
        try again, in the queue's order."""
        if len(self._queue):
            for held in self._queue.take(rooms(self._snapshots())):
                self._attempt(held, front=True)

    def _refuse(self, request: SimRequest) -> None:
        self.refused.append(request)
        self._scripts.pop(request.session, None)  # its user gets an error and leaves
        if (on_refused := self._on_done.pop(request.request_id, (None, None))[1]) is not None:
            on_refused(request)

    def _cache(self, node_id: str, session: str, tokens: int) -> None:
        cache = self._engine_cache[node_id]
        before = cache.pop(session, 0)
        cache[session] = max(before, tokens)
        total = self._engine_cache_tokens[node_id] + cache[session] - before
        model = self.engines[node_id].model
        while total > model.kv_blocks * model.block_size and len(cache) > 1:
            total -= cache.popitem(last=False)[1]
        self._engine_cache_tokens[node_id] = total

    def _dispatch(self, held: _Held, node_id: str) -> None:
        request, session = held.request, held.turn.session
        delay_ms = self.engines[node_id].model.request_overhead_ms + self._pull_wait(held.routing.request, node_id)
        self.policy.observe(held.routing.request, node_id)
        self._served(session, node_id, high=held.turn.priority == Priority.HIGH)
        cached = self._engine_cache[node_id].get(session, 0) if self.prefix_caching else 0
        if self.policy.traits.uses_tiers:
            cached = max(cached, self._kv.get(session, {}).get(node_id, 0))
        if held.turn.history_tokens is not None:
            cached = min(cached, held.turn.history_tokens)
        request.cached_tokens = min(cached, request.prompt_tokens)
        self._inflight[node_id] += 1
        request.sent_ms = self.now_ms
        if delay_ms:
            self.at(self.now_ms + delay_ms, lambda: self._enqueue(request, node_id))
        else:
            self._enqueue(request, node_id)

    def _served(self, session: str, node_id: str, high: bool) -> None:
        """As the scheduler's session table: a session counts as high on the node of its last turn
        while that turn ran at high priority."""
        previous = self._high_node.pop(session, None)
        if previous is not None:
            self._high_sessions[previous] -= 1
        if high:
            self._high_node[session] = node_id
            self._high_sessions[node_id] += 1

    def _pull_wait(self, request: RouteRequest, node_id: str) -> float:
        """How long `request` waits, routed to `node_id`, for the pull the scheduler's `PullRule`
        plans (from the session's KV as routing saw it). It takes the move time of what the node
        lacks; a move there under way ends when it was due, as the node's pull joins it. A pull that
        lands in time brings the node's copy up to the source's."""
        pull = self.pulls.plan(self.policy.traits, request.kv_tokens, node_id)
        if pull is None or request.session_id is None:
            return 0.0
        kv = self._kv.setdefault(request.session_id, {})
        pull_ms = self.link.move_ms(max(0, pull.tokens - kv.get(node_id, 0)))
        due = self._moves_due.get((request.session_id, node_id))
        if due is not None:  # an advisory's move there is under way: the node's pull joins it
            pull_ms = min(pull_ms, due - self.now_ms)
        if pull.lands(pull_ms):
            kv[node_id] = max(kv.get(node_id, 0), pull.tokens)
        return pull.waited_ms(pull_ms)

    def _enqueue(self, request: SimRequest, node_id: str) -> None:
        self.engines[node_id].add(request)
        self._kick(node_id)

    # -- engines ---------------------------------------------------------------------------------
    def _kick(self, node_id: str) -> None:
        engine = self.engines[node_id]
        if node_id in self._stepping or not engine.has_work():
            return
        plan = engine.step()
        for refused in plan.refused:
            self._inflight[node_id] -= 1
            self._refuse(refused)
        if not plan.first_tokens and not plan.decoded:
            return  # nothing could run: what waits needs blocks that only a finishing request frees
        slowdown = engine.model.neighbour_slowdown
        if slowdown and len(self.engines) > 1:
            # Neighbours whose step ends later (one ending at this very moment is done).
            busy = sum(1 for other in self._stepping if self._step_ends[other] > self.now_ms)
            plan.duration_ms *= 1 + slowdown * busy / (len(self.engines) - 1)
        self._stepping.add(node_id)
        self._step_ends[node_id] = self.now_ms + plan.duration_ms
        self.at(self.now_ms + plan.duration_ms, lambda: self._step_done(node_id, plan))

    def _step_done(self, node_id: str, plan: StepPlan) -> None:
        self._stepping.discard(node_id)
        for request in self.engines[node_id].finish_step(plan, self.now_ms):
            self._inflight[node_id] -= 1
            sent_ms = request.sent_ms if request.sent_ms is not None else self.now_ms
            self._slots.ended(self.now_ms, self.now_ms - sent_ms)
            # The turn's KV stays on the node that computed it: its prompt and answer but the last
            # answer token, which is never fed back. The node's tiers keep all of it (the connector
            # saves the partial last block too); the engine's prefix cache only whole blocks, as
            # vLLM hashes and finds them (the live engines' cached_tokens: always a multiple of 32).
            computed = request.prompt_tokens + request.generated - 1
            kv = self._kv.setdefault(request.session, {})
            kv[node_id] = max(kv.get(node_id, 0), computed)
            block_size = self.engines[node_id].model.block_size
            self._cache(node_id, request.session, computed // block_size * block_size)
            self._next_turn(request)
            if (callbacks := self._on_done.pop(request.request_id, None)) is not None:
                callbacks[0](request)
        self._wake_held()
        for other in self.engines:
            self._kick(other)

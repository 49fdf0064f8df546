"""A discrete-event simulation of a cluster of engines, routed by the real scheduler policies.

The loop keeps one heap of timed events: a request arriving (it is routed at once, by the policy
object `scheduler.policies` builds, through the same `RouteRequest`/`NodeSnapshot` values the
scheduler gives it), an advisory (for policies that prefetch on advisories, the policy picks the
node ahead of the request and the session's KV starts moving there), a KV move ending, an engine step
ending. What a request finds in the engine's KV when it is admitted is what its session's KV holds
on that node: history a move brought, or its last turn left there. As in the scheduler, a request
sent to a node that lacks its KV (no advisory moved it there, or the advisory's move is still under
way) first waits for a pull (bounded), which joins the move if one runs.

Selective pushing: a decision that says "queue" parks the request in the scheduler's queue (FIFO
within a priority tier, as the scheduler's `PushQueue`); parked requests are routed again whenever
an engine step ends.

Kept simple on purpose, and said so: a node's tiers keep every session's KV that reached it (assumed
large enough), a move's time is the history's bytes over the link's bandwidth plus its RTT, and KV
loaded from a node's own tiers is as good as cached (the connector loads it layer by layer under the
forward pass; bench resume measures that within 1.15x of a prefix-cache hit). Policies without the
tiers (`recompute`) find only the engine's own prefix cache: finished requests' KV in whole blocks,
least recently used first out, within the engine's KV capacity.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from eval.sim.engine import EngineModel, SimEngine, SimRequest, StepPlan
from scheduler.routing import (
    PRIORITIES,
    PRIORITY_RANK,
    NodeSnapshot,
    RouteRequest,
    RoutingPolicy,
    advisory_holds,
    kv_source,
)
from symphony.config import SchedulerConfig

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
class Turn:
    """One request of the workload: its arrival, and an advisory ahead of it (None: no advisory)."""

    session: str
    arrival_ms: float
    prompt_tokens: int  # the whole prompt: the session's history plus the new message
    output_tokens: int
    advisory_ms: float | None = None
    tenant: str = "default"
    priority: str = "normal"


@dataclass(frozen=True, slots=True)
class Step:
    """One turn of a scripted (closed-loop) session: the user's think time starts when the previous
    answer is complete, so the turn's arrival depends on how fast the cluster answered."""

    new_tokens: int  # the message the user adds to the history
    output_tokens: int
    think_ms: float  # after the previous answer: reading it, then typing this message
    typing_ms: float  # the last part of think_ms: the advisory fires when typing starts
    advised: bool = True


@dataclass(frozen=True, slots=True)
class Script:
    session: str
    start_ms: float  # the first turn's arrival
    steps: tuple[Step, ...]
    tenant: str = "default"
    priority: str = "normal"
    # The same user's next conversation (a new session): its first turn arrives its first step's
    # think time after this one's last answer.
    after: Script | None = None


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
    ) -> None:
        self.policy = policy
        self.route_pull_wait_ms = route_pull_wait_ms
        self.route_pull_min_tokens = route_pull_min_tokens
        self.engines = {
            node_id: SimEngine(node_id, model, engine_priority_scheduling) for node_id, model in engines.items()
        }
        self.link = link
        self.now_ms = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties run in the order they were scheduled
        self._kv: dict[str, dict[str, int]] = {}  # session -> node -> history tokens its tiers hold
        # node -> session -> tokens in the engine's prefix cache (LRU first), bounded by its KV capacity
        self._engine_cache: dict[str, OrderedDict[str, int]] = {node_id: OrderedDict() for node_id in engines}
        self._engine_cache_tokens: dict[str, int] = dict.fromkeys(engines, 0)
        self._advised: dict[str, str] = {}  # session -> node its advisory picked
        # (session, node) -> when an advisory's move there ends; bounded by the moves under way
        self._moves_due: dict[tuple[str, str], float] = {}
        self._queue: deque[tuple[SimRequest, Turn]] = deque()
        self._inflight: dict[str, int] = dict.fromkeys(self.engines, 0)
        self._announced: dict[str, int] = dict.fromkeys(self.engines, 0)
        self._stepping: set[str] = set()
        self._step_ends: dict[str, float] = {}  # node -> when its current step ends
        self.requests: list[SimRequest] = []
        self.refused: list[SimRequest] = []
        self._ids = itertools.count()
        self._scripts: dict[str, tuple[Script, int]] = {}  # session -> (its script, the turn in flight)
        self._on_done: dict[int, Callable[[SimRequest], None]] = {}  # request id -> its submitter's callback
        self._until_ms: float | None = None

    def seed_kv(self, session: str, node_id: str, tokens: int) -> None:
        """History the session's KV already holds on `node_id`'s tiers when the simulation starts."""
        kv = self._kv.setdefault(session, {})
        kv[node_id] = max(kv.get(node_id, 0), tokens)

    # -- the loop --------------------------------------------------------------------------------
    def at(self, time_ms: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time_ms, next(self._order), action))

    def run(
        self, turns: Iterable[Turn] = (), scripts: Iterable[Script] = (), until_ms: float | None = None
    ) -> SimResult:
        """Open-loop `turns` at their times, and closed-loop `scripts` (each turn once the last one
        is answered and the user has thought); with `until_ms`, no turn arrives after it (those in
        flight still finish)."""
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
        while self._events:
            self.now_ms, _, action = heapq.heappop(self._events)
            action()
        return SimResult(
            self.requests,
            {n: e.busy_ms for n, e in self.engines.items()},
            sum(e.preemptions for e in self.engines.values()),
            self.refused,
        )

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
                prefilling=engine.prefilling,
            )
            for node_id, engine in self.engines.items()
        ]

    def _route_request(self, turn: Turn) -> RouteRequest:
        return RouteRequest(
            turn.tenant, turn.session, "model", turn.priority, turn.prompt_tokens, dict(self._kv.get(turn.session, {}))
        )

    def submit(self, turn: Turn, on_done: Callable[[SimRequest], None]) -> None:
        """A turn that another part of the workload schedules (an agent's step, once its predecessors
        are done): handled like any turn, and `on_done` runs when its answer is complete."""
        request_id = self._schedule(turn)
        if request_id is not None:
            self._on_done[request_id] = on_done

    def advise(self, turn: Turn) -> None:
        """An advisory for `turn` now (an agent framework's predecessor hint)."""
        self._advise(turn)

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
        prompt = request.prompt_tokens + request.generated + step.new_tokens
        self._schedule(
            Turn(
                script.session,
                arrival,
                prompt,
                step.output_tokens,
                arrival - step.typing_ms if step.advised else None,
                script.tenant,
                script.priority,
            )
        )

    def _advise(self, turn: Turn) -> None:
        if not self.policy.traits.prefetch_on_advisory:
            return  # as the scheduler: a baseline without advisories accepts them, to no effect
        request = self._route_request(turn)
        decision = self.policy.choose(request, self._snapshots())
        node_id = decision.node_id
        if node_id is None:  # queued: an advisory reserves no slot, so the least loaded takes it
            node_id = min(self._snapshots(), key=lambda n: (n.load, n.node_id)).node_id
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
            if advisory_holds(advised, self._snapshots()):
                self._dispatch(request, turn, advised)
                return
        self._route(request, turn)

    def _route(self, request: SimRequest, turn: Turn) -> None:
        rank = PRIORITIES.index(turn.priority)
        if any(PRIORITIES.index(queued.priority) >= rank for _, queued in self._queue):
            self._park(request, turn)  # no jumping the queue of its own tier or a higher one
            return
        decision = self.policy.choose(self._route_request(turn), self._snapshots())
        if decision.node_id is None:
            self._park(request, turn)
        else:
            self._dispatch(request, turn, decision.node_id)

    def _cache(self, node_id: str, session: str, tokens: int) -> None:
        cache = self._engine_cache[node_id]
        before = cache.pop(session, 0)
        cache[session] = max(before, tokens)
        total = self._engine_cache_tokens[node_id] + cache[session] - before
        model = self.engines[node_id].model
        while total > model.kv_blocks * model.block_size and len(cache) > 1:
            total -= cache.popitem(last=False)[1]
        self._engine_cache_tokens[node_id] = total

    def _park(self, request: SimRequest, turn: Turn) -> None:
        """The scheduler's queue: higher priority tiers first, FIFO within a tier."""
        rank = PRIORITIES.index(turn.priority)
        at = len(self._queue)
        for index, (_, queued) in enumerate(self._queue):
            if PRIORITIES.index(queued.priority) < rank:
                at = index
                break
        self._queue.insert(at, (request, turn))

    def _dispatch(self, request: SimRequest, turn: Turn, node_id: str) -> None:
        self.policy.observe(self._route_request(turn), node_id)
        delay_ms = self.engines[node_id].model.request_overhead_ms + self._pull_for_request(turn.session, node_id)
        held = self._engine_cache[node_id].get(turn.session, 0)
        if self.policy.traits.uses_tiers:
            held = max(held, self._kv.get(turn.session, {}).get(node_id, 0))
        request.cached_tokens = min(held, request.prompt_tokens)
        self._inflight[node_id] += 1
        if delay_ms:
            self.at(self.now_ms + delay_ms, lambda: self._enqueue(request, node_id))
        else:
            self._enqueue(request, node_id)

    def _pull_for_request(self, session: str, node_id: str) -> float:
        """As the scheduler's dispatcher: a request sent to a node holding less of its session's KV than
        another one (no advisory moved it there, or the move is still under way) waits for the KV to be
        pulled over, at most route_pull_wait_ms (a pull later than that brings nothing in time). A
        move under way ends when it was due, as the node's pull joins it. Returns the wait."""
        if not self.policy.traits.prefetch_on_advisory or self.route_pull_wait_ms <= 0:
            return 0.0
        kv = self._kv.get(session, {})
        source = kv_source(kv, node_id, self.route_pull_min_tokens)
        if source is None:
            return 0.0
        pull_ms = self.link.move_ms(source[1] - kv.get(node_id, 0))
        due = self._moves_due.get((session, node_id))
        if due is not None:  # an advisory's move there is under way: the node's pull joins it
            pull_ms = min(pull_ms, due - self.now_ms)
        if pull_ms > self.route_pull_wait_ms:
            return self.route_pull_wait_ms
        kv[node_id] = source[1]
        return pull_ms

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
            self.refused.append(refused)
            self._scripts.pop(refused.session, None)  # its user gets an error and leaves
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
            callback = self._on_done.pop(request.request_id, None)
            if callback is not None:
                callback(request)
        while self._queue:  # the scheduler's queue, head first, until its head finds no room
            request, turn = self._queue[0]
            decision = self.policy.choose(self._route_request(turn), self._snapshots())
            if decision.node_id is None:
                break
            self._queue.popleft()
            self._dispatch(request, turn, decision.node_id)
        for other in self.engines:
            self._kick(other)

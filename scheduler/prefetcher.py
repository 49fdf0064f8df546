"""Moving a session's KV ahead of its request: the scheduler asks the chosen node's manager for a
top-tier prefetch (from its own tiers, or pulled from the node that holds the KV) and follows it to
the end, so that the request can tell whether its KV was ready when it arrived.

The advisory's answer never waits for any of it (an advisory is answered in milliseconds, the
move takes as long as it takes). Bounded: at most `max_inflight` prefetches are followed at once;
beyond that an advisory still routes, but moves nothing (counted)."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

import grpc

from scheduler.decisions import Pull
from scheduler.metrics import SchedulerMetrics
from scheduler.sessions import SessionKey
from symphony.logs import get_logger
from symphony.priority import Priority
from symphony.rpc import kv_pb2, kv_pb2_grpc
from symphony.tenancy import engine_cache_salt

log = get_logger(__name__)

_TARGETS = {"hbm": kv_pb2.TIER_HBM, "dram": kv_pb2.TIER_DRAM}
# How long a finished move of a session to a node counts as still in place: a repeated advisory
# for the same history within it moves nothing. Short, because the node may evict the KV later
# (the request then loads it from a lower tier, as without an advisory).
MOVE_FRESH_S = 10.0
_FINAL = {
    kv_pb2.PREFETCH_STATE_DONE,
    kv_pb2.PREFETCH_STATE_PARTIAL,
    kv_pb2.PREFETCH_STATE_CANCELLED,
    kv_pb2.PREFETCH_STATE_FAILED,
}
FOLLOW_WAIT_MS = 30_000  # one GetPrefetch long-poll
FOLLOW_GRACE_S = 30.0  # past a prefetch's deadline, how long it is still followed


class MoveState(StrEnum):
    """A followed move: PENDING, then one of the others. DONE and PARTIAL moved KV (the session
    table learns of it); the node's own final states keep their names."""

    PENDING = "pending"
    DONE = "done"
    PARTIAL = "partial"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"  # no final state by the deadline (plus grace): the node is told to drop it
    NOT_FOUND = "not_found"  # neither the node nor the peer knows the session: nothing to move
    IN_ENGINE = "in_engine"  # not asked: the node's engine cache held the session's last prompt

    @classmethod
    def of_node(cls, state: int) -> MoveState:
        """The node's final `symphony.v1.PrefetchState`."""
        return cls(kv_pb2.PrefetchState.Name(state).removeprefix("PREFETCH_STATE_").lower())


@dataclass(slots=True)
class Prefetch:
    """One session's move to one node, as the scheduler follows it."""

    session: SessionKey
    node_id: str
    history_tokens: int  # of the session's history, what the move was asked for
    started_at: float
    finished_at: float | None = None
    state: MoveState = MoveState.PENDING
    prefetch_id: str = ""  # the node's id for the move, once it answered
    task: asyncio.Task[None] | None = None  # what follows it
    source: str = ""  # the node it pulls from; "": from the node's own tiers
    near: str = ""  # a node of the target's region the first blocks come from, before `source`
    target: str = "hbm"  # the tier it brings the KV to: "hbm" (ending in a warm-up) or "dram"
    # Of the pages the node's job left in the target tier, those it fetched from the peer (final status).
    pages_in_target: int = 0
    pages_from_peer: int = 0

    @property
    def ready(self) -> bool:
        """The KV is in the node's top tier (moved there, or in its engine's cache already)."""
        return self.state in (MoveState.DONE, MoveState.IN_ENGINE)


class LatestMoves(OrderedDict[SessionKey, Prefetch]):
    """The latest move per advised session (what its request will find), least recent first,
    bounded: past `max_sessions` the oldest go."""

    def __init__(self, max_sessions: int) -> None:
        super().__init__()
        self.max_sessions = max_sessions

    def record(self, prefetch: Prefetch) -> None:
        self[prefetch.session] = prefetch
        self.move_to_end(prefetch.session)
        while len(self) > self.max_sessions:
            self.popitem(last=False)

    def fresh(self, session: SessionKey, node_id: str, history_tokens: int, now: float) -> bool:
        """Whether the session's KV, `history_tokens` of it at least, reached `node_id`'s top tier
        within `MOVE_FRESH_S` of `now` (monotonic s): moving it again would cost the node a warm-up
        pass for nothing (a typing user re-advises every few seconds)."""
        move = self.get(session)
        return (
            move is not None
            and move.node_id == node_id
            and move.ready
            and move.history_tokens >= history_tokens
            and move.finished_at is not None
            and now - move.finished_at <= MOVE_FRESH_S
        )


class Prefetcher:
    def __init__(
        self,
        stub_for: Callable[[str], kv_pb2_grpc.KVStoreStub | None],
        address_of: Callable[[str], str | None],
        metrics: SchedulerMetrics,
        max_inflight: int,
        on_moved: Callable[[SessionKey, str, int, str], None],
        on_pulled: Callable[[str, str, int, float], None] | None = None,
        salt_key: bytes = b"",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stub_for = stub_for
        self._salt_key = salt_key  # the cluster's secret: keys the warm-ups' cache salts
        self._address_of = address_of  # a node's manager address, for a peer to pull from (None: gone)
        self._metrics = metrics
        self._max_inflight = max_inflight
        self._on_moved = on_moved
        # A pull from a peer into DRAM finished in full: (source node, node, tokens it fetched, ms
        # from the first request for that node job to its end). Once per job: a later request that
        # joins a running job (the node hands back its id) is not a second sample of the link.
        self._on_pulled = on_pulled
        # Node job id -> (earliest start, the peers of the move that started it: its source and
        # near node); popped at its end. A later move joins the job with the first one's peers.
        self._job_started: dict[str, tuple[float, str, str]] = {}
        self._clock = clock
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    def start(
        self,
        session: SessionKey,
        node_id: str,
        source: str,
        deadline_ms: int,
        priority: Priority,
        history_tokens: int,
        target: Literal["hbm", "dram"] = "hbm",
        max_blocks: int = 0,
        near: tuple[str, int] | None = None,
    ) -> Prefetch | None:
        """Ask `node_id` to bring the session's KV into its `target` tier (pulling what it lacks from
        node `source`, if given) by `deadline_ms` from now. Returns at once.
        "hbm" ends in the engine's own prefix cache (a warm-up pass), for a request still to come;
        "dram" only brings the pages to the node, for a request about to be sent there, whose own
        prefill loads them. `max_blocks` > 0: pull only the session's first blocks (another
        request's shared prefix). `near`: (node, blocks), a node of `node_id`'s region holding the
        session's first blocks, pulled from before `source` (another region's node), which then
        sends only the rest; left out if that node has no address."""
        stub = self._stub_for(node_id)
        address = self._address_of(source) if source else ""
        near_address = self._address_of(near[0]) if near is not None and source else None
        if stub is None or address is None:
            self._metrics.prefetches.labels("skipped_gone").inc()  # the node or the source left
            return None
        if len(self._tasks) >= self._max_inflight:
            self._metrics.prefetches.labels("skipped_busy").inc()
            return None
        prefetch = Prefetch(session, node_id, history_tokens, self._clock(), source=source, target=target)
        request = kv_pb2.PrefetchRequest(
            session=kv_pb2.SessionRef(tenant=session[0], session_id=session[1]),
            target_tier=_TARGETS[target],
            deadline_ms=deadline_ms,
            priority=priority.proto,
            source_peer=address,
            max_blocks=max_blocks,
        )
        if near is not None and near_address and near_address != address and near[1] > 0:
            request.near_peer, request.near_blocks = near_address, near[1]
            prefetch.near = near[0]
        if target == "hbm":
            # The salt of the session's next request: the warm-up must land where that request's
            # prefix-cache lookup will look. Only there: a node refuses a salt with any other target
            # (INVALID_ARGUMENT), which failed every pull a request waited for until this was split.
            request.engine_cache_salt = engine_cache_salt(session[0], key=self._salt_key)
        task = asyncio.create_task(self._follow(stub, request, prefetch), name=f"prefetch-{session[1]}")
        prefetch.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return prefetch

    async def pull(
        self,
        session: SessionKey,
        node_id: str,
        pull: Pull,
        priority: Priority,
        max_blocks: int = 0,
    ) -> str:
        """Have `node_id` pull the session's KV (its first `max_blocks` blocks, if > 0) from node
        `pull.source` into its DRAM, and wait for it, at most `pull.wait_ms`. How it
        went: ready (arrived), late (still running: it carries on, and the pages may land before
        the engine's prefill reaches those blocks; its follower ends it by its deadline), failed, or
        not_started (no follow slot, or either node gone)."""
        wait_ms = int(pull.wait_ms)
        prefetch = self.start(session, node_id, pull.source, wait_ms, priority, pull.tokens, "dram", max_blocks)
        if prefetch is None or prefetch.task is None:
            return "not_started"
        done, _ = await asyncio.wait({asyncio.shield(prefetch.task)}, timeout=wait_ms / 1000)
        return "late" if not done else "ready" if prefetch.state in ("done", "partial") else "failed"

    async def _follow(self, stub: kv_pb2_grpc.KVStoreStub, request: kv_pb2.PrefetchRequest, prefetch: Prefetch) -> None:
        try:
            # Followed until its deadline and a grace period at most: a node stuck on a move must not
            # hold one of the bounded follow slots for ever.
            async with asyncio.timeout(request.deadline_ms / 1000 + FOLLOW_GRACE_S):
                status = await stub.Prefetch(request, timeout=10)
                prefetch.prefetch_id = status.prefetch_id
                self._job_started.setdefault(status.prefetch_id, (prefetch.started_at, prefetch.source, prefetch.near))
                while status.state not in _FINAL:
                    status = await stub.GetPrefetch(
                        kv_pb2.PrefetchRef(prefetch_id=status.prefetch_id, wait_ms=FOLLOW_WAIT_MS),
                        timeout=FOLLOW_WAIT_MS / 1000 + 10,
                    )
            state = MoveState.of_node(status.state)
            prefetch.pages_in_target, prefetch.pages_from_peer = status.pages_in_target, status.pages_from_peer
            if status.error:
                log.debug(
                    "prefetch ended",
                    session=prefetch.session[1],
                    node=prefetch.node_id,
                    state=state,
                    error=status.error,
                )
        except TimeoutError:
            state = MoveState.TIMED_OUT
            self._cancel_at_node(stub, prefetch)
        except grpc.aio.AioRpcError as exc:
            # NOT_FOUND: neither the node nor the peer knows the session (a first turn): nothing to move.
            state = MoveState.NOT_FOUND if exc.code() == grpc.StatusCode.NOT_FOUND else MoveState.FAILED
            if state == MoveState.FAILED:
                log.info(
                    "prefetch failed",
                    session=prefetch.session[1],
                    node=prefetch.node_id,
                    error=f"{exc.code().name}: {exc.details()}",
                )
        except asyncio.CancelledError:
            self._finish(prefetch, MoveState.CANCELLED)
            raise
        except Exception as exc:  # a follower must end with a state, whatever went wrong
            log.warning(
                "prefetch follow failed",
                session=prefetch.session[1],
                node=prefetch.node_id,
                error=f"{type(exc).__name__}: {exc}",
            )
            state = MoveState.FAILED
        self._finish(prefetch, state)

    def _finish(self, prefetch: Prefetch, state: MoveState) -> None:
        prefetch.state = state
        prefetch.finished_at = self._clock()
        self._metrics.prefetches.labels(state).inc()
        if state in (MoveState.DONE, MoveState.PARTIAL):
            self._on_moved(prefetch.session, prefetch.node_id, prefetch.history_tokens, prefetch.source)
        job = self._job_started.pop(prefetch.prefetch_id, None) if prefetch.prefetch_id else None
        if job is None or state != MoveState.DONE or not self._on_pulled:
            return
        started, source, near = job
        # A job that also pulled from a near node timed two links at once: no sample of either. One
        # started by a move from another source pulled from that one: none of this move's link.
        if (
            prefetch.source
            and source == prefetch.source
            and not near
            and prefetch.target == "dram"
            and prefetch.pages_from_peer
        ):
            # The history's share the node fetched (it pulls only what its tiers lack), in tokens.
            fetched = prefetch.pages_from_peer / max(prefetch.pages_in_target, prefetch.pages_from_peer)
            ms = (prefetch.finished_at - started) * 1000
            self._on_pulled(prefetch.source, prefetch.node_id, round(prefetch.history_tokens * fetched), ms)

    def cancel(self, prefetch: Prefetch) -> None:
        """Stop a move the scheduler no longer wants (its session was advised to another node):
        stop following it and ask its node to drop it."""
        if prefetch.task is not None and not prefetch.task.done():
            prefetch.task.cancel()
        stub = self._stub_for(prefetch.node_id)
        if stub is not None:
            self._cancel_at_node(stub, prefetch)

    def _cancel_at_node(self, stub: kv_pb2_grpc.KVStoreStub, prefetch: Prefetch) -> None:
        if not prefetch.prefetch_id:
            return  # the node never answered: it has no job to cancel, or will finish a harmless one
        call = stub.CancelPrefetch(kv_pb2.PrefetchRef(prefetch_id=prefetch.prefetch_id), timeout=5)
        task = asyncio.ensure_future(call)
        task.add_done_callback(_log_cancel_failure)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _log_cancel_failure(task: asyncio.Future[kv_pb2.PrefetchStatus]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("prefetch cancel failed", error=str(task.exception()))

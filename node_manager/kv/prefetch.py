"""Prefetch queue: move a session's pages up to a target tier before its request arrives.

Jobs run earliest deadline first, higher priority first among equal deadlines. A prefetch is
idempotent per (session, target tier): asking again while one is queued or running returns it (with
the earlier deadline and higher priority of the two). Finished jobs stay queryable in a bounded
table. Lead time (deadline - completion) is what the scheduler needs to know about advisories.

A prefetch to the top tier on a node serving a model ends in the engine itself: once the pages are
in, the queue's `warm` hook (`node_manager.engine_warmup`) has the engine take the history into
its own prefix cache, so the request finds it there like any local prefix hit.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import cast

from node_manager.kv.directory import SessionKey
from node_manager.kv.errors import KVStoreError, StoreBusy
from node_manager.kv.metrics import KVMetrics
from node_manager.kv.pages import Priority, Tier
from node_manager.kv.store import TieredStore
from symphony.logs import get_logger
from symphony.rpc import kv_pb2

log = get_logger(__name__)


class PrefetchState(StrEnum):
    """A job's life: QUEUED -> RUNNING -> one of the finished states (or QUEUED -> CANCELLED)."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"  # every page of the session is in the target tier
    PARTIAL = "partial"  # some are: the rest were missing, rejected or had no room
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def proto(self) -> kv_pb2.PrefetchState:
        """The `symphony.v1.PrefetchState` value."""
        return cast("kv_pb2.PrefetchState", kv_pb2.PrefetchState.Value(f"PREFETCH_STATE_{self.name}"))


QUEUED, RUNNING, DONE, PARTIAL, CANCELLED, FAILED = PrefetchState
FINISHED = frozenset({DONE, PARTIAL, CANCELLED, FAILED})


@dataclass(frozen=True, slots=True)
class PullOutcome:
    pages_received: int
    complete: bool
    error: str = ""


# (tenant, session id, peer address, at most this many leading blocks or 0: all) -> what arrived
Puller = Callable[[str, str, str, int], Awaitable[PullOutcome]]


@dataclass(frozen=True, slots=True)
class WarmOutcome:
    cached_tokens: int  # history tokens the engine's prefix cache holds afterwards
    note: str = ""  # why it holds none: the engine was busy or away, or the warm-up failed


# (tenant, session id, history token ids, cache salt, priority) -> what the engine's prefix cache took
Warm = Callable[[str, str, list[int], str, Priority], Awaitable[WarmOutcome]]


@dataclass(slots=True)
class PrefetchJob:
    id: str
    session: SessionKey
    target: Tier
    deadline: float  # time.monotonic() seconds
    priority: Priority
    source_peer: str = ""
    engine_salt: str = ""  # the cache_salt of the session's next request, for the engine's prefix cache
    max_blocks: int = 0  # pull at most the session's first this many blocks from source_peer; 0: all
    # A peer of this node's region holding the session's first `near_blocks` blocks: pulled from it
    # before source_peer, which then sends only what the near pull left missing.
    near_peer: str = ""
    near_blocks: int = 0
    state: PrefetchState = QUEUED
    pages_in_target: int = 0
    pages_failed: int = 0
    pages_from_peer: int = 0  # both peers' pages
    pages_from_near_peer: int = 0
    pulled: bool = False  # its peers' pulls have run
    lead_time_s: float = 0.0
    error: str = ""
    engine_cached_tokens: int = 0
    engine_note: str = ""
    started_at: float = 0.0  # time.monotonic() when a worker took it
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    def order_key(self) -> tuple[float, int]:
        return (self.deadline, -int(self.priority))


class PrefetchQueueFull(KVStoreError):
    pass


class PrefetchQueue:
    def __init__(
        self,
        store: TieredStore,
        metrics: KVMetrics,
        puller: Puller | None,
        *,
        max_pending: int,
        concurrency: int,
        max_finished: int = 4096,
        warm: Warm | None = None,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._puller = puller
        self._warm = warm
        self._max_pending = max_pending
        self._max_finished = max_finished
        self._heap: list[tuple[tuple[float, int], int, PrefetchJob]] = []
        self._seq = itertools.count()
        self._active: dict[tuple[SessionKey, Tier], PrefetchJob] = {}
        self._jobs: OrderedDict[str, PrefetchJob] = OrderedDict()
        # The latest prefetch of each session that no request has arrived for yet; read by the
        # node-local KV channel's threads, hence its own lock.
        self._awaiting_arrival: OrderedDict[SessionKey, PrefetchJob] = OrderedDict()
        self._arrival_lock = threading.Lock()
        self._wake = asyncio.Event()
        self._workers = [asyncio.create_task(self._work(), name=f"kv-prefetch-{i}") for i in range(concurrency)]

    def submit(
        self,
        session: SessionKey,
        target: Tier,
        deadline_s: float,
        priority: Priority,
        source_peer: str = "",
        engine_salt: str = "",
        max_blocks: int = 0,
        near: tuple[str, int] = ("", 0),
    ) -> PrefetchJob:
        """Queue a prefetch (or return the session's active one to `target`, whose engine salt and
        peers stay; one still queued widens to the blocks asked for now). `near`: (peer, blocks), a
        peer of this region to pull the session's first blocks from before `source_peer`."""
        existing = self._active.get((session, target))
        if existing is not None:
            if existing.state == QUEUED and existing.max_blocks:
                existing.max_blocks = max(existing.max_blocks, max_blocks) if max_blocks else 0
            deadline = time.monotonic() + deadline_s
            if existing.state == QUEUED and (deadline, -int(priority)) < existing.order_key():
                existing.deadline = min(existing.deadline, deadline)
                existing.priority = max(existing.priority, priority)
                self._push(existing)  # the old heap entry is skipped as stale
            return existing
        if len(self._active) >= self._max_pending:
            raise PrefetchQueueFull(f"{len(self._active)} prefetches pending (kv.max_pending_prefetches)")
        job = PrefetchJob(
            uuid.uuid4().hex,
            session,
            target,
            time.monotonic() + deadline_s,
            priority,
            source_peer,
            engine_salt,
            max_blocks,
            *near,
        )
        self._active[(session, target)] = job
        self._jobs[job.id] = job
        with self._arrival_lock:
            self._awaiting_arrival[session] = job
            self._awaiting_arrival.move_to_end(session)
            while len(self._awaiting_arrival) > self._max_finished + self._max_pending:
                self._awaiting_arrival.popitem(last=False)
        while len(self._jobs) > self._max_finished + self._max_pending:
            oldest_id, oldest = next(iter(self._jobs.items()))
            if oldest.state not in FINISHED:
                break
            del self._jobs[oldest_id]
        self._push(job)
        return job

    def _push(self, job: PrefetchJob) -> None:
        heapq.heappush(self._heap, (job.order_key(), next(self._seq), job))
        self._wake.set()

    def claim_arrival(self, session: SessionKey) -> PrefetchJob | None:
        """The session's latest prefetch, once: its request has arrived (prefetch-hit accounting)."""
        with self._arrival_lock:
            return self._awaiting_arrival.pop(session, None)

    def get(self, prefetch_id: str) -> PrefetchJob | None:
        return self._jobs.get(prefetch_id)

    def cancel(self, prefetch_id: str) -> PrefetchJob | None:
        job = self._jobs.get(prefetch_id)
        if job is None or job.state in FINISHED:
            return job
        if job.state == QUEUED:
            self._finish(job, CANCELLED)
        else:
            job.state = CANCELLED  # the running load sees it between layers
        return job

    async def _work(self) -> None:
        while True:
            while not self._heap:
                self._wake.clear()
                await self._wake.wait()
            key, _, job = heapq.heappop(self._heap)
            if job.state != QUEUED or key != job.order_key():
                continue  # cancelled, already taken, or re-queued with a new key
            job.state = RUNNING
            job.started_at = time.monotonic()
            try:
                await self._run(job)
            except KVStoreError as exc:
                job.error = str(exc)
                self._finish(job, FAILED)
            except Exception as exc:  # a prefetch is best effort; one failure must not stop the queue
                log.warning("prefetch failed", prefetch=job.id, error=repr(exc))
                job.error = repr(exc)
                self._finish(job, FAILED)

    async def _run(self, job: PrefetchJob) -> None:
        tenant, session_id = job.session
        if job.source_peer and self._puller is not None and not job.pulled:
            job.pulled = True  # once: a job re-queued below (store busy) does not pull again
            if job.near_peer and job.near_blocks:
                # Best effort: whatever it leaves missing, source_peer's pull below starts at the
                # first block no local tier holds, so a failed near pull costs only its time.
                blocks = min(job.near_blocks, job.max_blocks) if job.max_blocks else job.near_blocks
                near = await self._puller(tenant, session_id, job.near_peer, blocks)
                job.pages_from_near_peer = near.pages_received
                if not near.complete:
                    log.info("near pull fell short", peer=job.near_peer, session=session_id, error=near.error)
            if job.state == CANCELLED:
                self._finish(job, CANCELLED)
                return
            outcome = await self._puller(tenant, session_id, job.source_peer, job.max_blocks)
            job.pages_from_peer = job.pages_from_near_peer + outcome.pages_received
            if not outcome.complete:
                job.error = outcome.error
        if job.state == CANCELLED:
            self._finish(job, CANCELLED)
            return
        try:
            handle = self._store.loads.promote(tenant, session_id, tier=job.target)
        except StoreBusy:
            await asyncio.sleep(0.01)  # back-pressure from the I/O pool: yield, then try again in order
            job.state = QUEUED
            self._push(job)
            return
        for layer in range(len(handle.layers)):
            if job.state == CANCELLED:
                handle.cancel()
            result = await handle.wait_layer(layer)
            job.pages_in_target += handle.num_blocks - len(result.failed)
            job.pages_failed += len(result.failed)
        if job.state != CANCELLED and job.target is Tier.HBM:
            await self._into_engine(job)
        if job.state == CANCELLED:
            self._finish(job, CANCELLED)
        else:
            self._finish(job, DONE if not job.pages_failed and not job.error else PARTIAL)

    async def _into_engine(self, job: PrefetchJob) -> None:
        """The top tier's last step: the engine's own prefix cache (on a node that serves a model)."""
        if self._warm is None:
            job.engine_note = "this node serves no model"
            return
        if job.pages_failed or not job.pages_in_target:
            job.engine_note = "not every page reached the top tier"
            return
        tenant, session_id = job.session
        record = self._store.sessions.get(tenant, session_id)
        outcome = await self._warm(tenant, session_id, record.token_ids.tolist(), job.engine_salt, record.priority)
        job.engine_cached_tokens, job.engine_note = outcome.cached_tokens, outcome.note

    def _finish(self, job: PrefetchJob, state: PrefetchState) -> None:
        job.state = state
        now = time.monotonic()
        job.lead_time_s = job.deadline - now
        self._active.pop((job.session, job.target), None)
        # Debug: lines up a prefetch's work on the node with the requests it overlapped.
        log.debug(
            "prefetch finished",
            session=job.session[1],
            target=job.target.name,
            state=state,
            pages=job.pages_in_target,
            from_peer=job.pages_from_peer,
            from_near_peer=job.pages_from_near_peer,
            engine_cached=job.engine_cached_tokens,
            ran_ms=round((now - job.started_at) * 1000, 1) if job.started_at else None,
            lead_s=round(job.lead_time_s, 2),
        )
        self._metrics.prefetches.labels(state).inc()
        if state in (DONE, PARTIAL):
            self._metrics.prefetch_lead.observe(job.lead_time_s)
        job.finished.set()

    async def close(self) -> None:
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)

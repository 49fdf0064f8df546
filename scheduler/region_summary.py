"""A region's summary for the global layer (`GET /summary`, symphony.region_load): its load, what a
new request would wait and pay here by its cost profile, and the feed of sessions it holds."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from scheduler.cost_profile import CostProfile
from scheduler.kv_index import NodePrefix
from scheduler.policies.symphony import SymphonyPolicy
from scheduler.routing import NodeSnapshot
from scheduler.state import SchedulerState
from symphony.region_load import RegionLoad


def region_load(state: SchedulerState) -> RegionLoad:
    dispatcher = state.dispatcher
    now_s = time.monotonic()
    finishing = dispatcher.slots.finishes.per_s(now_s * 1000)
    nodes = state.cluster.available_snapshots()
    max_running = state.config.engine.max_running()  # every node's engine runs the cluster's [engine]
    index = state.kv_index
    held = index.fastest_tiers((n.node_id for n in nodes), now_s) if index is not None else None
    return load_of(nodes, len(dispatcher.queue), dispatcher.profile, finishing, max_running, held)


def held_prices(profile: CostProfile, held: NodePrefix | None) -> tuple[float, float]:
    """(load, read) ms per token of KV whose fastest tiers are spread as `held` (blocks per tier):
    loaded into the engine of its node (the engine's own cache: free), or read out of its node for
    a pull (the engine's copy is read from the node's store, as DRAM), as the `symphony` policy
    prices a node's prefix. Nothing sampled (no index, or it holds nothing): DRAM's, where a node
    saves a session's KV."""
    tiers = profile.tier_load_ms_per_token
    if held is None or held.blocks <= 0:
        return tiers.dram, tiers.dram
    stored = held.hbm * tiers.hbm + held.dram * tiers.dram + held.ssd * tiers.ssd
    return stored / held.blocks, (stored + held.engine * tiers.dram) / held.blocks


def load_of(
    nodes: Sequence[NodeSnapshot],
    queued: int,
    profile: CostProfile,
    finishing_per_s: float = 0.0,
    max_running: int = 0,
    held: NodePrefix | None = None,
) -> RegionLoad:
    """A region's load from its ready nodes' snapshots and the requests its scheduler holds back,
    priced by its cost profile (pure: the simulator's regions report theirs with it too).
    `finishing_per_s`: how fast the region's requests finish lately (symphony.finish_rate);
    `max_running`: requests each node's engine runs at once (0: not known); `held`: where the
    blocks its nodes hold sit, by fastest tier (a sample of its KV index; None: not known)."""
    # The wait the `symphony` policy prices at each node, whatever policy routes here; a request
    # that finds every node with a queue waits in the scheduler for one of them, behind `queued`:
    # each of those starts when a running request ends, so the wait is the time for `queued + 1`
    # to end at the rate they have lately (without a rate, the prefills of those ahead).
    estimator = SymphonyPolicy(profile)
    queue_ms = min((estimator.queue_ms(n) for n in nodes), default=0.0)
    if nodes and queued:
        prefills_ms = queued / len(nodes) * estimator.unknown_prefill_ms
        slots_ms = (queued + 1) / finishing_per_s * 1000.0 if finishing_per_s > 0 else 0.0
        queue_ms += max(prefills_ms, slots_ms)
    load_ms, read_ms = held_prices(profile, held)
    return RegionLoad(
        ready_nodes=len(nodes),
        idle_nodes=sum(1 for n in nodes if n.rooms),
        running=sum(n.running for n in nodes),
        waiting=sum(n.waiting for n in nodes),
        inflight=sum(n.inflight for n in nodes),
        queued=queued,
        kv_usage=sum(n.kv_usage for n in nodes) / len(nodes) if nodes else 0.0,
        capacity=len(nodes) * max_running,
        queue_ms=queue_ms,
        prefill_ms_per_token=profile.prefill_ms_per_token,
        request_overhead_ms=profile.request_overhead_ms,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        held_load_ms_per_token=load_ms,
        held_read_ms_per_token=read_ms,
        pulled_load_ms_per_token=profile.tier_load_ms_per_token.dram,
    )


def region_summary(state: SchedulerState, since: int, epoch: str) -> dict[str, Any]:
    body = region_load(state).to_json()
    if state.region_feed is not None:
        body["sessions"] = state.region_feed.since(since, epoch).to_json()
    return body

"""What the connector's scheduler side spends per new request to find its history in the tiers.

`HistoryLookup.match` (hash the prompt into block keys, look them up in the node manager's
shared-memory block index, queue the registration) and `send_registrations`, timed in a process of
its own: inside vLLM they run on the engine core's scheduling thread, and a benchmark's own threads (its event loop, the
cluster it supervises) would otherwise take the GIL from it and be counted as its latency.

Besides wall time, each match's CPU time (this thread's, which excludes the time the vCPU was
taken away) and the share of the machine's CPU time the hypervisor stole during the probe are
kept: on a shared VM, steal can set the wall-clock p99 (docs/benchmarks.md#bench-resume), and the
two tell the connector's own cost apart from the host's.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from dataclasses import dataclass, field
from pathlib import Path

from node_manager.connector.kv_client import NodeKVClient
from node_manager.connector.lookup import HistoryLookup
from symphony.kv_addressing import ModelFingerprint


@dataclass
class MatchSamples:
    match_ms: list[float] = field(default_factory=list)  # wall time per match
    match_cpu_ms: list[float] = field(default_factory=list)  # this thread's CPU time per match
    send_ms: list[float] = field(default_factory=list)  # wall time per registration send
    steal_frac: float = math.nan  # the hypervisor's share of the machine's CPU time meanwhile


def _cpu_ticks() -> tuple[int, int] | None:
    """(all, steal) jiffies from the machine's `cpu` line in /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:8]), fields[7]) if len(fields) >= 8 else None


def _samples(socket_path: str, tenant: str, prompt: list[int], calls: int) -> MatchSamples:
    client = NodeKVClient(socket_path)
    # Keyed under the node's own model, as its engine's connector is.
    lookup = HistoryLookup(client, ModelFingerprint(bytes.fromhex(str(client.hello()["model_fingerprint"]))))
    samples = MatchSamples()
    try:
        lookup.attach()  # as the connector does when vLLM starts it
        ticks_before = _cpu_ticks()
        for call in range(calls):
            # Every call a new session, so every call hashes the whole prompt (a resumed session's
            # next turn hashes only its new blocks); the prompt a list, as vLLM hands it over.
            cpu_started, started = time.thread_time(), time.perf_counter()
            held = lookup.match(tenant, f"match-{call}", prompt)
            matched, cpu_matched = time.perf_counter(), time.thread_time()
            # One request per scheduler step (the connector's worst case): its registration is
            # sent alone, as build_connector_meta does at the end of the step.
            lookup.send_registrations()
            samples.send_ms.append((time.perf_counter() - matched) * 1000.0)
            samples.match_ms.append((matched - started) * 1000.0)
            samples.match_cpu_ms.append((cpu_matched - cpu_started) * 1000.0)
            if held.blocks == 0:
                raise RuntimeError("the match latency probe found none of the history in the block index")
        ticks_after = _cpu_ticks()
        if ticks_before is not None and ticks_after is not None and ticks_after[0] > ticks_before[0]:
            samples.steal_frac = (ticks_after[1] - ticks_before[1]) / (ticks_after[0] - ticks_before[0])
        return samples
    finally:
        lookup.close()
        client.close()


def match_latency(socket_path: Path, tenant: str, prompt: list[int], calls: int) -> MatchSamples:
    """Per `match` of `prompt` (whose history `tenant` has in the node's tiers), and per send of
    its registration: see `MatchSamples`."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_samples, (str(socket_path), tenant, prompt, calls))

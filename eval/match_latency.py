"""What the connector's scheduler side spends per new request to find its history in the tiers.

`HistoryLookup.match` (hash the prompt into block keys, look them up in the node manager's
shared-memory block index, queue the registration) and `send_registrations`, timed in a process of
its own: inside vLLM they run on the engine core's scheduling thread, and a benchmark's own threads (its event loop, the
cluster it supervises) would otherwise take the GIL from it and be counted as its latency.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from node_manager.connector.kv_client import NodeKVClient
from node_manager.connector.lookup import HistoryLookup


def _samples(socket_path: str, tenant: str, prompt: list[int], calls: int) -> tuple[list[float], list[float]]:
    client = NodeKVClient(socket_path)
    lookup = HistoryLookup(client)
    try:
        lookup.attach()  # as the connector does when vLLM starts it
        matches, sends = [], []
        for call in range(calls):
            # Every call a new session, so every call hashes the whole prompt (a resumed session's
            # next turn hashes only its new blocks); the prompt a list, as vLLM hands it over.
            started = time.perf_counter()
            held = lookup.match(tenant, f"match-{call}", prompt)
            matched = time.perf_counter()
            # One request per scheduler step (the connector's worst case): its registration is
            # sent alone, as build_connector_meta does at the end of the step.
            lookup.send_registrations()
            sends.append((time.perf_counter() - matched) * 1000.0)
            matches.append((matched - started) * 1000.0)
            if held.blocks == 0:
                raise RuntimeError("the match latency probe found none of the history in the block index")
        return matches, sends
    finally:
        lookup.close()
        client.close()


def match_latency_ms(socket_path: Path, tenant: str, prompt: list[int], calls: int) -> tuple[list[float], list[float]]:
    """Milliseconds per `match` of `prompt` (whose history `tenant` has in the node's tiers), and
    per send of its registration."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_samples, (str(socket_path), tenant, prompt, calls))

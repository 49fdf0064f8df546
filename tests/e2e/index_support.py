"""What the KV index suites share: what a node holds, as a snapshot of its own `WatchBlocks` stream
says; what the scheduler's index says it holds (`/readyz`'s `nodes[id].kv_index`); a chat turn with
the route it took; and a poller that times when the scheduler's view changes.

A snapshot and the index are compared at one point of the node's stream: when the index has applied
every batch up to the snapshot's seq of the same epoch, its block counts per tier must be the
snapshot's (the index keys blocks by their first 8 bytes; two of a node's keys sharing those is
~1e-15 at these sizes)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import httpx

from symphony.kv_addressing import BlockKey, ModelFingerprint, chain_block_keys

if TYPE_CHECKING:
    from tests.e2e.conftest import LiveCluster
from symphony.rpc import kv_pb2, kv_pb2_grpc
from tests.e2e.kv_support import BLOCK
from tests.helpers import wait_until

TIER_NAMES = {kv_pb2.TIER_ENGINE: "engine", kv_pb2.TIER_HBM: "hbm", kv_pb2.TIER_DRAM: "dram", kv_pb2.TIER_SSD: "ssd"}


@dataclass(frozen=True)
class Holdings:
    """A node's blocks per tier as its stream's snapshot at (epoch, seq) names them."""

    epoch: str
    seq: int
    keys: dict[str, frozenset[bytes]]

    def counts(self) -> dict[str, int]:
        return {tier: len(self.keys.get(tier, ())) for tier in TIER_NAMES.values()}

    def holds(self, tier: str, keys: Sequence[BlockKey]) -> bool:
        return set(keys) <= self.keys.get(tier, frozenset())


def node_holdings(address: str, timeout_s: float = 30) -> Holdings:
    """Subscribe to the node's block events with no resume point (a snapshot), read the snapshot,
    and leave."""
    with grpc.insecure_channel(address) as channel:
        call = kv_pb2_grpc.KVStoreStub(channel).WatchBlocks(kv_pb2.WatchBlocksRequest(), timeout=timeout_s)
        held: dict[str, set[bytes]] = {}
        try:
            for batch in call:
                assert batch.snapshot_begin or held, "a stream without a resume point starts with a snapshot"
                for event in batch.events:
                    assert event.kind == kv_pb2.BLOCK_EVENT_STORED
                    held.setdefault(TIER_NAMES[event.tier], set()).update(event.block_keys)
                if batch.snapshot_end:
                    return Holdings(batch.epoch, batch.seq, {t: frozenset(k) for t, k in held.items()})
        finally:
            call.cancel()
    raise AssertionError(f"{address}'s stream ended before its snapshot did")


@dataclass(frozen=True)
class IndexView:
    """One node as the scheduler's index knows it (`/readyz`)."""

    state: str
    epoch: str
    seq: int
    blocks: dict[str, int]

    @classmethod
    def of(cls, node: dict[str, Any]) -> IndexView | None:
        kv = node.get("kv_index")
        if kv is None:
            return None
        return cls(str(kv["state"]), str(kv["epoch"]), int(kv["seq"]), {k: int(v) for k, v in kv["blocks"].items()})

    def at(self, holdings: Holdings) -> bool:
        """The index is in sync at the snapshot's point of the node's stream."""
        return self.state == "synced" and (self.epoch, self.seq) == (holdings.epoch, holdings.seq)

    def matches(self, holdings: Holdings) -> bool:
        return self.at(holdings) and self.blocks == holdings.counts()


def store_fingerprint(address: str) -> ModelFingerprint:
    """The model fingerprint the node keys its blocks under."""
    with grpc.insecure_channel(address) as channel:
        info = kv_pb2_grpc.KVStoreStub(channel).GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=10)
    return ModelFingerprint(info.model_fingerprint)


def nodes(url: str, headers: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """/readyz's nodes; `headers`: the token that reads them from a scheduler with keys set."""
    return dict(httpx.get(url + "/readyz", timeout=5, headers=headers).json()["nodes"])


def prompt_keys(
    engine_url: str,
    model: str,
    messages: list[dict[str, str]],
    fingerprint: ModelFingerprint,
    tenant: str,
    headers: dict[str, str],
) -> list[BlockKey]:
    """The block keys of a chat prompt's full blocks under `tenant`, from the engine's own rendering
    and tokenizer (what the engine computes, caches and the node saves). `headers`: the engine's
    key (`LiveCluster.engine_headers`)."""
    reply = httpx.post(
        engine_url + "/tokenize",
        json={"model": model, "messages": messages, "add_generation_prompt": True},
        timeout=30,
        headers=headers,
    )
    reply.raise_for_status()
    return list(chain_block_keys(fingerprint, tenant, reply.json()["tokens"], BLOCK).block_keys)


def wait_for_content_routing(url: str, model: str, timeout_s: float = 60) -> None:
    """Every node's index current, and the scheduler's tokenizer loaded (it loads in the background
    at start): routing prices nodes by content only then, by session hints before."""
    wait_until(
        lambda: all(n.get("kv_index", {}).get("state") == "synced" for n in nodes(url).values()),
        timeout_s,
        "every node's block stream to be in sync",
    )
    wait_until(
        lambda: httpx.get(url + "/readyz", timeout=5).json()["tokenizers"].get(model) == "ready",
        timeout_s,
        "the scheduler's tokenizer to load",
    )


def wait_indexed(
    cluster: LiveCluster, node_id: str, messages: list[dict[str, str]], tier: str, timeout_s: float = 60
) -> int:
    """Wait until `node_id`'s `tier` holds the full blocks of the chat prompt `messages` (in the
    engine's cache, all but the last, which vLLM may not have cached) and `cluster`'s scheduler's
    index has applied its stream up to that point. Returns how many blocks that is."""
    url, model = cluster.url, cluster.model
    node = nodes(url)[node_id]
    fingerprint = store_fingerprint(str(node["address"]))
    keys = prompt_keys(str(node["engine_url"]), model, messages, fingerprint, "default", cluster.engine_headers)
    if tier == "engine":
        keys = keys[:-1]

    def indexed() -> bool:
        held = node_holdings(str(node["address"]))
        view = IndexView.of(nodes(url)[node_id])
        return held.holds(tier, keys) and view is not None and view.at(held)

    wait_until(indexed, timeout_s, f"the index to see {node_id}'s {tier} hold the prompt")
    return len(keys)


@dataclass(frozen=True)
class Turn:
    node: str
    route: str
    cached_tokens: int


def chat(url: str, model: str, session: str, messages: list[dict[str, str]], api_key: str = "unused") -> Turn:
    """A short temperature-0 chat turn through a scheduler: the node it went to, the route's reason
    (`X-Symphony-Route`) and how many prompt tokens the engine found cached."""
    reply = httpx.post(
        url + "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 4, "temperature": 0.0},
        headers={"X-Session-ID": session, "Authorization": f"Bearer {api_key}"},
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    details = reply.json()["usage"].get("prompt_tokens_details") or {}
    return Turn(
        reply.headers["x-symphony-node"], reply.headers["x-symphony-route"], int(details.get("cached_tokens") or 0)
    )


@dataclass(frozen=True)
class Sample:
    sent: float  # time.time() when the request left
    received: float  # ... and when its answer came: the state it shows held at some point between
    nodes: dict[str, dict[str, Any]] | None  # None: no answer (the scheduler is down or starting)
    status: int = 0
    tokenizers: dict[str, str] | None = None


class ReadyzPoller:
    """GET /readyz back to back on a thread of its own, keeping every answer (bounded), so that a test
    can tell when the scheduler first showed a state, to within one request's time."""

    def __init__(self, url: str, max_samples: int = 100_000) -> None:
        self.url = url
        self._samples: deque[Sample] = deque(maxlen=max_samples)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="readyz-poller", daemon=True)

    def __enter__(self) -> ReadyzPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.is_set():
                sent = time.time()
                try:
                    reply = client.get(self.url + "/readyz")
                    body = reply.json()
                    sample = Sample(sent, time.time(), body["nodes"], reply.status_code, body.get("tokenizers"))
                except (httpx.HTTPError, ValueError, KeyError):
                    sample = Sample(sent, time.time(), None)
                    self._stop.wait(0.005)  # refused at once while nothing listens: don't spin
                with self._lock:
                    self._samples.append(sample)

    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def first(self, predicate: Callable[[Sample], bool], after: float = 0.0) -> Sample | None:
        """The first answer sent at or after `after` that satisfies `predicate`."""
        return next((s for s in self.samples() if s.sent >= after and predicate(s)), None)

    def wait(self, predicate: Callable[[Sample], bool], timeout_s: float, what: str, after: float = 0.0) -> Sample:
        deadline = time.monotonic() + timeout_s
        while (found := self.first(predicate, after)) is None:
            if time.monotonic() > deadline:
                last = self.samples()[-1:]
                shown = {n: d.get("kv_index") for n, d in (last[0].nodes or {}).items()} if last else None
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last /readyz: {shown}")
            time.sleep(0.02)
        return found

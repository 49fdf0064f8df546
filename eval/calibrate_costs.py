"""The cost profile `symphony bench calibrate` writes (`scheduler.cost_profile`): the engine's fitted
figures (`eval.bench_calibrate`), and measured here

- tier loads: `bench tiers`' store paths (`eval.bench_tiers.measure_store_paths`: a session saved
  into a store in this process, loaded back from DRAM, then from SSD uncached), a few trials,
  medians; the store runs with the cluster stopped, on a quiet host;
- links: per ordered pair of the private cluster's nodes, the target node's `Pull` of sessions of two
  sizes that the source holds (written there with `WritePages`), several each, medians; a straight
  line through (bytes, time) gives the link's bandwidth (slope) and round trip (intercept, which
  includes the call from here to the target: an upper bound on the nodes' own RTT);
- a check of the policy's queue term: the `symphony` policy's estimated TTFT (with this profile) for
  probes that wait behind other prefills, or beside requests decoding, against the TTFT measured.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai

from eval.bench_tiers import measure_store_paths, session_pages
from eval.sim.engine import EngineModel
from eval.sim.presets import engine_cost_profile
from node_manager.kv.pages import PageMac
from node_manager.kv.transfer import page_batch
from scheduler.cost_profile import CostProfile, LinkCost, NodeLink, TierLoadCosts
from scheduler.policies.symphony import SymphonyPolicy
from scheduler.routing import NodeSnapshot, PrefillWork, RouteRequest
from symphony.config import SymphonyConfig
from symphony.kv_addressing import ModelFingerprint, chain_block_keys
from symphony.kv_geometry import KVGeometry
from symphony.rpc import kv_pb2, kv_pb2_grpc

TIER_TOKENS = 2048  # the session `bench tiers` measures by default (~47 MB of SmolLM2 KV)
TIER_TRIALS = 3
LINK_SIZES_BLOCKS = (1, 32)  # sessions of one block and of 32 (1,024 tokens of 32)
LINK_PULLS = 3  # per size and node pair, medians kept (after one unmeasured pull per pair)
TENANT = "calibrate-links"
QUEUE_PROMPT_TOKENS = 256  # the probe, and each prefill ahead of it
QUEUE_AHEAD = (1, 3)  # prefills sent together with the probe
QUEUE_DECODING = (2, 4)  # requests decoding when the probe is sent
QUEUE_DECODE_PROMPT = 512
QUEUE_DECODE_TOKENS = 96  # long enough to still decode when the probe's prefill runs


# -- tiers ------------------------------------------------------------------------------------------
def measure_tier_loads(
    geometry: KVGeometry, device: str, ssd_base: Path, trials: int = TIER_TRIALS
) -> dict[str, float]:
    """Medians over `trials` of `bench tiers`' store paths for one session (GB/s, ms), its SSD
    segments in a temporary directory under `ssd_base` (where the nodes' SSD tiers live)."""
    blocks = max(1, TIER_TOKENS // geometry.block_size)
    pages = session_pages(geometry, blocks)
    token_ids = [(i * 7919) % 49152 for i in range(blocks * geometry.block_size)]
    ssd_base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="symphony-calibrate-tiers-", dir=ssd_base))
    samples: dict[str, list[float]] = {}
    try:
        for trial in range(trials):
            for key, value in measure_store_paths(geometry, pages, token_ids, work, trial, device).items():
                samples.setdefault(key, []).append(value)
            print(f"calibrate tiers: trial {trial + 1}/{trials}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {key: statistics.median(values) for key, values in samples.items()}


def tier_costs(kv_bytes_per_token: float, rates: dict[str, float]) -> TierLoadCosts:
    """ms per token from `measure_tier_loads`' rates: DRAM, a DRAM load into the engine's rows (to
    the device where there is one); SSD, an uncached SSD load; HBM, a plain copy (staged pages are
    already in the engine device's memory), at most DRAM's (on a CPU host both are host memory, and
    one copy measured faster than the other is noise)."""

    def per_token(gbps: float) -> float:
        return kv_bytes_per_token / (gbps * 1e6)

    dram = per_token(rates.get("dram_to_device_gbps", rates["dram_load_gbps"]))
    return TierLoadCosts(
        engine=0.0,
        hbm=min(per_token(rates["memcpy_gbps"]), dram),
        dram=dram,
        ssd=max(per_token(rates["ssd_read_gbps"]), dram),
    )


# -- links ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Node:
    node_id: str
    address: str
    stub: kv_pb2_grpc.KVStoreStub
    model: ModelFingerprint
    geometry: KVGeometry


async def _node(address: str, channel: grpc.aio.Channel) -> _Node:
    stub = kv_pb2_grpc.KVStoreStub(channel)
    info = await stub.GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=30)
    geometry = KVGeometry(info.num_layers, info.kv_heads, info.head_size, info.block_size, info.dtype)
    return _Node(info.node_id, address, stub, ModelFingerprint(info.model_fingerprint), geometry)


async def _put(node: _Node, session: str, blocks: int, rng: random.Random, mac: PageMac) -> kv_pb2.SessionRef:
    """A session of `blocks` full blocks of random KV on `node`."""
    ref = kv_pb2.SessionRef(tenant=TENANT, session_id=session)
    token_ids = [rng.randrange(1_000, 40_000) for _ in range(blocks * node.geometry.block_size)]
    await node.stub.PutSession(kv_pb2.PutSessionRequest(session=ref, token_ids=token_ids), timeout=30)
    keys = chain_block_keys(node.model, TENANT, token_ids, node.geometry.block_size).block_keys
    data = [rng.randbytes(blocks * node.geometry.page_bytes) for _ in range(node.geometry.num_layers)]
    batches = [page_batch(mac, ref, keys, layer, 0, layer_data) for layer, layer_data in enumerate(data)]
    reply = await node.stub.WritePages(iter(batches), timeout=60)
    if reply.pages_stored != blocks * node.geometry.num_layers:
        raise RuntimeError(f"{node.node_id} stored {reply.pages_stored} of a calibration session's pages")
    return ref


async def _pull_ms(source: _Node, target: _Node, ref: kv_pb2.SessionRef) -> float:
    started = time.perf_counter()
    reply = await target.stub.Pull(kv_pb2.PullRequest(session=ref, peer=source.address), timeout=120)
    elapsed = (time.perf_counter() - started) * 1000
    if not reply.complete:
        raise RuntimeError(f"{target.node_id} pulled a calibration session incompletely: {reply}")
    return elapsed


def fit_link(samples: list[tuple[float, float]]) -> LinkCost:
    """The line through the median time at each size: (bytes, ms) samples -> RTT and bandwidth."""
    sizes = sorted({size for size, _ in samples})
    medians = [statistics.median(ms for size, ms in samples if size == s) for s in sizes]
    slope = (medians[-1] - medians[0]) / (sizes[-1] - sizes[0])  # ms per byte
    if slope <= 0:
        raise RuntimeError(f"a larger pull was not slower than a smaller one: {dict(zip(sizes, medians, strict=True))}")
    return LinkCost(rtt_ms=max(0.0, medians[0] - slope * sizes[0]), bandwidth_gbps=1 / slope / 1e6)


async def measure_links(config: SymphonyConfig, seed: int = 0) -> tuple[list[NodeLink], list[dict[str, Any]]]:
    """Every ordered pair of the running cluster's nodes: the target's pull of the source's sessions."""
    addresses = config.scheduler_node_addresses()
    channels = [grpc.aio.insecure_channel(address) for address in addresses]
    rng = random.Random(seed)
    mac = PageMac(config.cluster.secret.encode())  # the private cluster's: its nodes refuse pages without it
    try:
        nodes = [await _node(address, channel) for address, channel in zip(addresses, channels, strict=True)]
        links, raw = [], []
        for source in nodes:
            for target in nodes:
                if source is target:
                    continue
                warm = await _put(source, f"warm-{uuid.uuid4().hex}", 1, rng, mac)
                await _pull_ms(source, target, warm)  # connects the target to the source
                samples = []
                for blocks in LINK_SIZES_BLOCKS:
                    for _ in range(LINK_PULLS):
                        ref = await _put(source, f"pull-{uuid.uuid4().hex}", blocks, rng, mac)
                        nbytes = blocks * source.geometry.block_bytes
                        samples.append((float(nbytes), await _pull_ms(source, target, ref)))
                fit = fit_link(samples)
                links.append(NodeLink(source.node_id, target.node_id, fit.rtt_ms, fit.bandwidth_gbps))
                raw.append({"source": source.node_id, "target": target.node_id, "bytes_ms": samples})
                print(
                    f"calibrate link {source.node_id} -> {target.node_id}: {fit.rtt_ms:.2f} ms + "
                    f"{fit.bandwidth_gbps:.2f} GB/s",
                    file=sys.stderr,
                )
        return links, raw
    finally:
        for channel in channels:
            await channel.close()


# -- the profile and its queue check ----------------------------------------------------------------
def build_profile(
    engine: EngineModel,
    *,
    kv_bytes_per_token: int,
    tiers: TierLoadCosts,
    links: list[NodeLink],
    model: str,
    source: str,
) -> CostProfile:
    """The profile of the fitted `engine`, measured `tiers` and `links` (their medians stand for pairs
    not measured), stamped with this host, `model` and now."""
    default = LinkCost(
        statistics.median(link.rtt_ms for link in links) if links else 0.2,
        statistics.median(link.bandwidth_gbps for link in links) if links else 1.0,
    )
    return engine_cost_profile(
        engine,
        kv_bytes_per_token=kv_bytes_per_token,
        tier_load_ms_per_token=tiers,
        default_link=default,
        links=tuple(links),
        measured_at_unix_s=time.time(),
        host=socket.gethostname(),
        model=model,
        source=source,
    )


async def _first_token_ms(client: openai.AsyncOpenAI, model: str, prompt: list[int], started: float) -> float:
    """Send a one-token completion; ms from `started` to its token."""
    await client.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body={"ignore_eos": True}
    )
    return (time.perf_counter() - started) * 1000


async def _decode(client: openai.AsyncOpenAI, model: str, prompt: list[int], first: asyncio.Event) -> None:
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=QUEUE_DECODE_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            first.set()


async def check_queue(profile: CostProfile, base_url: str, model: str, key: str, seed: int = 1) -> list[dict[str, Any]]:
    """Probes on one otherwise idle engine (`key`: its key), each TTFT beside what the `symphony` policy estimates
    for it (`SymphonyPolicy.estimate`, the same code that routes): a probe sent together with
    `QUEUE_AHEAD` other prefills of its size, and one sent while `QUEUE_DECODING` requests decode."""
    rng = random.Random(seed)
    policy = SymphonyPolicy(profile)
    request = RouteRequest("calibrate", None, model, history_tokens=QUEUE_PROMPT_TOKENS)
    size = QUEUE_PROMPT_TOKENS

    def prompt(tokens: int) -> list[int]:
        return [rng.randrange(1_000, 40_000) for _ in range(tokens)]

    checks: list[dict[str, Any]] = []
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=key, timeout=600.0, max_retries=1)
    try:
        await _first_token_ms(client, model, prompt(size), time.perf_counter())  # warm the shape
        for ahead in QUEUE_AHEAD:
            started = time.perf_counter()
            sent = [_first_token_ms(client, model, prompt(size), started) for _ in range(ahead + 1)]
            times = await asyncio.gather(*sent)
            work = PrefillWork(ahead * size, ahead * size * size / 2)
            node = NodeSnapshot("probe", True, ahead, 0, ahead, 0.0, prefilling=ahead, prefilling_work=work)
            checks.append(_check("prefills_ahead", ahead, max(times), policy.estimate(request, node).total_ms))
        for decoding in QUEUE_DECODING:
            firsts = [asyncio.Event() for _ in range(decoding)]
            streams = [asyncio.create_task(_decode(client, model, prompt(QUEUE_DECODE_PROMPT), e)) for e in firsts]
            await asyncio.gather(*[e.wait() for e in firsts])
            measured = await _first_token_ms(client, model, prompt(size), time.perf_counter())
            context = decoding * QUEUE_DECODE_PROMPT
            usage = context / profile.engine_kv_tokens if profile.engine_kv_tokens else 0.0
            node = NodeSnapshot("probe", True, decoding, 0, decoding, usage)
            checks.append(_check("decoding_beside", decoding, measured, policy.estimate(request, node).total_ms))
            await asyncio.gather(*streams)
    finally:
        await client.close()
    return checks


def _check(kind: str, count: int, measured_ms: float, estimated_ms: float) -> dict[str, Any]:
    print(
        f"calibrate queue check {kind} x{count}: measured {measured_ms:.0f} ms, estimated {estimated_ms:.0f} ms",
        file=sys.stderr,
    )
    return {
        "kind": kind,
        "requests": count,
        "measured_ttft_ms": measured_ms,
        "estimated_ttft_ms": estimated_ms,
        "relative_error": (estimated_ms - measured_ms) / measured_ms,
    }

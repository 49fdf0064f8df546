"""Prefetched KV in the engine yields before any request suffers: with vLLM's whole KV cache
filled by top-tier prefetches, a burst of requests is served with exactly the preemptions it gets
on an engine holding no prefetched KV, and none fails."""

from __future__ import annotations

import concurrent.futures
import uuid

import grpc
import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from node_manager.kv.pages import PageMac
from node_manager.kv.transfer import page_batch
from symphony.kv_addressing import ModelFingerprint, chain_block_keys
from symphony.kv_geometry import smollm2_geometry
from symphony.rpc import kv_pb2, kv_pb2_grpc
from tests.e2e.conftest import LiveCluster, reset_engine_cache
from tests.e2e.kv_support import BLOCK, questions

pytestmark = pytest.mark.e2e
NODE = 1
SESSION_BLOCKS = 64  # 2,048 tokens a prefetched session
BURST = 6  # concurrent requests in the burst
OUTPUT_TOKENS = 32


def _engine_samples(engine_url: str, keyed: dict[str, str], name: str) -> list[Sample]:
    text = httpx.get(engine_url + "/metrics", timeout=10, headers=keyed).text
    return [
        sample for family in text_string_to_metric_families(text) for sample in family.samples if sample.name == name
    ]


def _num_gpu_blocks(engine_url: str, keyed: dict[str, str]) -> int:
    info = _engine_samples(engine_url, keyed, "vllm:cache_config_info")
    assert info, "vLLM reports its cache size in vllm:cache_config_info"
    return int(info[0].labels["num_gpu_blocks"])


def _preemptions(engine_url: str, keyed: dict[str, str]) -> float:
    return sum(sample.value for sample in _engine_samples(engine_url, keyed, "vllm:num_preemptions_total"))


def _synthetic_ids(seed: int, blocks: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104_729) % 40_000 for i in range(blocks * BLOCK)]


def _prefetched_session(
    stub: kv_pb2_grpc.KVStoreStub,
    mac: PageMac,
    tenant: str,
    seed: int,
    blocks: int = SESSION_BLOCKS,
    priority: int = kv_pb2.PRIORITY_NORMAL,
) -> kv_pb2.PrefetchStatus:
    """A history of `blocks` blocks written to the node's tiers (synthetic token ids, KV of small
    bf16 values), then prefetched to the top tier: into the engine's prefix cache."""
    geometry = smollm2_geometry()
    token_ids = _synthetic_ids(seed, blocks)
    ref = kv_pb2.SessionRef(tenant=tenant, session_id="filler")
    stub.PutSession(kv_pb2.PutSessionRequest(session=ref, token_ids=token_ids, priority=priority), timeout=30)
    model = ModelFingerprint(stub.GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=30).model_fingerprint)
    keys = chain_block_keys(model, tenant, token_ids, geometry.block_size).block_keys
    generator = torch.Generator().manual_seed(seed)
    values = geometry.page_bytes // 2  # bf16 values per page
    batches = [
        page_batch(
            mac,
            ref,
            keys,
            layer,
            0,
            (torch.randn(blocks, values, generator=generator) * 0.1)
            .to(torch.bfloat16)
            .view(torch.int16)
            .numpy()
            .tobytes(),
        )
        for layer in range(geometry.num_layers)
    ]
    stub.WritePages(iter(batches), timeout=120)
    return stub.Prefetch(
        kv_pb2.PrefetchRequest(session=ref, target_tier=kv_pb2.TIER_HBM, deadline_ms=5_000, wait_ms=60_000), timeout=70
    )


def _burst(client: openai.OpenAI, model: str, run: str) -> list[int]:
    """BURST concurrent requests of ~700-token prompts (their own salts: nothing shared), each
    OUTPUT_TOKENS long; the completion tokens each got."""
    prompts = [" ".join(turns) for turns in questions(80)]

    def one(index: int) -> int:
        prompt = "\n".join(prompts[(index * 13 + k) % len(prompts)] for k in range(12))
        reply = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=OUTPUT_TOKENS,
            temperature=0,
            extra_body={"cache_salt": f"{run}-{index}", "ignore_eos": True},
        )
        return reply.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(one, range(BURST)))


def test_prefetched_kv_yields_before_any_request_is_preempted_or_refused(live_cluster: LiveCluster) -> None:
    engine_url, keyed = f"http://127.0.0.1:{live_cluster.engine_ports[NODE]}", live_cluster.engine_headers
    client = openai.OpenAI(base_url=engine_url + "/v1", api_key=live_cluster.engine_key, max_retries=0, timeout=300)
    reset_engine_cache(engine_url, keyed)
    before = _preemptions(engine_url, keyed)
    assert _burst(client, live_cluster.model, f"plain-{uuid.uuid4().hex[:8]}") == [OUTPUT_TOKENS] * BURST
    without_prefetch = _preemptions(engine_url, keyed) - before

    capacity_tokens = _num_gpu_blocks(engine_url, keyed) * BLOCK
    sessions = capacity_tokens // (SESSION_BLOCKS * BLOCK) + 1  # more than the engine's whole cache
    with grpc.insecure_channel(f"127.0.0.1:{live_cluster.grpc_ports[NODE]}") as channel:
        stub = kv_pb2_grpc.KVStoreStub(channel)
        mac = PageMac(live_cluster.secret)  # pages the node accepts carry MACs under the cluster's secret
        tenant = f"filler-{uuid.uuid4().hex[:8]}"
        warmed = [_prefetched_session(stub, mac, f"{tenant}-{i}", seed=i) for i in range(sessions)]
    assert all(status.state == kv_pb2.PREFETCH_STATE_DONE and not status.engine_note for status in warmed), warmed
    assert sum(status.engine_cached_tokens for status in warmed) >= capacity_tokens  # every block holds one

    before = _preemptions(engine_url, keyed)
    assert _burst(client, live_cluster.model, f"full-{uuid.uuid4().hex[:8]}") == [OUTPUT_TOKENS] * BURST
    assert _preemptions(engine_url, keyed) - before == without_prefetch


def _vllm_hit_tokens(client: openai.OpenAI, model: str, token_ids: list[int]) -> int:
    """How much of `token_ids` vLLM's own prefix cache holds: asked with unsigned params, so the
    connector adds nothing (one token more, so that the last block can hit)."""
    reply = client.completions.create(
        model=model,
        prompt=[*token_ids, token_ids[-1]],
        max_tokens=1,
        extra_body={"kv_transfer_params": {"tenant": f"probe-{uuid.uuid4().hex[:8]}"}},
    )
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def test_warmed_sessions_yield_in_symphonys_order_not_lru(live_cluster: LiveCluster) -> None:
    engine_url, keyed = f"http://127.0.0.1:{live_cluster.engine_ports[NODE]}", live_cluster.engine_headers
    client = openai.OpenAI(base_url=engine_url + "/v1", api_key=live_cluster.engine_key, max_retries=0, timeout=300)
    reset_engine_cache(engine_url, keyed)
    usable = _num_gpu_blocks(engine_url, keyed) - 1  # block 0 is vLLM's null block
    # Warmed in this order, so plain LRU would evict the high-priority session first.
    sessions = {
        "high": (64, kv_pb2.PRIORITY_HIGH),
        "big": (128, kv_pb2.PRIORITY_NORMAL),
        "small": (32, kv_pb2.PRIORITY_NORMAL),
        "low": (64, kv_pb2.PRIORITY_LOW),
    }
    tenant = f"order-{uuid.uuid4().hex[:8]}"
    with grpc.insecure_channel(f"127.0.0.1:{live_cluster.grpc_ports[NODE]}") as channel:
        stub = kv_pb2_grpc.KVStoreStub(channel)
        mac = PageMac(live_cluster.secret)  # pages the node accepts carry MACs under the cluster's secret
        for seed, (name, (blocks, priority)) in enumerate(sessions.items(), start=100):
            status = _prefetched_session(stub, mac, f"{tenant}-{name}", seed, blocks, priority)
            assert status.engine_cached_tokens >= blocks * BLOCK, status
    warmed = sum(blocks for blocks, _ in sessions.values())
    # New blocks beyond the never-used ones come off the warmed sessions, first in line first: enough
    # for all of `low` and half of `small`, far from `big` and `high`.
    demand = usable - warmed + sessions["low"][0] + sessions["small"][0] // 2
    per_request = demand // 2 * BLOCK
    for seed in (1, 2):
        client.completions.create(
            model=live_cluster.model,
            prompt=_synthetic_ids(seed, demand // 2 + 1)[:per_request],
            max_tokens=1,
            extra_body={"kv_transfer_params": live_cluster.kv_params("burst")},
        )
    ids = {name: _synthetic_ids(seed, blocks) for seed, (name, (blocks, _)) in enumerate(sessions.items(), start=100)}
    assert _vllm_hit_tokens(client, live_cluster.model, ids["high"]) == sessions["high"][0] * BLOCK
    assert _vllm_hit_tokens(client, live_cluster.model, ids["big"]) == sessions["big"][0] * BLOCK
    assert _vllm_hit_tokens(client, live_cluster.model, ids["low"]) == 0

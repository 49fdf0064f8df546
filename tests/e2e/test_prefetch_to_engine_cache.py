"""A top-tier prefetch ends in the engine's own prefix cache: the next turn, under the salt the
prefetch named, starts as a plain vLLM prefix-cache hit (nothing loaded from Symphony's tiers on
its path) and produces the same greedy tokens and logprobs as the cache the history was built in."""

from __future__ import annotations

import uuid

import grpc
import openai
import pytest

from symphony.rpc import kv_pb2, kv_pb2_grpc
from tests.e2e.conftest import LiveCluster
from tests.e2e.kv_support import BLOCK, assert_logprobs_close, loadable_blocks, questions
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e
ANSWER_TOKENS = 96


def _complete(
    client: openai.OpenAI, cluster: LiveCluster, prompt: str | list[int], tenant: str, salt: str, max_tokens: int
) -> openai.types.Completion:
    return client.completions.create(
        model=cluster.model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=1,
        extra_body={
            "kv_transfer_params": cluster.kv_params(tenant, "chat"),
            "cache_salt": salt,
            "return_token_ids": True,
            "ignore_eos": True,
        },
    )


def test_a_top_tier_prefetch_makes_the_next_turn_a_prefix_cache_hit(live_cluster: LiveCluster) -> None:
    first, second = questions(4)[3]
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{live_cluster.engine_ports[0]}/v1",
        api_key=live_cluster.engine_key,
        max_retries=0,
        timeout=120,
    )
    tenant = f"warm-{uuid.uuid4().hex[:8]}"
    built_salt, next_salt = f"{tenant}-built", f"{tenant}-next"
    tails_before = live_cluster.node_metric(0, "symphony_connector_tail_tokens_saved_total")
    turn_one = _complete(client, live_cluster, first, tenant, built_salt, ANSWER_TOKENS).choices[0]
    history = [*turn_one.prompt_token_ids, *turn_one.token_ids]
    history_tokens = (len(history) - 1) // BLOCK * BLOCK  # what a prefix-cache hit can cover
    tail = len(history) - 1 - history_tokens  # the partial last block, which vLLM's cache never holds
    wait_until(
        lambda: loadable_blocks(live_cluster.grpc_ports[0], tenant, "chat") * BLOCK >= history_tokens,
        30,
        "turn 1's KV saved to the node's tiers",
    )
    wait_until(
        lambda: live_cluster.node_metric(0, "symphony_connector_tail_tokens_saved_total") - tails_before >= tail,
        30,
        "turn 1's partial last block saved",
    )

    with grpc.insecure_channel(f"127.0.0.1:{live_cluster.grpc_ports[0]}") as channel:
        done = kv_pb2_grpc.KVStoreStub(channel).Prefetch(
            kv_pb2.PrefetchRequest(
                session=kv_pb2.SessionRef(tenant=tenant, session_id="chat"),
                target_tier=kv_pb2.TIER_HBM,
                deadline_ms=5_000,
                engine_cache_salt=next_salt,
                wait_ms=60_000,
            ),
            timeout=70,
        )
    assert done.state == kv_pb2.PREFETCH_STATE_DONE, done
    assert done.engine_cached_tokens >= history_tokens and not done.engine_note, done

    follow_up = (
        client.completions.create(
            model=live_cluster.model, prompt="\n" + second, max_tokens=1, extra_body={"return_token_ids": True}
        )
        .choices[0]
        .prompt_token_ids
    )
    prompt = [*history, *follow_up]
    loaded_before = live_cluster.node_metric(0, "symphony_connector_prompt_tokens_total", source="symphony")
    hits_before = live_cluster.node_metric(0, "symphony_connector_prompt_tokens_total", source="engine_cache")
    arrivals_before = live_cluster.node_metric(0, "symphony_kv_prefetch_arrivals_total", ready="yes")
    warmed = _complete(client, live_cluster, prompt, tenant, next_salt, 24)
    assert warmed.usage.prompt_tokens_details.cached_tokens >= history_tokens
    # The connector reports a step's prompt tokens with the next step's plan: wait for them.
    wait_until(
        lambda: (
            live_cluster.node_metric(0, "symphony_connector_prompt_tokens_total", source="engine_cache") - hits_before
            >= history_tokens
        ),
        10,
        "the turn's prompt tokens to be reported",
    )
    # Every whole block was a hit in vLLM's cache; only the partial last block came from the tiers.
    assert (
        live_cluster.node_metric(0, "symphony_connector_prompt_tokens_total", source="symphony") == loaded_before + tail
    )
    assert live_cluster.node_metric(0, "symphony_kv_prefetch_arrivals_total", ready="yes") == arrivals_before + 1

    reference = _complete(client, live_cluster, prompt, tenant, built_salt, 24)  # turn 1's own cache
    assert warmed.choices[0].token_ids == reference.choices[0].token_ids
    assert_logprobs_close(warmed, reference)

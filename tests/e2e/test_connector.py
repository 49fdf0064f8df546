"""Symphony's KV connector inside the cluster's real vLLM engines: a resumed MT-bench turn whose
history only Symphony's tiers hold (vLLM's own prefix cache emptied) loads all of it, the partial
last block included, and produces the same greedy tokens and logprobs as vLLM's own prefix-cache
hit of that history; and a request straight to the engine without the scheduler's signature on its
params gets none of it."""

from __future__ import annotations

import time
import uuid

import grpc
import openai
import pytest

from symphony.kv_transfer import params_key, sign_params
from tests.e2e.conftest import LiveCluster, reset_engine_cache
from tests.e2e.kv_support import BLOCK, assert_logprobs_close, loadable_blocks, questions
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e
LAYERS = 30  # SmolLM2-135M
ANSWER_TOKENS = 96  # turn 1's answer: with the question, a few full blocks of history to load


def _complete(
    client: openai.OpenAI, cluster: LiveCluster, prompt: str | list[int], tenant: str, session: str, max_tokens: int
) -> openai.types.Completion:
    # ignore_eos: every answer has max_tokens tokens, so every history spans the same blocks.
    return client.completions.create(
        model=cluster.model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=1,
        extra_body={
            "kv_transfer_params": cluster.kv_params(tenant, session),
            "return_token_ids": True,
            "ignore_eos": True,
        },
    )


@pytest.mark.parametrize("conversation", range(3))
def test_resumed_turn_loaded_from_symphony_matches_vllms_own_cache_hit(
    live_cluster: LiveCluster, conversation: int
) -> None:
    first, second = questions(3)[conversation]
    engine_url = f"http://127.0.0.1:{live_cluster.engine_ports[0]}"
    client = openai.OpenAI(base_url=engine_url + "/v1", api_key=live_cluster.engine_key, max_retries=0, timeout=120)
    tenant, session = f"conn-{uuid.uuid4().hex[:8]}", f"mt-{conversation}"
    tails_before = live_cluster.node_metric(0, "symphony_connector_tail_tokens_saved_total")
    turn_one = _complete(client, live_cluster, first, tenant, session, ANSWER_TOKENS).choices[0]
    # The next turn in token ids, as a chat frontend keeps them: text re-tokenized at the question /
    # answer seam may differ, and different tokens rightly have different KV.
    history = [*turn_one.prompt_token_ids, *turn_one.token_ids]
    # The answer's last token has no KV yet (it was sampled, never fed back): the rest is held.
    history_blocks, tail = divmod(len(history) - 1, BLOCK)
    assert history_blocks >= 2, "the history must span blocks for the load to mean anything"
    # Saves are committed right after the step that computed them, the partial last block in the
    # step after the request finished; wait for them, not a guess.
    wait_until(
        lambda: loadable_blocks(live_cluster.grpc_ports[0], tenant, session) >= history_blocks,
        30,
        "turn 1's KV saved to the node's tiers",
    )
    wait_until(
        lambda: live_cluster.node_metric(0, "symphony_connector_tail_tokens_saved_total") - tails_before >= tail,
        30,
        "turn 1's partial last block saved",
    )

    follow_up = (
        client.completions.create(
            model=live_cluster.model, prompt="\n" + second, max_tokens=1, extra_body={"return_token_ids": True}
        )
        .choices[0]
        .prompt_token_ids
    )
    prompt = [*history, *follow_up]
    # vLLM's own prefix cache still holds turn 1's whole blocks: the reference for KV computed in
    # turn 1. It holds no partial block, so the connector completes this hit with turn 1's partial
    # last block from the node's tiers (same tenant, so the same keys), as it does for the load below.
    engine_cache = _complete(client, live_cluster, prompt, tenant, f"{session}-reference", 24)
    reset_engine_cache(engine_url, live_cluster.engine_headers)
    loaded_before = live_cluster.node_metric(0, "symphony_connector_tokens_loaded_total", tier="DRAM")
    waits_before = live_cluster.node_metric(0, "symphony_connector_layer_wait_seconds_count")
    loaded = _complete(client, live_cluster, prompt, tenant, session, 24)
    # Metrics: the history's tokens counted as loaded from DRAM; the forward waited once per layer.
    assert (
        live_cluster.node_metric(0, "symphony_connector_tokens_loaded_total", tier="DRAM") - loaded_before
        == loaded.usage.prompt_tokens_details.cached_tokens
    )
    wait_until(
        lambda: live_cluster.node_metric(0, "symphony_connector_layer_wait_seconds_count") - waits_before >= LAYERS,
        10,
        "the worker to report its layer waits",
    )

    assert engine_cache.usage.prompt_tokens_details.cached_tokens >= len(history) - 1
    # All of turn 1 from the tiers, partial block included (and whatever whole blocks of this
    # prompt the reference request saved since: the same tenant shares blocks by content).
    assert loaded.usage.prompt_tokens_details.cached_tokens >= len(history) - 1, "history was not all loaded"
    # Loaded pages are turn 1's bytes: the same tokens and logprobs as vLLM's own cache hit. (A
    # recompute builds the answer's KV in one prefill where turn 1 decoded it token by token; how
    # far that parts from both is vLLM's numerics, which test_resume_correctness.py reports.)
    assert loaded.choices[0].token_ids == engine_cache.choices[0].token_ids
    assert_logprobs_close(loaded, engine_cache)


def test_a_direct_call_without_a_valid_signature_gets_none_of_a_sessions_kv(live_cluster: LiveCluster) -> None:
    """Someone who reaches the engine directly and names a tenant's session, with no signature, a
    signature under another key, or a genuine signature with the tenant changed, is served by vLLM
    alone: nothing loads from the tiers and nothing is saved there. The same request signed as the
    scheduler signs it loads the history (the positive control). Each request has a cache salt of
    its own, so vLLM's prefix cache never answers for the tiers."""
    engine_url = f"http://127.0.0.1:{live_cluster.engine_ports[0]}"
    client = openai.OpenAI(base_url=engine_url + "/v1", api_key=live_cluster.engine_key, max_retries=0, timeout=120)
    tenant, session = f"victim-{uuid.uuid4().hex[:8]}", "secret-chat"
    prompt = " ".join(questions(4)[3]) * 3
    built = client.completions.create(
        model=live_cluster.model,
        prompt=prompt,
        max_tokens=1,
        extra_body={"kv_transfer_params": live_cluster.kv_params(tenant, session), "cache_salt": uuid.uuid4().hex},
    )
    blocks = (built.usage.prompt_tokens - 1) // BLOCK
    assert blocks >= 2
    wait_until(lambda: loadable_blocks(live_cluster.grpc_ports[0], tenant, session) >= blocks, 30, "the KV saved")
    # A session of the victim's that the node has never seen: a request the connector took onto
    # the tiers would register it, and match the victim's blocks by content.
    probe = f"probe-{uuid.uuid4().hex[:6]}"
    attempts = {
        "unsigned": {"tenant": tenant, "session_id": probe},
        "another key": sign_params(
            {"tenant": tenant, "session_id": probe}, live_cluster.model, params_key(b"a guess"), time.time()
        ),
        "tenant changed": {**live_cluster.kv_params("someone-else", probe), "tenant": tenant},
    }

    def cached(params: dict[str, object]) -> int:
        reply = client.completions.create(
            model=live_cluster.model,
            prompt=prompt,
            max_tokens=1,
            extra_body={"kv_transfer_params": params, "cache_salt": uuid.uuid4().hex},
        )
        return reply.usage.prompt_tokens_details.cached_tokens or 0

    loaded_before = live_cluster.node_metric(0, "symphony_connector_tokens_loaded_total", tier="DRAM")
    for name, params in attempts.items():
        assert cached(params) == 0, f"{name}: the tiers answered"
    assert live_cluster.node_metric(0, "symphony_connector_tokens_loaded_total", tier="DRAM") == loaded_before
    with pytest.raises(grpc.RpcError) as missing:
        loadable_blocks(live_cluster.grpc_ports[0], tenant, probe)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND  # never registered: the tiers never saw them
    assert cached(live_cluster.kv_params(tenant, probe)) >= blocks * BLOCK  # signed: the tiers answer

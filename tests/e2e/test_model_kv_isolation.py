"""KV of one model is never served to another, with real engines (issue 34's reproduction).

A cluster on one home serves a conversation's first turn with SmolLM2 in bfloat16, and is stopped
(its KV on SSD). The same home is then served in float16 (same page size: the bytes would load
without complaint), and then by another model of the same geometry (SmolLM2 with perturbed weights,
made here). Each time the second turn must load nothing old and answer token for token as a clean
engine does. Two nodes serving the two models side by side must never move a session between them.

The clusters here are the tests' own: the shared one is stopped first (`own_engines`), so that at
most two engines run at once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch

from node_manager.kv.segments import SUFFIX, parse_header
from symphony.config import default_home
from symphony.config_secrets import SECRET_FILE, home_secret
from symphony.kv_transfer import TIERS_PARAM
from symphony.model_identity import CACHE_NAME
from symphony.models import DEFAULT_MODEL_NAME, fetch_default_model
from symphony.rpc import kv_pb2, kv_pb2_grpc
from symphony.tenancy import engine_headers
from tests.e2e.conftest import STARTUP_TIMEOUT_S, LiveCluster, start_cluster, stop_cluster
from tests.helpers import free_port, free_port_run, wait_until

pytestmark = pytest.mark.e2e
PERTURBED = "smol-perturbed"
ANSWER_TOKENS = 24


def _facts_prompt() -> list[dict[str, str]]:
    """The issue's first turn: a ~1,100-token system prompt of 60 facts, then a question about one."""
    facts = " ".join(
        f"Fact {i} is {i}. It is number {i} in this list of facts, to be recalled later." for i in range(1, 61)
    )
    return [
        {"role": "system", "content": f"Remember these facts exactly. {facts}"},
        {"role": "user", "content": "What is fact 12?"},
    ]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return fetch_default_model(default_home(), progress=lambda _: None)


@pytest.fixture(scope="module")
def perturbed(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 with deterministic noise in every MLP's down projection: the same geometry, tokenizer
    and dtype, other weights (as a fine-tune is). Checked first to answer differently."""
    from safetensors.torch import load_file, save_file

    target = tmp_path_factory.mktemp("models") / PERTURBED
    shutil.copytree(
        smollm2, target, ignore=shutil.ignore_patterns(CACHE_NAME, "symphony-model.json", "model.safetensors")
    )
    tensors = load_file(smollm2 / "model.safetensors")
    generator = torch.Generator().manual_seed(34)
    for name in sorted(tensors):
        if name.endswith("mlp.down_proj.weight"):
            weight = tensors[name].float()
            noise = torch.randn(weight.shape, generator=generator) * float(weight.std()) * 0.3
            tensors[name] = (weight + noise).to(tensors[name].dtype)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    first, second = _greedy(smollm2), _greedy(target)
    assert first != second, f"the perturbed model answers as SmolLM2 does: {first}"
    return target


def _greedy(model_dir: Path) -> list[int]:
    """transformers' greedy answer of the model to a short question (its token ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()


def _chat(
    url: str,
    model: str,
    messages: list[dict[str, str]],
    session: str | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A temperature-0 chat turn with its answer's tokens (logprobs) and usage."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0.0,
        "logprobs": True,
        **extra,
    }
    sent = {**(headers or {}), **({"X-Session-ID": session} if session else {})}
    reply = httpx.post(url + "/v1/chat/completions", json=body, headers=sent, timeout=300)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def _tokens(reply: dict[str, Any]) -> list[str]:
    return [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]


def _cached(reply: dict[str, Any]) -> int:
    return int((reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _clean(engine_url: str, keyed: dict[str, str], model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """The same turn straight to the engine (`keyed`: its key), off Symphony's tiers and under a
    salt nothing else used: what the engine computes from nothing."""
    reply = _chat(
        engine_url,
        model,
        messages,
        headers=keyed,
        kv_transfer_params={TIERS_PARAM: False},
        cache_salt=f"clean-{uuid.uuid4().hex}",
    )
    assert _cached(reply) == 0
    return reply


def _fingerprints_on_disk(home: Path) -> set[bytes]:
    found = set()
    for path in (home / "kv").rglob(f"*{SUFFIX}"):
        with path.open("rb") as fh:
            found.add(parse_header(fh.read(1 << 20)).model)
    return found


def _store_model(cluster: LiveCluster, index: int = 0) -> bytes:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_ports[index]}") as channel:
        return bytes(
            kv_pb2_grpc.KVStoreStub(channel).GetStoreInfo(kv_pb2.StoreInfoRequest(), timeout=10).model_fingerprint
        )


def _second_turn_is_clean(cluster: LiveCluster, model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """Turn 2 of session mid-1 through the scheduler: nothing loaded, the clean engine's tokens."""
    reply = _chat(cluster.url, model, messages, session="mid-1")
    assert _cached(reply) == 0, "KV of another model was loaded"
    assert cluster.node_metric(0, "symphony_connector_prompt_tokens_total", source="symphony") == 0
    clean = _clean(f"http://127.0.0.1:{cluster.engine_ports[0]}", cluster.engine_headers, model, messages)
    assert _tokens(reply) == _tokens(clean)
    return reply


def test_a_new_dtype_or_new_weights_on_the_same_home_load_nothing_old(
    own_engines: None, smollm2: Path, perturbed: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    first = _facts_prompt()
    bf16 = start_cluster(home, smollm2, nodes=1)
    try:
        turn1 = _chat(bf16.url, DEFAULT_MODEL_NAME, first, session="mid-1")
        bf16_model = _store_model(bf16)
    finally:
        stop_cluster(bf16)  # flushes the turn's KV to SSD
    assert _fingerprints_on_disk(home) == {bf16_model}
    second = [
        *first,
        {"role": "assistant", "content": turn1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And fact 30?"},
    ]

    # float16: the same page size. The bfloat16 segments are kept for a rollback, and never loaded.
    fp16 = start_cluster(
        home, smollm2, nodes=1, engine_toml='dtype = "float16"', kv_toml="ssd_keep_other_models = true"
    )
    try:
        fp16_model = _store_model(fp16)
        assert fp16_model != bf16_model
        assert fp16.node_metric(0, "symphony_kv_ssd_segments_other_model_total", action="kept") >= 1
        assert fp16.node_metric(0, "symphony_kv_ssd_other_model_segments") >= 1
        reply = _second_turn_is_clean(fp16, DEFAULT_MODEL_NAME, second)
        assert reply["usage"]["prompt_tokens"] > 1000
    finally:
        stop_cluster(fp16)
    assert _fingerprints_on_disk(home) == {bf16_model, fp16_model}

    # Another model of the same geometry (and dtype as the first): both earlier models' KV is dropped.
    node_log = home / "logs" / "node-0.log"
    logged_before = node_log.stat().st_size
    other = start_cluster(home, perturbed, nodes=1, model=PERTURBED)
    try:
        other_model = _store_model(other)
        assert other_model not in (bf16_model, fp16_model)
        assert other.node_metric(0, "symphony_kv_ssd_segments_other_model_total", action="dropped") >= 2
        _second_turn_is_clean(other, PERTURBED, second)
        with node_log.open("rb") as fh:
            fh.seek(logged_before)
            assert b"KV segments of another model or cluster secret were not loaded; deleted" in fh.read()
    finally:
        stop_cluster(other)
    assert _fingerprints_on_disk(home) == {other_model}


# ---- two nodes, two models ------------------------------------------------------------------------


class _TwoModels:
    """node-0 serving SmolLM2 and node-1 the perturbed model, each a `symphony node` process, behind
    one `symphony scheduler`: what a multi-model deployment runs."""

    def __init__(self, home: Path, smollm2: Path, perturbed: Path) -> None:
        self.home = home
        self.port, grpc_base, engine_base = free_port(), free_port_run(2), free_port_run(2)
        metrics_base = free_port_run(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc = [f"127.0.0.1:{grpc_base + i}" for i in range(2)]
        self.engines = [f"http://127.0.0.1:{engine_base + i}" for i in range(2)]
        self.metrics = [f"http://127.0.0.1:{metrics_base + i}/metrics" for i in range(2)]
        config = home / "symphony.toml"
        config.write_text(
            f'home = "{home}"\n[cluster]\nnodes = 2\n[scheduler]\nport = {self.port}\n'
            f"[node]\ngrpc_port_base = {grpc_base}\nengine_port_base = {engine_base}\n"
            f"[kv]\nmetrics_port_base = {metrics_base}\n"
            f'[engine]\nmodel = "{smollm2}"\nkv_cache_space_gib = 1\nmax_model_len = 8192\n'
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("SYMPHONY_")}
        cli = [sys.executable, "-m", "symphony.cli"]
        commands = [
            [*cli, "node", "--config", str(config), "--index", "0"],
            [
                *cli,
                "node",
                "--config",
                str(config),
                "--index",
                "1",
                "--model",
                str(perturbed),
                "--served-model-name",
                PERTURBED,
            ],
            [*cli, "scheduler", "--config", str(config)],
        ]
        self.out = (home / "processes.out").open("ab")
        self.processes = [
            subprocess.Popen(argv, stdout=self.out, stderr=subprocess.STDOUT, env=env) for argv in commands
        ]

    def ready(self) -> bool:
        for process in self.processes:
            if process.poll() is not None:
                self.out.flush()
                tail = (self.home / "processes.out").read_text(errors="replace")[-3000:]
                raise AssertionError(f"a process exited with {process.returncode}:\n{tail}")
        try:
            models = httpx.get(self.url + "/v1/models", timeout=5).json()["data"]
            nodes = httpx.get(self.url + "/readyz", timeout=5).json()["nodes"]
        except (httpx.HTTPError, KeyError, ValueError):
            return False
        return {m["id"] for m in models} == {DEFAULT_MODEL_NAME, PERTURBED} and all(
            node["state"] == "ready" for node in nodes.values()
        )

    @property
    def engine_headers(self) -> dict[str, str]:
        """The engines' key: the processes share the home's secret, which the first of them made."""
        return engine_headers(home_secret(self.home / SECRET_FILE))

    def metric(self, index: int, name: str, **labels: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(httpx.get(self.metrics[index], timeout=5).text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.out.close()


@pytest.fixture
def two_models(own_engines: None, smollm2: Path, perturbed: Path, tmp_path: Path) -> Iterator[_TwoModels]:
    cluster = _TwoModels(tmp_path, smollm2, perturbed)
    try:
        wait_until(cluster.ready, STARTUP_TIMEOUT_S, "both nodes of the two-model cluster", interval_s=0.5)
        yield cluster
    finally:
        cluster.stop()


def test_a_session_of_one_model_is_never_pulled_into_another_models_node(two_models: _TwoModels) -> None:
    first = _facts_prompt()
    turn1 = _chat(two_models.url, DEFAULT_MODEL_NAME, first, session="switch-1")
    second = [
        *first,
        {"role": "assistant", "content": turn1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And fact 30?"},
    ]
    # The client switches models in the same session: an advisory first, then the turn.
    advised = httpx.post(
        two_models.url + "/v1/advisories",
        json={"model": PERTURBED, "kind": "typing"},
        headers={"X-Session-ID": "switch-1"},
        timeout=30,
    )
    assert advised.status_code == 202 and advised.json()["node"] == "node-1", advised.text
    reply = _chat(two_models.url, PERTURBED, second, session="switch-1")
    assert _cached(reply) == 0
    assert _tokens(reply) == _tokens(_clean(two_models.engines[1], two_models.engine_headers, PERTURBED, second))
    # The scheduler asked for no move of node-0's copy, and node-1 took no page from anyone.
    assert two_models.metric(0, "symphony_kv_peer_refused_total", side="sender") == 0
    assert two_models.metric(1, "symphony_kv_peer_pages_total", outcome="stored") == 0
    # Asked directly, node-1 refuses node-0's pages; its own copy of the session stays as it was.
    with grpc.insecure_channel(two_models.grpc[1]) as channel:
        stub = kv_pb2_grpc.KVStoreStub(channel)
        ref = kv_pb2.SessionRef(tenant="default", session_id="switch-1")
        before = stub.GetSessionStatus(kv_pb2.SessionStatusRequest(session=ref, include_token_ids=True), timeout=10)
        pulled = stub.Pull(kv_pb2.PullRequest(session=ref, peer=two_models.grpc[0]), timeout=60)
        after = stub.GetSessionStatus(kv_pb2.SessionStatusRequest(session=ref, include_token_ids=True), timeout=10)
    assert (pulled.pages_received, pulled.complete) == (0, False) and "model" in pulled.error
    assert after.token_ids == before.token_ids and after.loadable_prefix_blocks == before.loadable_prefix_blocks
    assert two_models.metric(1, "symphony_kv_peer_pages_total", outcome="stored") == 0
    assert (
        two_models.metric(0, "symphony_kv_peer_refused_total", side="sender")
        + two_models.metric(1, "symphony_kv_peer_refused_total", side="receiver")
        >= 1
    )

"""A shared system prompt computed once is found by content for a new session of the same tenant, and
never for another tenant's session, with real engines.

The shared cluster's scheduler has no API keys (every request is tenant "default"), so this test
puts a scheduler of its own, with two tenants' keys, in front of the same two nodes (a node serves
any number of watchers). Tenant acme's first session computes the prompt on one node; globex's
session with the very same messages is routed with the index consulted and nothing located (its
block keys are rooted in its own tenant, and its engine cache salt differs, so vLLM finds nothing
either); acme's second session goes to the node that holds the prompt and finds it in vLLM's cache.

Another model is not run live: only SmolLM2 is local here and a third engine does not fit this host
beside two. Block keys are rooted in the model fingerprint as they are in the tenant (one sha256
chain, `symphony.kv_addressing`); the integration test
tests/integration/test_block_watch_stream.py::test_a_prefix_is_found_only_under_its_own_tenant_and_model
checks a real node's blocks are not located under another fingerprint or tenant."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from symphony.config import default_home
from symphony.models import fetch_default_model
from tests.e2e.conftest import LiveCluster
from tests.e2e.index_support import IndexView, chat, node_holdings, nodes, prompt_keys, store_fingerprint
from tests.helpers import free_port, wait_until

pytestmark = pytest.mark.e2e
TIMEOUT_S = 120
KEYS = {"acme": "key-acme", "globex": "key-globex"}
SYSTEM = (
    "You are the help desk of a bicycle shop. Answer briefly, name the part and its size, and "
    "never quote a repair price without seeing the bicycle. "
) * 12  # about 400 tokens: a dozen blocks


def _located(url: str, source: str, headers: dict[str, str]) -> float:
    metrics = httpx.get(url + "/metrics", headers=headers)
    assert metrics.status_code == 200, metrics.text  # keys are set: the cluster's internal token reads them
    found = re.search(rf'symphony_kv_located_total{{source="{source}"}} (\S+)', metrics.text)
    return float(found.group(1)) if found else 0.0


@pytest.fixture
def tenants_scheduler(live_cluster: LiveCluster, tmp_path: Path) -> Iterator[str]:
    """A `symphony scheduler` with acme's and globex's API keys over the live cluster's nodes; its URL
    once both nodes are ready, its index in sync with both and its tokenizer loaded. It has the
    cluster's secret, as every process of a cluster must: the nodes tell whose blocks the engines
    hold by the tenants' salts, which the secret keys."""
    model = fetch_default_model(default_home(), progress=lambda _: None)
    port = free_port()
    addresses = ", ".join(f'"{n["address"]}"' for n in nodes(live_cluster.url).values())
    keys = ", ".join(f'"{tenant}:{key}"' for tenant, key in KEYS.items())
    config = tmp_path / "scheduler.toml"
    config.write_text(
        f'home = "{tmp_path}"\n[scheduler]\nport = {port}\nnode_addresses = [{addresses}]\n'
        f'api_keys = [{keys}]\ntokenizer = "{model}"\n[engine]\nmodel = "{model}"\n'
        f'[cluster]\nsecret = "{live_cluster.secret.decode()}"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYMPHONY_")}
    out = tmp_path / "scheduler.out"
    with out.open("ab") as fh:
        process = subprocess.Popen(
            [sys.executable, "-m", "symphony.cli", "scheduler", "--config", str(config)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"the scheduler exited: {out.read_text(errors='replace')[-3000:]}")
        try:
            body = httpx.get(url + "/readyz", timeout=5, headers=live_cluster.internal_headers).json()
        except (httpx.HTTPError, ValueError):
            return False
        views = [IndexView.of(n) for n in body["nodes"].values()]
        return (
            len(views) == 2
            and all(v is not None and v.state == "synced" for v in views)
            and body["tokenizers"].get(live_cluster.model) == "ready"
        )

    try:
        wait_until(ready, TIMEOUT_S, "the tenants' scheduler to be ready, in sync, its tokenizer loaded", 0.2)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_a_shared_system_prompt_is_found_for_its_tenant_and_never_for_another(
    live_cluster: LiveCluster, tenants_scheduler: str
) -> None:
    url, model = tenants_scheduler, live_cluster.model
    tag = uuid.uuid4().hex[:8]

    def messages(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": f"[{tag}] {SYSTEM}"}, {"role": "user", "content": question}]

    first = chat(url, model, f"acme-1-{tag}", messages("What size is this chain?"), KEYS["acme"])
    ops = live_cluster.internal_headers  # reads /readyz's nodes and /metrics: this scheduler has keys
    cluster = nodes(url, ops)
    holder = cluster[first.node]
    fingerprint = store_fingerprint(str(holder["address"]))
    asked = messages("Which tyre fits a 622 rim?")
    engine, keyed = str(holder["engine_url"]), live_cluster.engine_headers
    acme_keys = prompt_keys(engine, model, asked, fingerprint, "acme", keyed)
    globex_keys = prompt_keys(engine, model, asked, fingerprint, "globex", keyed)
    shared = len(prompt_keys(engine, model, messages("What size is this chain?"), fingerprint, "acme", keyed))
    assert not set(acme_keys) & set(globex_keys)

    def in_step() -> bool:
        held = node_holdings(str(holder["address"]))
        view = IndexView.of(nodes(url, ops)[first.node])
        return held.holds("engine", acme_keys[: shared - 1]) and view is not None and view.matches(held)

    wait_until(in_step, 60, f"the index to see {first.node}'s engine hold acme's system prompt")
    for node in cluster.values():
        held = node_holdings(str(node["address"]))
        assert not any(set(globex_keys) & keys for keys in held.keys.values()), "globex's blocks exist nowhere yet"
    located = _located(url, "index", ops)

    other = chat(url, model, f"globex-1-{tag}", asked, KEYS["globex"])
    # The index was asked and named no node ("symphony_local_kv" would name the holder); vLLM's own
    # cache found nothing under globex's salt either.
    assert other.route == "symphony" and other.cached_tokens == 0, other
    assert _located(url, "index", ops) == located + 1

    again = chat(url, model, f"acme-2-{tag}", asked, KEYS["acme"])
    assert (again.node, again.route) == (first.node, "symphony_local_kv"), again
    assert again.cached_tokens >= (shared - 1) * 32, again
    assert _located(url, "index", ops) == located + 2

"""The scheduler's HTTP API fuzzed from its own OpenAPI document (schemathesis): a real `symphony
scheduler` process in front of a no-op node (`eval.noop_node`: an engine that answers at once),
sent what the document describes and what it does not (negative cases: wrong types, missing
fields, extra ones). Every answer is a 2xx or a well-formed 4xx error body: no 5xx, no hang (every
call has a deadline). The document itself is held to every path the hot path routes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from eval.noop_node import NoopNode
from scheduler.hot_path import ADVISORY_PATH, INFERENCE_PATHS
from tests.helpers import free_port, wait_until

MODEL = "noop-model"
ADMIN_TOKEN = "fuzz-admin"
# Quotas the fuzzer sets land on tenants that do not exist (404) but for "default", every request's
# tenant here: a rate drawn for it would throttle the inference cases. Its updates are left out.
PROTECTED_TENANT = "default"
CALL_TIMEOUT_S = 10.0
EXAMPLES = int(os.environ.get("SYMPHONY_FUZZ_EXAMPLES", "25"))  # per operation and mode


@pytest.fixture(scope="module")
def scheduler_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A scheduler process and its no-op node, whose event loop runs on a thread of its own (the
    fuzzer's calls block this one)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="noop-node", daemon=True)
    thread.start()
    node = NoopNode("127.0.0.1", free_port(), free_port(), MODEL)
    home = tmp_path_factory.mktemp("fuzz-home")
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SYMPHONY_")},
        "SYMPHONY_HOME": str(home),
        "SYMPHONY_SCHEDULER_PORT": str(port),
        "SYMPHONY_SCHEDULER_NODE_ADDRESSES": node.address,
        "SYMPHONY_SCHEDULER_TOKENIZER": "",  # routes on session hints: no model to tokenize with
        "SYMPHONY_SCHEDULER_ADMIN_TOKEN": ADMIN_TOKEN,  # the admin API fuzzed past its token check
        "SYMPHONY_LOGGING_LEVEL": "warning",
    }
    log = (home / "scheduler.log").open("wb")
    process: subprocess.Popen[bytes] | None = None
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert process is not None
        if process.poll() is not None:
            raise AssertionError(f"the scheduler exited: {(home / 'scheduler.log').read_text()[-3000:]}")
        try:
            return httpx.get(url + "/readyz", timeout=2).json().get("ready_nodes") == 1
        except (httpx.HTTPError, ValueError):
            return False

    try:
        asyncio.run_coroutine_threadsafe(node.start(), loop).result(30)
        process = subprocess.Popen(
            [sys.executable, "-m", "symphony.cli", "scheduler"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        wait_until(ready, 60, "the scheduler to see its no-op node ready", interval_s=0.1)
        yield url
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()
        asyncio.run_coroutine_threadsafe(node.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_the_document_covers_every_path_the_hot_path_routes(scheduler_url: str) -> None:
    document = httpx.get(scheduler_url + "/openapi.json", timeout=5).json()
    for path in (*INFERENCE_PATHS, ADVISORY_PATH):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert "model" in body["properties"] or path == ADVISORY_PATH
    assert {"/readyz", "/metrics", "/admin/v1/quotas", "/tokenize"} <= set(document["paths"])


def _operations(url: str) -> list[Any]:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_no_input_gets_a_server_error_or_hangs(scheduler_url: str, mode: GenerationMode) -> None:
    """Each operation of the document, `EXAMPLES` cases each (schemathesis's strategies, run by
    hypothesis here: its pytest plugin does not load under this pytest)."""
    answered: dict[int, int] = {}
    served: dict[str, int] = {}  # per operation, answers in 2xx
    unfuzzable: list[str] = []
    for operation in _operations(scheduler_url):

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def call(case: Any) -> None:
            if isinstance(case.body, dict) and case.body.get("tenant") == PROTECTED_TENANT:
                return
            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"} if case.path.startswith("/admin/") else {}
            response = case.call(base_url=scheduler_url, timeout=CALL_TIMEOUT_S, headers=headers)
            answered[response.status_code] = answered.get(response.status_code, 0) + 1
            label = f"{case.method} {case.path}"
            served[label] = served.get(label, 0) + (200 <= response.status_code < 300)
            where = f"{case.method} {case.path} body={str(case.body)[:300]!r}"
            assert response.status_code < 500, f"{where}: {response.status_code} {response.text[:500]}"
            if response.status_code >= 400 and response.status_code != 405:
                try:
                    error = response.json().get("error")  # OpenAI-style, every 4xx
                except ValueError:
                    error = None
                assert isinstance(error, dict) and isinstance(error.get("message"), str), (
                    f"{where}: {response.status_code} {response.headers.get('content-type')} {response.text[:300]!r}"
                )

        try:
            call()
        except Unsatisfiable:
            if mode != GenerationMode.NEGATIVE:
                raise
            unfuzzable.append(operation.label)  # nothing to get wrong: no body, no parameters
    # What takes a body or parameters was fuzzed with wrong ones too.
    bodies = {f"POST {path}" for path in (*INFERENCE_PATHS, ADVISORY_PATH, "/tokenize", "/detokenize")}
    assert not (bodies | {"PUT /admin/v1/quotas", "GET /summary"}) & set(unfuzzable), unfuzzable
    print(f"fuzzed ({mode.value}): answers by status {dict(sorted(answered.items()))}")  # shown with -s
    assert sum(answered.values()) >= EXAMPLES  # the fuzzer did send, and every answer was checked
    if mode == GenerationMode.POSITIVE:  # past validation: the hot path served some of each
        hot = [f"POST {path}" for path in (*INFERENCE_PATHS, ADVISORY_PATH)]
        assert all(served.get(label, 0) > 0 for label in hot), served

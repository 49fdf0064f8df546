"""The scheduler's own CPU per request, against nodes that answer instantly (`eval.noop_node`).

A real `symphony scheduler` process (the one `symphony up` runs, with its default policy) fronts
two no-op nodes serving the same model: with a choice to make, the scheduler does all of its work
for each request, tokenizing included (given a tokenizer: `scheduler_env`). `concurrency` clients
each hold a multi-turn conversation whose first user message is about `prompt_tokens` tokens long
and whose later turns add a short answer and question, as a chat frontend sends them (the whole
history every turn). The messages are windows of real chat text (the ShareGPT sample: prose, code,
lists, some non-ASCII) at random offsets, so no two conversations start alike and the tokenizer
sees a real vocabulary. With `shared_tokens`, that many tokens of each first prompt are instead a
system message every conversation shares (an application's long system prompt), and the user's
first message is the rest. After a warm-up, the scheduler process's user + system CPU time over
`requests` streamed requests, divided by their number, is `scheduler_cpu_ms_per_request`. The
no-op engines spend nothing, so the client-side time to the first token is the scheduler hop alone
(`noop_ttft_ms_p50`), under the load the clients put on the same cores.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from eval.noop_node import NoopNode
from eval.ports import free_port
from eval.stats import percentile
from eval.workloads import SHAREGPT_SAMPLE
from symphony.config_secrets import scrubbed_env
from symphony.process import proc_stat_fields

READY_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 60.0
# The ShareGPT sample's messages are 3.97 characters a token under SmolLM2's tokenizer (659,890 and
# 166,197); most BPE vocabularies of English are within 10% of that.
CHARS_PER_TOKEN = 4.0


@dataclass(frozen=True, slots=True)
class CpuSettings:
    concurrency: int = 16
    prompt_tokens: int = 2000  # the first prompt's messages, approximately
    shared_tokens: int = 0  # of which a system message all conversations share (0: none)
    turns: int = 4  # per conversation; then a new conversation starts on the same stream
    requests: int = 640  # measured, after the warm-up
    warmup_requests: int = 64
    max_tokens: int = 8
    nodes: int = 2


@functools.cache
def _corpus() -> str:
    texts = []
    for line in SHAREGPT_SAMPLE.read_text().splitlines():
        texts += [turn["value"].strip() for turn in json.loads(line)["conversations"]]
    return "\n\n".join(t for t in texts if t)


def _text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of the corpus from a random offset, cut at whitespace on both ends."""
    corpus = _corpus()
    chars = max(8, round(tokens * CHARS_PER_TOKEN))
    start = rng.randrange(len(corpus) - 2 * chars)
    start = corpus.find(" ", start) + 1
    end = corpus.rfind(" ", start, start + chars)
    return corpus[start : end if end > start else start + chars].strip() or "hello"


def scheduler_cpu_seconds(pid: int) -> float:
    fields = proc_stat_fields(pid)
    if fields is None:
        raise RuntimeError(f"the scheduler (pid {pid}) exited")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any], session: str) -> float:
    started = time.perf_counter()
    first: float | None = None
    async with http.post(url, json=body, headers={"X-Session-ID": session}) as response:
        if response.status != 200:
            raise RuntimeError(f"the scheduler answered {response.status}: {await response.text()}")
        async for _ in response.content.iter_any():
            if first is None:
                first = (time.perf_counter() - started) * 1000.0
    if first is None:
        raise RuntimeError("the scheduler streamed nothing")
    return first


async def _drive(scheduler_url: str, model: str, settings: CpuSettings, count: int, tag: str) -> list[float]:
    """`count` requests over `settings.concurrency` streams; returns their times to first byte (ms)."""
    url = scheduler_url + "/v1/chat/completions"
    remaining = [count]
    ttfts: list[float] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        shared = _text(random.Random("shared"), settings.shared_tokens) if settings.shared_tokens else ""

        async def stream(index: int) -> None:
            rng = random.Random(f"{tag}-{index}")
            conversation = 0
            while remaining[0] > 0:
                session = f"cpu-{tag}-{index}-{conversation}"
                own = _text(rng, max(1, settings.prompt_tokens - settings.shared_tokens))
                messages = [{"role": "system", "content": shared}] if shared else []
                messages.append({"role": "user", "content": own})
                for _ in range(settings.turns):
                    if remaining[0] <= 0:
                        return
                    remaining[0] -= 1
                    body = {"model": model, "messages": messages, "max_tokens": settings.max_tokens, "stream": True}
                    ttfts.append(await _stream(http, url, body, session))
                    messages = [
                        *messages,
                        {"role": "assistant", "content": _text(rng, 40)},
                        {"role": "user", "content": _text(rng, 30)},
                    ]
                conversation += 1

        await asyncio.gather(*(stream(i) for i in range(settings.concurrency)))
    return ttfts


async def _wait_ready(scheduler_url: str, process: asyncio.subprocess.Process, nodes: int) -> dict[str, str]:
    """Wait until the scheduler sees all `nodes` ready and no tokenizer is still loading (its load,
    seconds of CPU, must not land in the measurement); returns its tokenizers' states by model."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() < deadline:
            if process.returncode is not None:
                raise RuntimeError(f"the scheduler exited with {process.returncode}")
            try:
                async with http.get(scheduler_url + "/readyz") as response:
                    ready = await response.json() if response.status == 200 else {}
                    tokenizers: dict[str, str] = ready.get("tokenizers", {})
                    if ready.get("ready_nodes") == nodes and "loading" not in tokenizers.values():
                        return tokenizers
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the scheduler was not ready (no-op nodes, tokenizers) within {READY_TIMEOUT_S:.0f} s")


async def measure_scheduler_cpu(
    settings: CpuSettings, model: str, scheduler_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Start the no-op node and a scheduler process in front of it; measure; stop both.
    `scheduler_env` adds SYMPHONY_* settings for the scheduler (a tokenizer, a policy)."""
    host = "127.0.0.1"
    nodes = [NoopNode(host, free_port(), free_port(), model, node_id=f"noop-{i}") for i in range(settings.nodes)]
    port = free_port()
    scheduler_url = f"http://{host}:{port}"
    for node in nodes:
        await node.start()
    with tempfile.TemporaryDirectory(prefix="symphony-cpu-") as home:
        env = {
            **scrubbed_env(),  # a private scheduler: none of the caller's keys or tokens
            "SYMPHONY_HOME": home,
            "SYMPHONY_SCHEDULER_HOST": host,
            "SYMPHONY_SCHEDULER_PORT": str(port),
            "SYMPHONY_SCHEDULER_NODE_ADDRESSES": ",".join(node.address for node in nodes),
            "SYMPHONY_LOGGING_LEVEL": "warning",
            **(scheduler_env or {}),
        }
        log_path = Path(home) / "scheduler.log"
        with log_path.open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "symphony.cli", "scheduler", env=env, stdout=log, stderr=subprocess.STDOUT
            )
            try:
                tokenizers = await _wait_ready(scheduler_url, process, settings.nodes)
                await _drive(scheduler_url, model, settings, settings.warmup_requests, "warm")
                cpu_before, wall_before = scheduler_cpu_seconds(process.pid), time.perf_counter()
                ttfts = await _drive(scheduler_url, model, settings, settings.requests, "run")
                cpu_after, wall_after = scheduler_cpu_seconds(process.pid), time.perf_counter()
            except BaseException:
                tail = log_path.read_text(errors="replace")[-4000:]
                print(f"scheduler log (tail):\n{tail}", file=sys.stderr)
                raise
            finally:
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), 15)
                except TimeoutError:
                    process.kill()
                    await process.wait()
                for node in nodes:
                    await node.stop()
    wall_s = wall_after - wall_before
    return {
        "scheduler_cpu_ms_per_request": (cpu_after - cpu_before) * 1000.0 / settings.requests,
        "noop_ttft_ms_p50": statistics.median(ttfts),
        "noop_ttft_ms_p99": percentile(ttfts, 99),
        "noop_requests_per_s": settings.requests / wall_s,
        "noop_engine_requests": sum(node.engine.requests for node in nodes),
        "tokenizer": tokenizers.get(model, "none"),  # "ready": every request was tokenized
        "settings": {
            "concurrency": settings.concurrency,
            "prompt_tokens": settings.prompt_tokens,
            "shared_tokens": settings.shared_tokens,
            "turns": settings.turns,
            "requests": settings.requests,
            "warmup_requests": settings.warmup_requests,
            "max_tokens": settings.max_tokens,
            "nodes": settings.nodes,
        },
    }

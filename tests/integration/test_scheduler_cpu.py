"""`bench proxy`'s CPU part: a real scheduler process in front of the no-op node."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from eval.bench_proxy import PROMPTS, proxy_prompts, run_proxy_bench
from eval.scheduler_cpu import CpuSettings, measure_scheduler_cpu
from symphony.config import load_config
from tests.tokenizer_support import make_tokenizer


def test_scheduler_cpu_counts_every_request_through_a_real_scheduler() -> None:
    settings = CpuSettings(concurrency=4, prompt_tokens=200, turns=3, requests=60, warmup_requests=12)
    result = asyncio.run(measure_scheduler_cpu(settings, "noop-model"))
    # Every request went through the scheduler to the engine: warm-up and measured ones.
    assert result["noop_engine_requests"] == settings.warmup_requests + settings.requests
    # The scheduler did work for them (a tick is 10 ms: 60 requests of real parsing and relaying
    # take more than nothing) but far less than a second each.
    assert 0.0 < result["scheduler_cpu_ms_per_request"] < 1000.0
    assert 0.0 < result["noop_ttft_ms_p50"] <= result["noop_ttft_ms_p99"]


def test_proxy_prompts_carry_their_own_context_of_the_asked_size() -> None:
    prompts = proxy_prompts(3, 400)
    assert len(set(prompts)) == 3
    assert all(len(p.split()) > 200 for p in prompts)  # ~400 tokens: well over 200 words
    assert proxy_prompts(2, 0) == PROMPTS[:2]  # no context: the bare questions


def test_cpu_only_measures_with_the_models_tokenizer_and_a_shared_system_prompt(tmp_path: Path) -> None:
    model = make_tokenizer(tmp_path / "tiny-model")  # the scheduler's tokenizer: served as "tiny-model"
    config = load_config(env={"SYMPHONY_HOME": str(tmp_path / "home"), "SYMPHONY_ENGINE_MODEL": str(model)})
    out = tmp_path / "proxy.json"
    assert (
        run_proxy_bench(
            config,
            out=out,
            concurrency=4,
            rounds=1,
            max_tokens=4,
            prompt_tokens=300,
            cpu_requests=40,
            scheduler_url=None,
            engine_url=None,
            cpu_only=True,
            cpu_shared_tokens=250,
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert "overhead_ms_p50" not in result  # no live rounds, no engine
    cpu = result["scheduler_cpu"]
    assert cpu["tokenizer"] == "ready"  # every measured request was tokenized
    assert cpu["settings"]["shared_tokens"] == 250
    assert cpu["noop_engine_requests"] == cpu["settings"]["warmup_requests"] + 40
    assert result["scheduler_cpu_ms_per_request"] > 0
    assert list(result["targets"]) == ["scheduler_cpu_ms_per_request<=0.3"]

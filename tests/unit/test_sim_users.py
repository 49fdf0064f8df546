"""The users scenario's parts: its workloads (Mooncake sessions, tool-calling agents), the per-turn work
ratio they allow, and the search for each policy's limit; and the A100 preset's fit to Vidur's profile."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from eval.sim.cluster import ClusterSim, LinkModel
from eval.sim.engine import EngineModel, SimEngine, SimRequest
from eval.sim.presets import A100_LLAMA3_8B_PREFILL, PRESETS, STEP_OVERHEAD_MS, _gpu_engine
from eval.sim.tool_agents import AgentShape, agent_task, agent_users
from eval.sim.trace_users import shared_blocks, trace_users
from eval.sim.turns import Script, Step
from eval.sim.users_scenario import crossing, limit, search_users, turn_sizes, work_ratio_bound
from eval.sim.vidur_profile import DECODE_LINEAR_MS, LAYERS, PREFILL_POINTS, fit_prefill, preset_gpu_ms
from eval.traces import TraceRequest
from eval.workloads import HumanTiming
from scheduler.policies import make_policy
from symphony.cli import main

A100 = PRESETS["a100-llama3.1-8b"].engine
LINK = LinkModel(kv_bytes_per_token=1_000, bandwidth_gbps=1.0, rtt_ms=1.0)
# Prefill 1 ms a token, attention 0.5 ms a token per 1,000 of position; decode 2 ms a request per step.
SIMPLE = EngineModel(
    step_ms=10,
    prefill_ms_per_token=1,
    decode_ms_per_seq=2,
    decode_ms_per_kilotoken=0,
    kv_blocks=1000,
    block_size=16,
    prefill_ms_per_token_kilotoken=0.5,
)


# -- the A100 preset against Vidur's profile -------------------------------------------------------
def test_the_a100_prefill_is_within_ten_percent_of_every_profile_point() -> None:
    errors = [preset_gpu_ms(A100, p, STEP_OVERHEAD_MS) / p.model_ms - 1 for p in PREFILL_POINTS]
    assert max(abs(e) for e in errors) <= 0.10
    assert len(PREFILL_POINTS) >= 20 and any(p.cached_tokens for p in PREFILL_POINTS)


def test_the_old_first_principles_prefill_was_as_slow_as_issue_36_says() -> None:
    """The profile reproduces the issue's figures for the preset at aea59d5 (its whole step, 2 ms
    of CPU included): 1.58x-1.69x the profile at 128-512 tokens, 1.21x-1.25x at 1k-8k."""
    old = _gpu_engine(memory_gb=80, bandwidth_gbps=2039, tflops=312, activation_gb=4)
    ratios = {p.tokens: preset_gpu_ms(old, p, 0.0) / p.model_ms for p in PREFILL_POINTS if not p.cached_tokens}
    assert all(1.58 <= ratios[n] <= 1.71 for n in (128, 256, 384, 512))
    assert all(1.20 <= ratios[n] <= 1.25 for n in (1024, 2048, 3072, 4096, 6144, 8192))


def test_the_preset_constants_are_the_fit_rounded() -> None:
    pytest.importorskip("scipy")
    weights_ms = A100.step_ms - STEP_OVERHEAD_MS
    fit = fit_prefill(PREFILL_POINTS, weights_ms)
    assert fit.fixed_ms == pytest.approx(A100_LLAMA3_8B_PREFILL.fixed_ms, abs=1e-3)
    assert fit.per_token_ms == pytest.approx(A100_LLAMA3_8B_PREFILL.per_token_ms, rel=1e-3)
    assert fit.per_token_kilotoken_ms == pytest.approx(A100_LLAMA3_8B_PREFILL.per_token_kilotoken_ms, rel=1e-3)
    assert A100.prefill_overlap_ms == pytest.approx(weights_ms - A100_LLAMA3_8B_PREFILL.fixed_ms)
    # The fit's own prediction matches the engine's step price: the same model, two ways.
    point = PREFILL_POINTS[-1]
    assert preset_gpu_ms(A100, point, STEP_OVERHEAD_MS) == pytest.approx(
        fit.gpu_ms(weights_ms, point.tokens, point.cached_tokens), rel=1e-3
    )


def test_the_profiles_pass_through_the_weights_agrees_with_the_decode_steps_weight_read() -> None:
    weight_read_ms = A100.step_ms - STEP_OVERHEAD_MS
    assert pytest.approx(weight_read_ms, rel=0.03) == LAYERS * DECODE_LINEAR_MS


def test_a_prefill_hides_the_steps_weight_read_up_to_its_own_cost() -> None:
    """overlap 6 ms, 1 ms a token: 4 tokens hide 4 ms of the 10, 100 tokens all 6."""
    engine = dataclasses.replace(SIMPLE, prefill_ms_per_token_kilotoken=0, prefill_overlap_ms=6)
    for tokens, step in ((4, 10 + 4 - 4), (100, 10 + 100 - 6)):
        sim = SimEngine("n0", engine)
        sim.add(SimRequest(1, "a", 0, tokens, 2))
        assert sim.step().duration_ms == step
    sim = SimEngine("n0", engine)
    sim.add(SimRequest(1, "a", 0, 100, 3))
    sim.finish_step(sim.step(), 104)
    assert sim.step().duration_ms == 10 + 2  # a decode step hides nothing


# -- the work ratio a workload allows -------------------------------------------------------------
def test_the_work_ratio_bound_as_computed_by_hand() -> None:
    """Turn 1: 100 tokens in, 10 out; turn 2: 20 more in, after 30 s, 10 out. Recompute: turn 1
    100 + 0.5 x 100 x 0.05 = 102.5 ms of prefill, turn 2 (130 tokens) 130 + 0.5 x 130 x 0.065 =
    134.225; resume computes turn 2's last 21 tokens (the answer's last token and the 20 new, at mean
    position 119.5): 21 + 0.5 x 21 x 0.1195 = 22.25475. Decode: 10 x 2 ms each turn."""
    script = Script("a", 0.0, (Step(100, 10, 0, 0), Step(20, 10, 30_000, 0)))
    assert [(t.prompt_tokens, t.held_tokens) for t in turn_sizes(script)] == [(100, 0), (130, 109)]
    recompute, resume = 102.5 + 20 + 134.225 + 20, 102.5 + 20 + 22.25475 + 20
    assert work_ratio_bound([script], SIMPLE, until_ms=60_000) == pytest.approx(recompute / resume)
    # Turn 2 comes after the first answer (10 tokens at 10 ms) and 30 s of thought: 30.1 s.
    assert work_ratio_bound([script], SIMPLE, until_ms=30_000) == pytest.approx(1.0)


def test_a_turn_that_drops_history_resumes_only_what_it_kept() -> None:
    script = Script("a", 0.0, (Step(100, 10, 0, 0), Step(20, 10, 0, 0, history_tokens=64)))
    assert [(t.prompt_tokens, t.held_tokens) for t in turn_sizes(script)] == [(100, 0), (84, 64)]
    # The simulator caps the turn's reuse the same way, though the node holds 109 tokens of it.
    sim = ClusterSim(make_policy("sticky"), {"n0": SIMPLE}, LINK)
    second = next(r for r in sim.run(scripts=[script]).requests if r.request_id == 1)
    assert (second.prompt_tokens, second.cached_tokens, second.prefilled_tokens) == (84, 64, 20)


def test_without_prefix_caching_recompute_finds_nothing_of_a_history() -> None:
    """Turn 2 (130 tokens) on the one node that served turn 1: vLLM's prefix cache has its first
    96 tokens (whole blocks of the 109 computed); without it, all 130 are prefilled again."""
    script = Script("a", 0.0, (Step(100, 10, 0, 0), Step(20, 10, 0, 0)))
    for caching, cached in ((True, 96), (False, 0)):
        sim = ClusterSim(make_policy("recompute"), {"n0": SIMPLE}, LINK, prefix_caching=caching)
        second = next(r for r in sim.run(scripts=[script]).requests if r.request_id == 1)
        assert (second.cached_tokens, second.prefilled_tokens) == (cached, 130 - cached)


# -- Mooncake sessions -----------------------------------------------------------------------------
def _request(at_s: float, tokens: int, out: int, blocks: list[int]) -> TraceRequest:
    return TraceRequest(at_s * 1000, tokens, out, tuple(blocks))


def test_mooncake_sessions_continue_their_history_or_keep_the_blocks_they_share() -> None:
    """One session: 1,100 tokens (3 blocks, the last partial); 1,350 (its 2 whole blocks and an
    answer of 200, then 50 new); then 1,212, shorter than that history and its answer: it keeps the
    2 blocks it shares, 1,024 tokens, and 188 are new. Another session of one turn. Think time is the
    recorded gap, scaled."""
    trace = [
        _request(0, 1100, 200, [1, 2, 3]),
        _request(5, 900, 10, [7, 8]),
        _request(100, 1350, 40, [1, 2, 4]),
        _request(160, 1212, 30, [1, 2, 9]),
    ]
    assert shared_blocks(trace[0], trace[2]) == 2
    timing = HumanTiming(time_scale=0.5)
    scripts = trace_users(trace, 2, timing, seed=3)
    sessions = {len(s.steps): s for s in scripts}
    three = sessions[3].steps
    assert [(s.new_tokens, s.history_tokens) for s in three] == [(1100, None), (50, None), (188, 1024)]
    assert (three[1].think_ms, three[2].think_ms) == (50_000, 30_000)
    assert all(0 <= s.typing_ms <= s.think_ms for s in three[1:])
    assert [t.prompt_tokens for t in turn_sizes(sessions[3])] == [1100, 1350, 1212]
    assert sessions[1].steps[0].new_tokens == 900
    assert scripts == trace_users(trace, 2, timing, seed=3)  # seeded


def test_users_share_out_the_sessions() -> None:
    trace = [_request(i, 600, 10, [i * 10, i * 10 + 1]) for i in range(6)]
    scripts = trace_users(trace, 2, HumanTiming(), seed=0)
    chains = [[part.steps[0].new_tokens for part in _chain(s)] for s in scripts]
    assert [len(c) for c in chains] == [3, 3]


def _chain(script: Script | None) -> list[Script]:
    out = []
    while script is not None:
        out.append(script)
        script = script.after
    return out


# -- tool-calling agents ---------------------------------------------------------------------------
def test_an_agent_tasks_context_grows_by_each_answer_and_tool_output() -> None:
    shape = AgentShape(prefix_tokens=1000, steps=5, output_tokens=100, tool_tokens=300, tool_s=2.0, jitter=0.0)
    steps = agent_task(shape, random.Random(0))
    assert [s.new_tokens for s in steps] == [1000, 300, 300, 300, 300]
    assert all((s.think_ms, s.typing_ms) == (2000, 2000) for s in steps)  # advised as the tool starts
    prompts = [t.prompt_tokens for t in turn_sizes(Script("t", 0.0, steps))]
    assert prompts == [1000, 1400, 1800, 2200, 2600]
    assert prompts[-1] + 100 == shape.final_context_tokens()


def test_agents_run_tasks_back_to_back_and_reach_long_contexts_by_default() -> None:
    scripts = agent_users(AgentShape(), 3, tasks_per_user=2, seed=1)
    assert len(scripts) == 3 and all(len(_chain(s)) == 2 for s in scripts)
    assert scripts == agent_users(AgentShape(), 3, tasks_per_user=2, seed=1)
    assert 10_000 <= AgentShape().final_context_tokens() <= 40_000
    last = [t.prompt_tokens for t in turn_sizes(scripts[0])][39]
    assert 15_000 <= last <= 35_000  # the jitter keeps the 40th call near the mean


@pytest.mark.parametrize("bad", [{"steps": 0}, {"tool_tokens": -1}, {"jitter": 1.0}, {"tool_s": -1.0}])
def test_an_impossible_agent_shape_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AgentShape(**bad)  # type: ignore[arg-type]


# -- the search ------------------------------------------------------------------------------------
def test_the_search_doubles_then_bisects_and_interpolates_each_crossing() -> None:
    """TPOT = 10 + users / k: recompute k = 100, the other k = 300. Bound 1.15 x 10.01 (recompute at
    1 user) = 11.5115: recompute crosses at 151.15 users, the other at 453.45."""
    slopes = {"recompute": 100.0, "symphony": 300.0}
    calls: list[tuple[str, int]] = []

    def run(policy: str, users: int) -> dict[str, float | None]:
        calls.append((policy, users))
        return {"tpot_ms_mean": 10 + users / slopes[policy]}

    search = search_users(run, ("symphony", "recompute"), (1, 2), refine=6)
    assert search.bound_ms == pytest.approx(1.15 * 10.01)
    assert len(calls) == len(set(calls))  # no point measured twice
    assert search.limits["recompute"].crossed and search.limits["symphony"].crossed
    assert search.limits["recompute"].users == pytest.approx(151.15)
    assert search.limits["symphony"].users == pytest.approx(453.45)
    assert search.ratio("symphony", "recompute") == pytest.approx(453.45 / 151.15)


def test_a_policy_that_never_crosses_has_a_lower_bound_only() -> None:
    def run(policy: str, users: int) -> dict[str, float | None]:
        return {"tpot_ms_mean": 10.0 if policy == "symphony" else 10 + users / 10}

    search = search_users(run, ("symphony", "recompute"), (1, 2), max_users=64, refine=2)
    ours = search.limits["symphony"]
    assert not ours.crossed and ours.users == 64 and ours.bracket is None
    assert search.ratio("symphony", "recompute") == pytest.approx(64 / search.limits["recompute"].users)


def test_crossing_and_limit_read_the_first_crossing() -> None:
    tpot = {8: 10.0, 16: 12.0, 32: 11.0, 64: None}
    rows = {users: {"tpot_ms_mean": value} for users, value in tpot.items()}
    assert crossing(rows, 11.5) == (8, 16)  # 32 is within it again, but past a crossing
    assert limit(rows, 11.5).users == pytest.approx(14.0)
    assert crossing({8: {"tpot_ms_mean": 12.0}}, 11.5) == (None, 8)
    assert limit({8: {"tpot_ms_mean": 12.0}}, 11.5).users is None
    assert crossing({8: {"tpot_ms_mean": 10.0}, 16: {"tpot_ms_mean": None}}, 11.5) == (8, 16)


# -- the command -----------------------------------------------------------------------------------
@pytest.mark.parametrize("workload", ["agentic", "mooncake"])
def test_bench_sim_users_runs_the_long_history_workloads(workload: str, tmp_path: Path) -> None:
    out = tmp_path / f"{workload}.json"
    args = ["bench", "sim", "--scenario", "users", "--workload", workload, "--out", str(out)]
    args += ["--nodes", "2", "--users", "1,2", "--max-users", "4", "--refine", "0", "--duration", "120"]
    if workload == "agentic":
        args += ["--agent-steps", "6", "--agent-tool-s", "1"]
    else:  # conversations of four turns 5 s apart: each the last prompt and answer and 30 tokens more
        rows = [
            {
                "timestamp": 5000 * turn + c,
                "input_length": 1100 + 50 * turn,
                "output_length": 20,
                "hash_ids": [100 * c, 100 * c + 1, 100 * c + 10 + turn],  # 2 whole blocks, then its own
            }
            for c in range(4)
            for turn in range(4)
        ]
        trace = tmp_path / "trace.jsonl"
        trace.write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["timestamp"])))
        args += ["--trace", str(trace)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["users_workload"] == workload
    assert set(result["limits"]) == {"symphony", "recompute", "sticky"}
    assert set(result["users_ratio_by_policy"]) == {"symphony", "sticky"}
    assert result["work_ratio_bound"] > 1
    if workload == "agentic":
        assert result["workload_details"]["agent"]["steps"] == 6
        assert "users_ratio_ge_4" in result["targets"]
    # Resuming computes less of the prompts than recompute does.
    fewest = result["points"]
    assert fewest["symphony"]["1"]["prefill_tokens_computed"] < fewest["recompute"]["1"]["prefill_tokens_computed"]


def test_a_named_workload_is_for_the_users_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "sim", "--scenario", "imbalance", "--workload", "agentic", "--out", str(tmp_path / "x.json")]
    assert main(args) == 2
    assert "--workload agentic" in capsys.readouterr().err

"""The cluster simulator: hand-computed cases reproduced exactly, and the real policies driving it."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eval.sim.agents import AgentProject, ProjectRun, agent_projects
from eval.sim.cluster import ClusterSim, LinkModel
from eval.sim.engine import EngineModel, SimEngine, SimRequest
from eval.sim.presets import PRESETS, sim_cost_profile
from eval.sim.scenarios import turn_work_ms, work_ratio
from eval.sim.turns import Script, Step, Turn
from eval.sim.workload import sharegpt_users
from eval.workloads import SHAREGPT_SAMPLE, HumanTiming, load_sharegpt
from scheduler.policies import make_policy
from scheduler.routing import NO_WORK, PrefillWork, RoutingPolicy
from symphony.cli import main

# Step = 10 ms + 1 ms per prefilled token + 2 ms per decoding request; blocks of 32 tokens.
ENGINE = EngineModel(
    step_ms=10, prefill_ms_per_token=1, decode_ms_per_seq=2, decode_ms_per_kilotoken=0, kv_blocks=100, block_size=32
)
LINK = LinkModel(kv_bytes_per_token=1_000_000, bandwidth_gbps=1.0, rtt_ms=5.0)  # 1 ms per token moved, + 5 ms


def symphony(engine: EngineModel = ENGINE) -> RoutingPolicy:
    """The symphony policy priced by the simulated cluster's own costs, as the simulator runs it."""
    return make_policy("symphony", profile=sim_cost_profile(engine, LINK))


def by_session(result: object) -> dict[str, object]:
    return {r.session: r for r in result.requests}  # type: ignore[attr-defined]


def test_one_engine_batches_a_prefill_with_a_decode_as_computed_by_hand() -> None:
    """t=0: A (100 tokens) prefills alone: 10 + 100 = 110 ms, first token at 110. B arrived at 5
    and waits. t=110: B's prefill (50) with A's decode: 10 + 50 + 2 = 62 -> 172, B's first token.
    t=172: both decode: 10 + 4 = 14 -> 186, A's third token and B's second: both done."""
    sim = ClusterSim(make_policy("least_load"), {"n0": ENGINE}, LINK)
    result = sim.run([Turn("a", 0, 100, 3), Turn("b", 5, 50, 2)])
    a, b = by_session(result)["a"], by_session(result)["b"]
    assert (a.ttft_ms, a.finished_ms, a.tpot_ms) == (110, 186, 38)
    assert (b.ttft_ms, b.finished_ms, b.tpot_ms) == (167, 186, 14)
    assert result.busy_ms == {"n0": 186} and result.preemptions == 0


def test_a_request_counts_as_prefilling_until_its_first_token() -> None:
    """What the scheduler counts of its streams (NodeSnapshot.prefilling), on the engine model:
    queued and mid-prefill requests count; one that has its first token does not."""
    engine = SimEngine("n0", ENGINE)
    a, b = SimRequest(1, "a", 0, 100, 3), SimRequest(2, "b", 5, 50, 2)
    engine.add(a)
    assert engine.prefilling == 1
    plan = engine.step()  # a prefills; b arrives during that step and waits for the next
    engine.add(b)
    assert engine.prefilling == 2
    engine.finish_step(plan, 110)
    assert a.first_token_ms == 110 and engine.prefilling == 1
    plan = engine.step()
    engine.finish_step(plan, 172)
    assert b.first_token_ms == 172 and engine.prefilling == 0


def _recounted(engine: SimEngine) -> tuple[int, PrefillWork]:
    """`prefilling` and `prefilling_work` counted afresh from the engine's queues."""
    unstarted = [r for r in (*engine.waiting, *engine.running) if r.first_token_ms is None]
    work = NO_WORK
    for r in unstarted:
        computed = r.context - min(r.cached_tokens, r.context - 1)
        work += PrefillWork(computed, computed * (r.context - computed / 2))
    return len(unstarted), work


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            # a request: prompt tokens (up to past the whole cache: refused), answer, cached tokens
            st.tuples(st.integers(1, 3500), st.integers(1, 200), st.integers(0, 3500)),
            st.just("step"),
        ),
        max_size=80,
    ),
    st.booleans(),
)
def test_the_prefilling_counts_kept_match_a_recount(ops: list, priority: bool) -> None:
    """The engine keeps `prefilling` and `prefilling_work` as requests come, start, get preempted
    (a 100-block cache that long answers outgrow), are refused and finish: after every operation
    they equal a recount."""
    engine = SimEngine("n0", ENGINE, priority_scheduling=priority)
    for index, op in enumerate(ops):
        if op == "step":
            if engine.has_work():
                plan = engine.step()
                engine.finish_step(plan, float(index))
        else:
            prompt, answer, cached = op
            request = SimRequest(index, f"s{index}", float(index), prompt, answer, cached_tokens=min(cached, prompt))
            request.priority_rank = index % 3
            engine.add(request)
        assert (engine.prefilling, engine.prefilling_work) == _recounted(engine)


def test_an_advised_turn_leaves_its_node_when_a_prefill_started_there_after_the_advisory() -> None:
    """s (102 tokens on n0) is advised at t=0 to n0, where its KV is. At t=10 "long" (3,000 tokens,
    2,000 of them held on n0, which the simulated costs keep there: moving them takes 2,005 ms,
    computing the 1,000 n0 lacks 1,000) starts a 1,000-token prefill on n0 that ends at 1,020 ms.
    When s arrives at t=500, its advised node is mid-prefill: s goes to n1 and pulls its 102 tokens
    (5 + 102 ms) instead of starting behind."""
    policy = symphony()
    sim = ClusterSim(policy, {"n0": ENGINE, "n1": ENGINE}, LINK, route_pull_wait_ms=3000, route_pull_min_tokens=32)
    sim.seed_kv("s", "n0", 102)
    sim.seed_kv("long", "n0", 2000)
    result = sim.run([Turn("long", 10, 3000, 2), Turn("s", 500, 150, 1, advisory_ms=0)])
    turn, long = by_session(result)["s"], by_session(result)["long"]
    assert long.node_id == "n0" and long.first_token_ms == 10 + 10 + 1000
    assert turn.node_id == "n1" and turn.cached_tokens == 102
    assert turn.ttft_ms == 107 + 10 + 48


def test_a_next_turn_on_the_same_node_prefills_only_what_is_new() -> None:
    """Turn 2 (prompt 150 = turn 1's 100 + 2 answer tokens + 48 new) finds 101 tokens of KV there:
    all of turn 1 but its last answer token, which was never fed back through the model."""
    sim = ClusterSim(make_policy("sticky"), {"n0": ENGINE, "n1": ENGINE}, LINK)
    result = sim.run([Turn("s", 0, 100, 2), Turn("s", 1000, 150, 1)])
    second = next(r for r in result.requests if r.arrival_ms == 1000)
    assert second.cached_tokens == 101 and second.prefilled_tokens == 49
    assert second.ttft_ms == 10 + 49  # one step: the new tokens and that last answer token


@pytest.mark.parametrize(
    ("advisory_ms", "wait_ms", "cached", "ttft_ms"),
    [(500, 3000, 102, 10 + 48), (990, 3000, 102, 97 + 10 + 48), (990, 50, 0, 50 + 10 + 150)],
)
def test_an_advisory_moves_the_history_to_the_node_it_picks_and_a_turn_waits_for_a_move_under_way(
    advisory_ms: int, wait_ms: int, cached: int, ttft_ms: int
) -> None:
    """Session s holds 102 tokens on n0, which is busy with a long prefill (3,010 ms from t=0), so the
    advisory picks n1 (a request's wait outweighs moving the KV) and moves them: 5 + 102 = 107 ms.
    Sent 500 ms ahead, the KV lands before the turn. Sent 10 ms ahead, the move ends at 1,097: the
    turn waits the 97 ms left (its pull joins the move) and prefills only its new tokens; when the
    scheduler waits at most 50 ms, it goes after 50 ms with nothing and recomputes its history. The
    advisory expects its request within 1 s (`typing_lead_ms`), when n0's prefill is still under way;
    were it expected after the prefill, the KV would stay on n0 (`test_symphony_costs`)."""
    sim = ClusterSim(
        symphony(),
        {"n0": ENGINE, "n1": ENGINE},
        LINK,
        route_pull_wait_ms=wait_ms,
        route_pull_min_tokens=32,
        typing_lead_ms=1_000,
    )
    sim.seed_kv("s", "n0", 102)
    result = sim.run([Turn("long", 0, 3000, 2), Turn("s", 1000, 150, 1, advisory_ms=advisory_ms)])
    turn, long = by_session(result)["s"], by_session(result)["long"]
    assert long.node_id == "n0" and turn.node_id == "n1"
    assert turn.cached_tokens == cached
    assert turn.ttft_ms == ttft_ms


@pytest.mark.parametrize(("wait_ms", "cached", "ttft_ms"), [(3000, 102, 107 + 10 + 48), (50, 0, 50 + 10 + 150)])
def test_a_turn_routed_away_from_its_kv_without_an_advisory_waits_for_the_pull(
    wait_ms: int, cached: int, ttft_ms: int
) -> None:
    """As above, with no advisory: the turn goes to n1 and waits for its 102 tokens to be pulled
    (107 ms) before its engine sees it. When the scheduler waits at most 50 ms, the turn goes after
    50 ms with nothing and recomputes its whole prompt."""
    sim = ClusterSim(
        symphony(),
        {"n0": ENGINE, "n1": ENGINE},
        LINK,
        route_pull_wait_ms=wait_ms,
        route_pull_min_tokens=32,
    )
    sim.seed_kv("s", "n0", 102)
    result = sim.run([Turn("long", 0, 3000, 2), Turn("s", 1000, 150, 1)])
    turn = by_session(result)["s"]
    assert turn.node_id == "n1" and turn.cached_tokens == cached and turn.ttft_ms == ttft_ms


def test_a_step_that_starts_beside_a_busy_neighbour_on_a_shared_host_takes_longer() -> None:
    """Slowdown 0.5. A (100 tokens) reaches n0 at 0: nobody else steps, 10 + 100 = 110 ms. B (50)
    reaches n1 at 20 while n0 steps: (10 + 50) x 1.5 = 90 ms, first token at 110. A's and B's
    decode steps (12 ms each) then start together at 110; n0 starts first, beside an idle n1
    (12 ms), n1 beside a busy n0 (18 ms)."""
    shared = dataclasses.replace(ENGINE, neighbour_slowdown=0.5)
    sim = ClusterSim(make_policy("round_robin"), {"n0": shared, "n1": shared}, LINK)
    result = sim.run([Turn("a", 0, 100, 2), Turn("b", 20, 50, 2)])
    a, b = by_session(result)["a"], by_session(result)["b"]
    assert (a.node_id, b.node_id) == ("n0", "n1")
    assert (a.first_token_ms, b.first_token_ms) == (110, 110)
    assert (a.finished_ms, b.finished_ms) == (122, 128)


def test_the_engines_prefix_cache_holds_whole_blocks_only() -> None:
    """recompute: no tiers, only vLLM's prefix cache, which finds whole blocks of 32. Turn 1's
    computed KV is 100 + 2 - 1 = 101 tokens: 3 whole blocks, 96 tokens, for turn 2 (150) to find;
    it prefills the other 54: 10 + 54 = 64 ms."""
    result = ClusterSim(make_policy("recompute"), {"n0": ENGINE}, LINK).run(
        [Turn("s", 0, 100, 2), Turn("s", 1000, 150, 1)]
    )
    second = next(r for r in result.requests if r.arrival_ms == 1000)
    assert (second.cached_tokens, second.prefilled_tokens, second.ttft_ms) == (96, 54, 64)


def test_a_policy_without_advisories_routes_as_if_none_were_sent() -> None:
    """As the scheduler, which accepts a baseline's advisories to no effect. Had b's advisory at 0
    picked a node for it, that node's announced load would have sent c (at 100) to the other one."""
    turns = [Turn("b", 5000, 50, 1), Turn("c", 100, 50, 1)]
    advised = [Turn("b", 5000, 50, 1, advisory_ms=0), Turn("c", 100, 50, 1)]

    def nodes_chosen(policy: str, workload: list[Turn]) -> dict[str, str]:
        sim = ClusterSim(make_policy(policy), {"n0": ENGINE, "n1": ENGINE}, LINK)
        return {r.session: r.node_id for r in sim.run(workload).requests}

    for policy in ("recompute", "least_load"):
        assert nodes_chosen(policy, advised) == nodes_chosen(policy, turns), policy


def test_prefill_attention_grows_with_the_positions_of_the_prefilled_tokens() -> None:
    """0.5 ms per prefilled token per 1,000 of its position. A: 200 new tokens, positions 0..200:
    200 x 100 / 1000 x 0.5 = 10 ms more, first token at 10 + 200 + 10 = 220. Its next turn (400
    tokens, 201 cached) prefills 199 tokens at positions 201..400: 199 x 300.5 / 1000 x 0.5 = 29.89975."""
    engine = dataclasses.replace(ENGINE, prefill_ms_per_token_kilotoken=0.5)
    result = ClusterSim(make_policy("sticky"), {"n0": engine}, LINK).run(
        [Turn("s", 0, 200, 2), Turn("s", 1000, 400, 1)]
    )
    first, second = sorted(result.requests, key=lambda r: r.arrival_ms)
    assert first.ttft_ms == 220
    assert second.cached_tokens == 201 and second.ttft_ms == pytest.approx(10 + 199 + 29.89975)


def test_without_free_blocks_the_newest_request_is_preempted_and_still_finishes() -> None:
    """4 blocks of 32: A (60 tokens) and B (60) take 2 each; A's 5th token needs a 3rd block, none
    is free, so B (the newest) is preempted, recomputed later, and both still finish."""
    small = EngineModel(
        step_ms=1,
        prefill_ms_per_token=0.1,
        decode_ms_per_seq=0.1,
        decode_ms_per_kilotoken=0,
        kv_blocks=4,
        block_size=32,
    )
    sim = ClusterSim(make_policy("least_load"), {"n0": small}, LINK)
    result = sim.run([Turn("a", 0, 60, 10), Turn("b", 0, 60, 10)])
    a, b = by_session(result)["a"], by_session(result)["b"]
    assert result.preemptions >= 1 and b.preemptions >= 1 and a.preemptions == 0
    assert a.generated == 10 and b.generated == 10 and b.finished_ms > a.finished_ms
    assert b.prefilled_tokens > 60  # its prompt and its output so far were computed again


def test_a_prompt_larger_than_the_whole_cache_is_refused() -> None:
    tiny = EngineModel(
        step_ms=1, prefill_ms_per_token=1, decode_ms_per_seq=1, decode_ms_per_kilotoken=0, kv_blocks=2, block_size=32
    )
    result = ClusterSim(make_policy("least_load"), {"n0": tiny}, LINK).run([Turn("a", 0, 100, 1)])
    assert [r.session for r in result.refused] == ["a"] and result.requests[0].first_token_ms is None


@pytest.mark.parametrize(
    "policy", ["symphony", "recompute", "sticky", "least_load", "consistent_hash", "prefix_trie", "round_robin"]
)
def test_every_real_policy_drives_the_simulator_to_completion(policy: str) -> None:
    turns = [
        Turn(f"s{s}", t * 2000 + s * 37, 200 + 150 * t, 20, advisory_ms=t * 2000 + s * 37 - 300)
        for s in range(12)
        for t in range(3)
    ]
    engines = {f"n{i}": ENGINE for i in range(3)}
    result = ClusterSim(make_policy(policy), engines, LINK).run(turns)
    assert len(result.requests) == 36 and not result.refused
    assert all(r.finished_ms is not None and r.generated == 20 for r in result.requests)
    assert sum(result.busy_ms.values()) > 0


def test_a_scripted_user_sends_the_next_turn_after_reading_and_typing() -> None:
    """Turn 1 (100 tokens, 2 out): 110 ms prefill, then a 12 ms decode: answered at 122. The user
    thinks 1,000 ms (typing the last 400), so the advisory fires at 722 and turn 2 arrives at 1,122
    with 100 + 2 + 48 tokens, 101 of them cached: one 59 ms step."""
    script = Script("u", 0, (Step(100, 2, 0, 0, advised=False), Step(48, 1, 1000, 400)))
    sim = ClusterSim(symphony(), {"n0": ENGINE}, LINK)
    first, second = sim.run(scripts=[script]).requests
    assert first.finished_ms == 122
    assert (second.arrival_ms, second.prompt_tokens, second.cached_tokens) == (1122, 150, 101)
    assert second.ttft_ms == 59 and second.finished_ms == 1181


def test_no_turn_arrives_after_the_end_of_the_run() -> None:
    script = Script("u", 0, tuple(Step(50, 1, 500, 100) for _ in range(10)))
    result = ClusterSim(make_policy("least_load"), {"n0": ENGINE}, LINK).run(scripts=[script], until_ms=2000)
    assert 1 < len(result.requests) < 10 and all(r.arrival_ms <= 2000 for r in result.requests)


def test_users_replay_sharegpt_with_human_timing_deterministically() -> None:
    conversations = load_sharegpt(SHAREGPT_SAMPLE, min_turns=2, max_turns=4)
    timing = HumanTiming(time_scale=1.0, advisory_miss_rate=0.5)
    one = sharegpt_users(conversations, 3, timing, conversations_per_user=2, seed=5)
    assert one == sharegpt_users(conversations, 3, timing, conversations_per_user=2, seed=5)
    chain = one[0]
    assert chain.after is not None and chain.after.session != chain.session and chain.after.after is None
    steps = [*chain.steps, *chain.after.steps]
    assert all(0 < s.typing_ms <= s.think_ms for s in steps)  # the advisory fires while the user thinks
    assert any(s.advised for s in steps) and any(not s.advised for s in steps)  # half are missed


def test_a_turns_work_is_its_prefill_and_its_share_of_the_decode_steps_as_computed_by_hand() -> None:
    """Prefill 1 ms/token + 0.5 ms/token per 1k of position; decode 2 ms per step + 4 ms per 1k of
    context. 200 of a 1,000-token prompt prefilled (positions 800-1000, mean 900): 200 + 0.5 x 200 x
    0.9 = 290 ms; 10 tokens out over a mean context of 1,005: 10 x (2 + 4 x 1.005) = 60.2 ms."""
    model = dataclasses.replace(ENGINE, decode_ms_per_kilotoken=4, prefill_ms_per_token_kilotoken=0.5)
    turn = SimRequest(1, "a", 0, prompt_tokens=1000, output_tokens=10, generated=10, prefilled_tokens=200)
    assert turn_work_ms(turn, model) == pytest.approx(290 + 60.2)
    points = {
        "symphony": {64: {"work_ms_per_turn_mean": 50.0}, 128: {"work_ms_per_turn_mean": 10.0}},
        "recompute": {64: {"work_ms_per_turn_mean": 150.0}, 128: {"work_ms_per_turn_mean": 10.0}},
    }
    assert work_ratio(points, "symphony") == 3.0  # at the fewest users


def test_the_users_scenario_runs_every_policy_and_reports_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    assert (
        main(
            [
                "bench",
                "sim",
                "--scenario",
                "users",
                "--out",
                str(out),
                "--nodes",
                "2",
                "--users",
                "2,4",
                "--max-users",
                "8",
                "--refine",
                "0",
                "--duration",
                "60",
                "--time-scale",
                "0.05",
                "--plot",
                str(tmp_path / "sim.png"),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert set(result["points"]) == {"symphony", "recompute", "sticky"}
    for rows in result["points"].values():
        assert {"2", "4"} <= set(rows) <= {"2", "4", "8"} and all(
            row["completed"] > 0 and row["tpot_ms_mean"] > 0 for row in rows.values()
        )
    assert set(result["limits"]) == {"symphony", "recompute", "sticky"}
    assert set(result["users_ratio_by_policy"]) == {"symphony", "sticky"}
    assert "users_ratio_ge_8" in result["targets"] and "users_ratio_ge_0.9x_work_ratio_bound" in result["targets"]
    assert result["work_ratio_bound"] > 1  # recompute prefills the histories the others keep
    assert result["work_ratio_at_fewest_users"]["symphony"] > 1
    assert result["tpot_bound_ms"] == pytest.approx(1.15 * result["points"]["recompute"]["2"]["tpot_ms_mean"])
    assert (tmp_path / "sim.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scenario", "nope"], "--scenario 'nope'"),
        (["--scenario", "users", "--users", "8,x"], "--users '8,x'"),
        (["--scenario", "users", "--preset", "h100"], "--preset 'h100'"),
    ],
)
def test_bad_bench_sim_flags_are_named(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "sim", "--out", str(tmp_path / "x.json"), *args]) == 2
    assert message in capsys.readouterr().err


def test_a_request_that_outgrows_the_whole_cache_alone_is_refused_not_stalled() -> None:
    """2 blocks of 32: the answer's 35th token needs a 3rd block; the request preempts itself, and
    readmitted it no longer fits the cache at all, so it is refused (the loop ends)."""
    tiny = EngineModel(
        step_ms=1,
        prefill_ms_per_token=0.1,
        decode_ms_per_seq=0.1,
        decode_ms_per_kilotoken=0,
        kv_blocks=2,
        block_size=32,
    )
    result = ClusterSim(make_policy("least_load"), {"n0": tiny}, LINK).run([Turn("a", 0, 30, 100)])
    (request,) = result.refused
    assert request.preemptions == 1 and request.finished_ms is None and request.first_token_ms is not None


@pytest.mark.parametrize(
    ("scenario", "keys"),
    [
        ("missed_advisories", {"latency_increase_at_10pct"}),
        ("imbalance", {"sticky_max_over_median", "symphony_max_over_median"}),
        ("priority", {"high_tpot_ratio_vs_recompute"}),
        ("agents", {"makespan_ratio_vs_recompute"}),
    ],
)
def test_the_one_point_scenarios_report_their_keys(scenario: str, keys: set[str], tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    assert (
        main(
            [
                "bench",
                "sim",
                "--scenario",
                scenario,
                "--out",
                str(out),
                "--nodes",
                "2",
                "--users",
                "6",
                "--duration",
                "60",
                "--time-scale",
                "0.05",
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["users"] == 6 and keys <= set(result) and all(result[k] is not None for k in keys)
    assert all(row["completed"] > 0 for row in result["points"].values())


def test_gpu_presets_follow_from_the_datasheets_and_the_model_config() -> None:
    """A100 80GB: weights (16.06 GB) read at 80% of 2,039 GB/s = 9.85 ms + 2 ms a step; its prefill
    is fitted to a profile (tests/unit/test_sim_users.py). L4: 2 x 8.03e9 FLOPs a token at half of
    121 TFLOPS = 0.265 ms, and its attention 4 x 4,096 x 32 layers x 1,000 FLOPs per 1,000 of
    position = 0.00867 ms, nothing overlapped. 0.9 x 80 GB - weights - 4 GB of activations in
    16-token blocks of 131,072 B a token = 24,766 blocks. L4's 300 GB/s makes decode ~6x slower."""
    a100, l4 = PRESETS["a100-llama3.1-8b"], PRESETS["l4-llama3.1-8b"]
    assert a100.engine.step_ms == pytest.approx(11.85, abs=0.01)
    assert l4.engine.prefill_ms_per_token == pytest.approx(0.265, abs=0.001)
    assert l4.engine.prefill_ms_per_token_kilotoken == pytest.approx(0.00867, abs=0.00001)
    assert l4.engine.prefill_overlap_ms == 0
    assert a100.engine.kv_blocks == 24_766 and a100.engine.block_size == 16
    assert a100.link.kv_bytes_per_token == 131_072
    assert 5.5 < l4.engine.step_ms / a100.engine.step_ms < 6 and l4.engine.kv_blocks < a100.engine.kv_blocks / 10


def test_priority_scheduling_admits_the_high_turn_first_and_preempts_the_lowest_as_computed_by_hand() -> None:
    """5 blocks of 32. t=0: L (low, 64 tokens, 3 blocks) prefills: 10 + 64 = 74 ms. N (normal, 60)
    arrives at 1 and H (high, 60) at 2; at 74 the 2 free blocks take one of them, prefilled beside
    L's decode: 10 + 60 + 2 = 72 -> first token at 146. Priority scheduling takes H; FCFS takes N."""
    five = dataclasses.replace(ENGINE, kv_blocks=5)
    turns = [Turn("l", 0, 64, 20, priority="low"), Turn("n", 1, 60, 2), Turn("h", 2, 60, 2, priority="high")]
    for priority_scheduling, first in ((True, "h"), (False, "n")):
        sim = ClusterSim(make_policy("least_load"), {"n0": five}, LINK, engine_priority_scheduling=priority_scheduling)
        sessions = by_session(sim.run(turns))
        assert sessions[first].first_token_ms == 146  # type: ignore[attr-defined]
        other = sessions["n" if first == "h" else "h"]
        assert other.first_token_ms > 146  # type: ignore[attr-defined]
    # 4 blocks: L (admitted first) and H (next step) hold 2 each; L's context reaches 64 first and needs
    # a 3rd block. Priority scheduling preempts the lowest priority (L itself); FCFS the latest admitted (H).
    tight = dataclasses.replace(ENGINE, kv_blocks=4)
    for priority_scheduling, victim in ((True, "l"), (False, "h")):
        sim = ClusterSim(make_policy("least_load"), {"n0": tight}, LINK, engine_priority_scheduling=priority_scheduling)
        result = by_session(sim.run([Turn("l", 0, 60, 10, priority="low"), Turn("h", 1, 60, 10, priority="high")]))
        spared = "h" if victim == "l" else "l"
        assert result[victim].preemptions >= 1 and result[spared].preemptions == 0  # type: ignore[attr-defined]


def test_an_agent_project_runs_its_steps_in_dependency_order_as_computed_by_hand() -> None:
    """One engineer, one review. Architect: prompt 20, 5 tokens: 10 + 20 = 30, then 4 decodes of 12 -> 78.
    Engineer from 78: prompt 20 + 5 = 25, 4 tokens: 35 + 3 x 12 -> 149. QA from 149: prompt 20 + 4 = 24,
    3 tokens: 34 + 2 x 12 -> 207, the makespan."""
    project = AgentProject(
        "p",
        0.0,
        engineers=1,
        rounds=1,
        system_tokens=10,
        task_tokens=10,
        design_tokens=5,
        code_tokens=4,
        review_tokens=3,
    )
    sim = ClusterSim(make_policy("recompute"), {"n0": ENGINE}, LINK)
    run = ProjectRun(sim, project, hints=False)
    run.start()
    result = by_session(sim.run())
    assert [result[s].finished_ms for s in ("p-architect", "p-engineer0", "p-qa")] == [78, 149, 207]  # type: ignore[attr-defined]
    assert run.makespan_ms == 207


def test_agent_projects_are_seeded_and_review_in_rounds() -> None:
    projects = agent_projects(4, stagger_ms=1000, seed=3)
    assert projects == agent_projects(4, stagger_ms=1000, seed=3) and projects != agent_projects(4, stagger_ms=1000)
    roomy = dataclasses.replace(ENGINE, kv_blocks=1000)  # QA's last prompt carries every round's code
    sim = ClusterSim(symphony(roomy), {"n0": roomy, "n1": roomy}, LINK)
    runs = [ProjectRun(sim, p, hints=True) for p in projects]
    for run in runs:
        run.start()
    result = sim.run()
    assert all(run.makespan_ms is not None for run in runs)
    per_session = {}
    for request in result.requests:
        per_session[request.session] = per_session.get(request.session, 0) + 1
    assert per_session["p0-qa"] == 3 and per_session["p0-engineer2"] == 3 and per_session["p0-architect"] == 1


def test_admission_keeps_the_held_back_wait_short_under_open_loop_overload() -> None:
    """Requests arrive at twice what one engine of 4 slots serves (measured on a burst). Without
    admission the scheduler's queue grows for the whole minute and the last arrivals wait tens of
    seconds; with it (the scheduler's code, `scheduler.admission`) the surplus is refused and the
    requests served wait about the bound at most, plus one batch's turn on the engine."""
    engine = dataclasses.replace(ENGINE, max_batch=4, kv_blocks=1_000)

    def sim(max_queue_wait_s: float, turns: list[Turn]) -> tuple[list[float], int]:
        policy = make_policy("symphony")
        result = ClusterSim(
            policy, {"n0": engine}, LINK, max_queued_requests=100_000, max_queue_wait_s=max_queue_wait_s
        ).run(turns=turns)
        return sorted(r.ttft_ms for r in result.requests if r.first_token_ms is not None), len(result.refused)

    burst = [Turn(f"b{n}", 0, 100, 20) for n in range(200)]
    ttfts, _ = sim(math.inf, burst)
    per_s = len(burst) / (ttfts[-1] + 0.0) * 1000  # first tokens of a saturated engine
    batch_ms = 4 * 1000 / per_s  # one batch's turn: four slots free up
    turns = [Turn(f"s{n}", n * 500 / per_s, 100, 20) for n in range(int(60 * 2 * per_s))]
    collapse, collapse_refused = sim(math.inf, turns)
    bounded, bounded_refused = sim(2.0, turns)
    p99 = [t[int(0.99 * (len(t) - 1))] for t in (collapse, bounded)]
    assert collapse_refused == 0 and p99[0] > 20_000, p99
    assert 0.3 * len(turns) < bounded_refused < 0.7 * len(turns)  # about half the offered load is surplus
    assert p99[1] <= 2_000 + 2 * batch_ms, (p99, batch_ms)
    assert len(bounded) >= 0.3 * len(turns)  # served at about the engine's rate all along

"""The regions on the simulator (eval.sim.regions) and `bench sim --scenario regions`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eval.sim.engine import SimRequest
from eval.sim.presets import PRESETS
from eval.sim.regions import ClientRecord, RegionsSim, RegionUser, summarize_regions, worst_window
from eval.sim.regions_scenario import EU_TENANT, REGIONS, diurnal_users, fewest_replicas, regions_topology
from eval.sim.turns import Script, Step
from eval.stats import percentile
from eval.workloads import SHAREGPT_SAMPLE, HumanTiming, load_sharegpt
from global_layer.policies import make_region_policy
from symphony.cli import main
from symphony.regions import build_topology

A100 = PRESETS["a100-llama3.1-8b"]


def _chatty(session: str, start_ms: float, turns: int = 6, new_tokens: int = 600) -> Script:
    """A user who answers at once: every turn arrives 200 ms after the last answer."""
    steps = tuple(Step(new_tokens, 32, think_ms=200.0, typing_ms=150.0) for _ in range(turns))
    return Script(session, start_ms, steps)


def _hot_us_east(count: int) -> list[RegionUser]:
    return [RegionUser("us-east", _chatty(f"us-{i}", i * 100.0)) for i in range(count)]


@given(st.integers(min_value=1, max_value=40), st.integers(min_value=1, max_value=40))
def test_fewest_replicas_finds_the_threshold_of_a_monotone_test(threshold: int, most: int) -> None:
    asked: list[int] = []

    def meets(n: int) -> bool:
        asked.append(n)
        return n >= threshold

    found = fewest_replicas(meets, most)
    assert found == (threshold if threshold <= most else None)
    assert len(asked) <= most.bit_length() + 2  # bisection, not a scan


def test_diurnal_users_peak_in_their_regions_day_and_keep_eu_only_users_in_eu_west() -> None:
    conversations = load_sharegpt(SHAREGPT_SAMPLE, min_turns=2, max_turns=8)
    users = diurnal_users(conversations, HumanTiming(), arrivals_per_min=600, day_ms=300_000, seed=3)
    by_region = {r: sorted(u.script.start_ms for u in users if u.region == r) for r in REGIONS}
    # us-east's day peaks mid-run: its middle third gets more arrivals than its first third
    east = by_region["us-east"]
    assert sum(1 for t in east if 100_000 <= t < 200_000) > 1.5 * sum(1 for t in east if t < 100_000)
    mean = 600 * 5  # per region over 5 minutes
    assert all(0.8 * mean < len(starts) < 1.2 * mean for starts in by_region.values())
    eu_only = [u for u in users if u.tenant == EU_TENANT]
    assert eu_only and all(u.region == "eu-west" for u in eu_only)


@pytest.mark.parametrize("policy", ["nearest", "skywalker", "gorgo", "gorgo_no_queue", "symphony"])
def test_an_eu_only_tenant_is_served_in_eu_west_under_every_policy_even_when_it_is_full(policy: str) -> None:
    users = [RegionUser("eu-west", _chatty(f"eu-{i}", i * 3.0), EU_TENANT) for i in range(40)]
    users += [RegionUser("eu-west", _chatty(f"free-{i}", i * 3.0)) for i in range(40)]
    result = RegionsSim(regions_topology(), make_region_policy(policy), A100, 1).run(users, 20_000)
    eu = [r for r in result.records if r.tenant == EU_TENANT]
    assert eu and all(r.region == "eu-west" for r in eu)
    assert result.residency_violations == 0
    if policy == "symphony":  # the tenant without a rule did leave the full region
        assert any(r.region != "eu-west" for r in result.records if r.tenant != EU_TENANT)


def test_symphony_sends_a_hot_regions_overflow_away_and_beats_nearest_on_p95() -> None:
    users = _hot_us_east(60)
    rows = {}
    for policy in ("nearest", "symphony"):
        result = RegionsSim(regions_topology(), make_region_policy(policy), A100, 1).run(users, 30_000)
        rows[policy] = summarize_regions(result, 30_000)
    assert rows["nearest"]["served_away_from_client"] == 0
    assert rows["symphony"]["served_away_from_client"] > 0
    assert rows["symphony"]["errors"] == rows["nearest"]["errors"] == 0
    assert rows["symphony"]["ttft_ms_p95"] < 0.7 * rows["nearest"]["ttft_ms_p95"]
    # the client's TTFT counts its round trip: one served 190 ms away took at least that long
    result = RegionsSim(regions_topology(), make_region_policy("symphony"), A100, 1).run(users, 30_000)
    far = [r for r in result.records if r.region != "us-east"]
    assert far and all(r.ttft_ms >= r.rtt_ms >= 75.0 for r in far)


def test_an_advisory_moves_kv_over_a_fat_link_and_the_next_turn_finds_it_there() -> None:
    """With 100 Gb/s between regions a history moves faster than it computes: an advisory sent
    while the home region is full moves it, and the turn that follows loads it."""
    topology = build_topology(
        ["us-east:1", "eu-west:1", "ap-south:1"],
        ["us-east~eu-west:75:100000", "us-east~ap-south:190:100000", "eu-west~ap-south:120:100000"],
        1.0,
        [],
    )
    users = _hot_us_east(60)
    sim = RegionsSim(topology, make_region_policy("symphony"), A100, 1)
    result = sim.run(users, 30_000)
    assert result.kv_moves > 0
    assert result.cross_region_kv_bytes >= result.kv_moves * A100.link.kv_bytes_per_token
    # a turn served in a region none of its session's earlier turns went to, finding its history
    seen: set[tuple[str, str]] = set()
    moved_in = []
    for record in sorted(result.records, key=lambda r: r.sent_ms):
        key = (record.request.session, record.region)
        if key not in seen and record.region != "us-east" and record.request.cached_tokens >= 600:
            moved_in.append(record)
        seen.add(key)
    assert moved_in, "no turn served away from home found its history there"


def test_a_run_stops_once_its_p95_must_miss_the_slo_and_the_p95_does() -> None:
    users = _hot_us_east(60)
    full = RegionsSim(regions_topology(), make_region_policy("nearest"), A100, 1).run(users, 30_000)
    sim = RegionsSim(regions_topology(), make_region_policy("nearest"), A100, 1)
    stopped = sim.run(users, 30_000, slo_ms=300.0)
    assert stopped.stopped_past_slo and not full.stopped_past_slo
    assert len(stopped.records) < len(full.records)
    assert summarize_regions(stopped, 30_000)["ttft_ms_p95"] > 300.0
    sim.loop.at(0.0, lambda: None)  # a stopped clock takes nothing more
    assert sim.loop.stopped and not sim.loop._events


def test_a_request_its_region_refuses_counts_as_an_error() -> None:
    too_big = A100.engine.kv_blocks * A100.engine.block_size + 1
    users = [RegionUser("us-east", Script("huge", 0.0, (Step(too_big, 8, 0.0, 0.0, advised=False),)))]
    users += _hot_us_east(2)
    result = RegionsSim(regions_topology(), make_region_policy("nearest"), A100, 1).run(users, 10_000)
    assert [user.script.session for user, _ in result.refused] == ["huge"]
    assert summarize_regions(result, 10_000)["errors"] == 1
    assert len(result.records) == 12  # the others were served


def test_bench_sim_regions_writes_replicas_for_the_slo_per_policy(tmp_path: Path) -> None:
    out = tmp_path / "regions.json"
    args = ["bench", "sim", "--scenario", "regions", "--out", str(out), "--duration", "60"]
    args += ["--arrivals-per-min", "300", "--max-replicas", "4", "--reference-replicas", "2"]
    assert main([*args, "--policies", "nearest,symphony,gorgo,gorgo_no_queue"]) == 0
    result = json.loads(out.read_text())
    assert set(result["replicas_for_slo"]) == {"nearest", "symphony", "gorgo", "gorgo_no_queue"}
    slo = result["slo_ms"]
    for key, p95 in (("replicas_for_slo", _worst_window_p95), ("replicas_for_slo_whole_day", _whole_day_p95)):
        searched = {**result[key], "pooled_bound": result["pooled_bound"][key]}
        for policy, replicas in searched.items():
            if replicas is not None:  # met at that count, and not at one fewer (when that was run)
                met = result["points"][policy][str(replicas)]
                assert not met["stopped_past_slo"] and met["errors"] == 0 and p95(met) <= slo
                below = result["points"][policy].get(str(replicas - 1))
                assert below is None or below["stopped_past_slo"] or below["errors"] > 0 or p95(below) > slo
    assert result["residency_violations"] == 0
    assert "symphony_replicas_le_0.75x_nearest" in result["targets"]


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--policies", "nearest,fastest", "--policies: unknown fastest"),
        ("--amplitude", "1.5", "--amplitude 1.5"),
        ("--arrivals-per-min", "0", "--arrivals-per-min 0"),
        ("--slo-ms", "-1", "--slo-ms -1"),
        ("--reference-replicas", "24", "--reference-replicas 24 is above --max-replicas 20"),
        # flags the other scenarios read are refused, not ignored
        ("--nodes", "8", "--nodes: not read by --scenario regions"),
        ("--agent-steps", "6", "--agent-steps: not read by --scenario regions"),
        ("--users", "64", "--users: not read by --scenario regions"),
    ],
)
def test_bench_sim_regions_names_a_bad_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    args = ["bench", "sim", "--scenario", "regions", "--out", str(tmp_path / "x.json"), flag, value]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_bench_sim_other_scenarios_refuse_the_regions_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "sim", "--scenario", "imbalance", "--out", str(tmp_path / "x.json"), "--slo-ms", "300"]
    assert main(args) == 2
    assert "--slo-ms: read only by --scenario regions, not imbalance" in capsys.readouterr().err


def _worst_window_p95(row: dict[str, Any]) -> float:
    return float(row["worst_window"]["ttft_ms_p95"])


def _whole_day_p95(row: dict[str, Any]) -> float:
    return float(row["ttft_ms_p95"])


def test_worst_window_is_the_worst_cell_of_window_and_home() -> None:
    def record(sent_ms: float, home: str, ttft_ms: float) -> ClientRecord:
        request = SimRequest(0, "s", sent_ms, 10, 1, first_token_ms=sent_ms + ttft_ms)
        return ClientRecord(request, home, home, 0.0, "default", sent_ms, home)

    records = [record(t, "a", 10.0) for t in range(0, 2000, 10)]  # a: fast all day
    records += [record(t, "b", 10.0) for t in range(0, 1000, 10)]  # b: fast, then slow in window 1
    records += [record(t, "b", 900.0) for t in range(1000, 2000, 10)]
    worst = worst_window(records, 1000.0, 2000.0)
    assert worst is not None
    assert worst["client_home"] == "b" and worst["window_start_s"] == 1.0 and worst["requests"] == 100
    assert worst["ttft_ms_p95"] == pytest.approx(900.0) and worst["cells"] == 4
    # over the whole day a quarter of the requests are slow: its p95 hides nothing here, but with
    # a slow cell of under 5% of the day the whole-day p95 stays fast while the window's is not
    few = [record(t, "a", 10.0) for t in range(0, 40_000, 10)] + [record(t, "b", 900.0) for t in range(0, 1000, 10)]
    assert percentile([r.ttft_ms for r in few], 95) == pytest.approx(10.0)
    assert worst_window(few, 1000.0, 40_000.0)["ttft_ms_p95"] == pytest.approx(900.0)  # type: ignore[index]
    # a request sent at the day's very end counts in its last window, not in one of its own
    ended = worst_window([*records, record(2000.0, "a", 5000.0)], 1000.0, 2000.0)
    assert ended is not None and ended["cells"] == 4

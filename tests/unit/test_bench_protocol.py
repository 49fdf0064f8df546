"""eval.protocol: the policies' order per repeat, the intervals over repeats and the verdicts; and a
whole repeated result (eval.bench_cluster.cluster_result) printed, plotted and reported."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from eval.bench_cluster import cluster_result, counter_by_label, index_lag_p99_bound_ms
from eval.cluster_summary import print_table
from eval.plots import plot_cluster
from eval.protocol import aggregate, compare, comparisons, log_interval, order_balance, pairs, rotation, verdict
from scheduler.metrics import SchedulerMetrics
from symphony.cli import main

T_975_DF2 = 4.302652729911275  # Student's t, 97.5th percentile, 2 degrees of freedom (tables)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_n_repeats_put_every_policy_once_in_every_position(n: int) -> None:
    policies = [f"p{i}" for i in range(n)]
    orders = rotation(policies, n)
    assert orders[0] == policies  # the first repeat keeps the order given
    assert all(sorted(order) == policies for order in orders)
    for position in range(n):
        assert sorted(order[position] for order in orders) == policies
    assert order_balance(orders) == {"positions": {p: [1] * n for p in policies}, "balanced": True}


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_a_full_period_balances_who_runs_right_after_whom(n: int) -> None:
    policies = [f"p{i}" for i in range(n)]
    period = n if n % 2 == 0 else 2 * n  # Williams: odd n needs the mirrored square too
    followers = Counter((o[j], o[j + 1]) for o in rotation(policies, period) for j in range(n - 1))
    assert len(followers) == n * (n - 1)  # every ordered pair of policies ...
    assert set(followers.values()) == {period // n}  # ... equally often


def test_repeats_that_are_not_a_multiple_cycle_the_rows_and_say_positions_are_unbalanced() -> None:
    orders = rotation(["a", "b", "c"], 4)
    assert orders[:3] == rotation(["a", "b", "c"], 3)
    balance = order_balance(orders)
    assert not balance["balanced"]
    assert all(sum(counts) == 4 for counts in balance["positions"].values())
    assert rotation(["a", "b", "c", "d"], 5)[4] == rotation(["a", "b", "c", "d"], 4)[0]  # even n: period n


def test_a_clear_win_has_its_whole_interval_below_one() -> None:
    # log ratios -1.0, -1.1, -0.9: mean -1, sd 0.1, n 3: half width t(0.975, 2) * 0.1 / sqrt(3).
    half = T_975_DF2 * 0.1 / math.sqrt(3)
    result = compare([math.exp(-1.0) * 100, math.exp(-1.1) * 200, math.exp(-0.9) * 50], [100, 200, 50])
    assert result["ratios"] == pytest.approx([math.exp(-1.0), math.exp(-1.1), math.exp(-0.9)])
    assert result["ratio_geomean"] == pytest.approx(math.exp(-1.0))
    assert result["ci95"] == pytest.approx([math.exp(-1 - half), math.exp(-1 + half)])  # [0.287, 0.472]
    assert (result["verdict"], result["repeats_used"]) == ("beats", 3)


def test_ratios_on_both_sides_of_one_tie() -> None:
    half = T_975_DF2 * 0.1 / math.sqrt(3)
    result = compare([math.exp(0.1), math.exp(-0.1), 1.0], [1.0, 1.0, 1.0])
    assert result["ci95"] == pytest.approx([math.exp(-half), math.exp(half)])  # [0.780, 1.282]
    assert result["verdict"] == "tie"


def test_a_clear_loss_has_its_whole_interval_above_one() -> None:
    half = T_975_DF2 * 0.1 / math.sqrt(3)
    result = compare([math.exp(1.0), math.exp(1.1), math.exp(0.9)], [1.0, 1.0, 1.0])
    assert result["ci95"] == pytest.approx([math.exp(1 - half), math.exp(1 + half)])  # [2.12, 3.48]
    assert result["verdict"] == "loses"


def test_three_lower_ratios_with_spread_are_no_win() -> None:
    # All three below 1, but as spread as chance makes them: a bootstrap would call it a win.
    assert compare([0.95, 0.6, 0.99], [1.0, 1.0, 1.0])["verdict"] == "tie"


def test_without_two_usable_repeats_there_is_no_interval_and_no_verdict_but_a_tie() -> None:
    assert compare([50.0], [100.0]) == {
        "ratios": [0.5],
        "ratio_geomean": pytest.approx(0.5),
        "ci95": None,
        "repeats_used": 1,
        "verdict": "tie",
    }
    missing = compare([50.0, math.nan, 60.0], [100.0, 100.0, 0.0])  # a run without requests, a zero
    assert missing["repeats_used"] == 1 and missing["ci95"] is None
    assert log_interval([0.5, 0.5]) == (0.5, 0.5)  # no spread: the interval is the value
    assert verdict((0.5, 0.5)) == "beats" and verdict((0.9, 1.0)) == "tie" and verdict(None) == "tie"


def test_pairs_put_symphony_first_then_the_order_given() -> None:
    assert pairs(["sticky", "symphony", "recompute"]) == [
        ("symphony", "sticky"),
        ("symphony", "recompute"),
        ("sticky", "recompute"),
    ]


def _summary(p50: float, p95: float, **more: Any) -> dict[str, Any]:
    return {
        "ttft_ms_p50": p50,
        "ttft_ms_p95": p95,
        "tpot_ms_mean": 30.0,
        "completed": 10,
        "errors": 0,
        "busy_s_by_node": {"node-0": 2.0, "node-1": 1.0},
        "max_over_mean_load": 1.2,
        "prefill_tokens_computed": 100,
        "prefill_tokens_total": 1000,
        "kv_ready_at_arrival_frac": 0.9,
        "prefix_hit_frac": 0.8,
        "advisory_lead_ms_p10": 200.0,
        "advisory_lead_ms_p50": 500.0,
        "advisory_lead_ms_p90": 900.0,
        "advisory_leads": 9,
        "routes": {"advised": 4},
        "index_lag_ms_p99": None,
        **more,
    }


def test_over_repeats_counts_add_up_and_figures_are_medians_with_intervals() -> None:
    runs = [_summary(100.0, 400.0), _summary(120.0, 500.0, errors=1), _summary(110.0, 300.0, routes={"x": 1})]
    out = aggregate(runs)
    assert (out["completed"], out["errors"], out["prefill_tokens_total"]) == (30, 1, 3000)
    assert out["busy_s_by_node"] == {"node-0": 6.0, "node-1": 3.0}
    assert out["routes"] == {"advised": 8, "x": 1}
    assert (out["ttft_ms_p50"], out["ttft_ms_p95"], out["max_over_mean_load"]) == (110.0, 400.0, 1.2)
    assert out["ttft_ms_p95_runs"] == [400.0, 500.0, 300.0]
    low, high = out["ttft_ms_p95_ci95"]
    assert low < 400.0 < high
    assert out["index_lag_ms_p99"] is None and out["repeats"] == 3


def _runs() -> list[dict[str, Any]]:
    orders = rotation(["symphony", "sticky", "recompute"], 3)
    p95 = {"symphony": [300.0, 320.0, 310.0], "sticky": [600.0, 650.0, 640.0], "recompute": [310.0, 290.0, 330.0]}
    return [
        {
            "repeat": k,
            "order": order,
            "seed": 7 + k,
            "workload": {"kind": "sharegpt", "conversations": 4},
            "policies": {p: _summary(p95[p][k] / 4, p95[p][k]) for p in order},
        }
        for k, order in enumerate(orders)
    ]


def test_a_repeated_result_keeps_every_run_and_gives_verdicts(capsys: pytest.CaptureFixture[str]) -> None:
    header = {"users": 8, "duration_s": 30, "time_scale": 0.05, "typing_time_scale": None, "workload_kind": "sharegpt"}
    result = cluster_result(_runs(), ["symphony", "sticky", "recompute"], header)
    assert list(result["policies"]) == ["symphony", "sticky", "recompute"]  # the order given, not a repeat's
    assert result["policies"]["sticky"]["ttft_ms_p95_runs"] == [600.0, 650.0, 640.0]  # repeat order
    assert result["comparisons"]["symphony/sticky"]["ttft_ms_p95"]["verdict"] == "beats"
    assert result["comparisons"]["symphony/recompute"]["ttft_ms_p95"]["verdict"] == "tie"
    assert result["comparisons"]["sticky/recompute"]["ttft_ms_p95"]["verdict"] == "loses"
    assert result["targets"]["symphony_ttft_p95_le_sticky"] and result["order_balance"]["balanced"]
    assert result["runs"][1]["order"] == result["orders"][1] and len(result["runs"]) == 3
    assert "symphony_kv_index_lag_seconds" in result["notes"]["index_lag_ms_p99"]
    json.dumps(result)  # the file it is written to
    print_table(result)
    printed = capsys.readouterr().out
    assert printed.count("\n") > 3 + 9  # a row for every run of every policy, then the summaries
    assert "symphony/sticky" in printed and "beats" in printed


def test_a_repeated_result_is_plotted_and_reported(tmp_path: Path) -> None:
    header = {"users": 8, "duration_s": 30, "time_scale": 0.05, "typing_time_scale": 1.0, "workload_kind": "skewed"}
    result = cluster_result(_runs(), ["symphony", "sticky", "recompute"], header)
    plot_cluster(result, tmp_path / "direct.png")
    assert (tmp_path / "direct.png").stat().st_size > 10_000
    (tmp_path / "cluster.json").write_text(json.dumps(result))
    assert main(["bench", "report", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "routing policies on the live cluster (bench cluster)" in report
    assert "| symphony/sticky |" in report and "beats" in report
    assert (tmp_path / "cluster.png").is_file()


def test_comparisons_cover_every_pair_once() -> None:
    by = {p: [_summary(1.0, 2.0)] * 2 for p in ("a", "b", "symphony")}
    assert list(comparisons(by)) == ["symphony/a", "symphony/b", "a/b"]


def test_a_histograms_p99_bound_is_read_from_the_schedulers_exposition() -> None:
    """The scheduler's own histogram, exposed as Prometheus text: 98 batches under 5 ms and 2 under
    50 ms put the p99 bound at the 50 ms bucket; none at all is nan."""
    metrics = SchedulerMetrics()
    assert math.isnan(index_lag_p99_bound_ms(generate_latest(metrics.registry).decode()))
    for _ in range(98):
        metrics.kv_index_lag.observe(0.004)
    metrics.kv_index_lag.observe(0.03)
    metrics.kv_index_lag.observe(0.04)
    assert index_lag_p99_bound_ms(generate_latest(metrics.registry).decode()) == 50.0


def test_a_counter_is_read_per_label_from_the_schedulers_exposition() -> None:
    metrics = SchedulerMetrics()
    assert counter_by_label(generate_latest(metrics.registry).decode(), "symphony_prefetches", "outcome") == {}
    metrics.prefetches.labels("in_engine").inc(3)
    metrics.prefetches.labels("done").inc()
    metrics.advised_requests.labels("typing", "yes").inc(2)
    metrics.advised_requests.labels("predecessor", "yes").inc()
    text = generate_latest(metrics.registry).decode()
    assert counter_by_label(text, "symphony_prefetches", "outcome") == {"in_engine": 3.0, "done": 1.0}
    assert counter_by_label(text, "symphony_advised_requests", "kv_ready") == {"yes": 3.0}


def test_shared_prefix_runs_are_held_to_issue_36s_bars() -> None:
    runs = _runs()
    p95 = {"symphony": 300.0, "prefix_trie": 400.0, "least_load": 700.0}
    for run in runs:
        run["policies"] = {p: _summary(v / 4, v, prefix_hit_frac=0.95) for p, v in p95.items()}
        run["order"] = list(p95)
    header = {"workload_kind": "shared-prefix"}
    result = cluster_result(runs, list(p95), header)
    assert result["targets"] == {
        "symphony_errors_zero": True,
        "symphony_prefix_hit_frac_ge_0.9": True,
        "symphony_ttft_p95_le_0.8x_prefix_trie": True,  # 300 <= 320
        "symphony_ttft_p95_le_half_least_load": True,  # 300 <= 350
    }
    result = cluster_result(runs, list(p95), {"workload_kind": "sharegpt"})
    assert "symphony_prefix_hit_frac_ge_0.9" not in result["targets"]

"""`symphony bench report DIR`: one Markdown page over every benchmark result file in DIR.

Each JSON file a `symphony bench ...` command wrote is recognised by its keys, summarised as a table
of its headline figures and targets, and drawn as a PNG next to it (the simulator scenarios in the
style of Symphony's figures 12, 17 and 18). Files of other shapes are listed as skipped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eval.cluster_summary import COLUMNS
from eval.plots import (
    plot_cluster,
    plot_resume,
    plot_route,
    plot_sim_agents,
    plot_sim_imbalance,
    plot_sim_missed,
    plot_sim_priority,
    plot_sim_users,
    plot_tiers,
)

Result = dict[str, Any]
REPORT_NAME = "report.md"


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "-" if value is None else str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(cell) for cell in row) + " |" for row in rows]
    return lines


def _targets(result: Result) -> list[str]:
    met = result.get("targets") or result.get("targets_met") or {}
    return [f"- target `{name}`: {'met' if ok else '**NOT met**'}" for name, ok in met.items()]


def _tiers(result: Result) -> list[str]:
    keys = (
        "memcpy_gbps",
        "dram_store_gbps",
        "dram_load_gbps",
        "disk_write_bound_gbps",
        "ssd_write_gbps",
        "disk_read_bound_gbps",
        "ssd_read_gbps",
        "loopback_bound_gbps",
        "peer_fetch_gbps",
        "ssd_first_layer_ready_ms",
        "ssd_all_layers_ready_ms",
    )
    lines = _table(["figure", "value"], [[key, result[key]] for key in keys if key in result])
    ratios = result.get("ratios", {})
    return [*lines, "", *_table(["ratio", "value"], [[name, value] for name, value in ratios.items()])]


def _resume(result: Result) -> list[str]:
    rows = [
        [path, result["ttft_ms"][path], result["ratio_to_engine_cache"][path], result["prefill_tokens_computed"][path]]
        for path in result["ttft_ms"]
    ]
    lines = _table(["path", "TTFT p50 (ms)", "x engine_cache", "prefill computed"], rows)
    summary = f"outputs identical: {_fmt(result['outputs_identical'])}; match p99 {_fmt(result['match_ms_p99'])} ms"
    return [*lines, "", summary]


def _cluster(result: Result) -> list[str]:
    """Each policy over the repeats (medians; the p95's 95% interval), then every pair's verdict."""
    rows = [
        [policy, *[row.get(c) for c in COLUMNS], _interval(row.get("ttft_ms_p95_ci95"))]
        for policy, row in result["policies"].items()
    ]
    lines = _table(["policy", *COLUMNS, "ttft_ms_p95 95% interval"], rows)
    comparisons = result.get("comparisons") or {}
    if comparisons:
        pairs = [
            [pair, *[f"{c[k]['ratio_geomean']:.2f} {_interval(c[k]['ci95'])} {c[k]['verdict']}" for k in sorted(c)]]
            for pair, c in comparisons.items()
        ]
        keys = sorted(next(iter(comparisons.values())))
        lines += ["", f"Over {result.get('repeats')} repeats, ratio (geometric mean) [95% interval] verdict:", ""]
        lines += _table(["pair", *keys], pairs)
    return lines


def _interval(bounds: list[float] | None) -> str:
    return f"[{bounds[0]:.3g}, {bounds[1]:.3g}]" if bounds else "-"


def _route(result: Result) -> list[str]:
    rows = [
        [policy, row["decision_us_p50"], row["decision_us_p99"], row.get("peak_memory_mb")]
        for policy, row in result["policies"].items()
    ]
    return _table(["policy", "decision p50 (µs)", "p99 (µs)", "peak memory (MB)"], rows)


def _sim_users(result: Result) -> list[str]:
    rows = [
        [policy, users, row["tpot_ms_mean"], row["norm_latency_ms_per_token_mean"], row["ttft_ms_p95"]]
        for policy, points in result["points"].items()
        for users, row in points.items()
    ]
    lines = _table(["policy", "users", "TPOT mean (ms)", "norm. latency (ms/token)", "TTFT p95 (ms)"], rows)
    ratios = result.get("users_ratio_by_policy", {})
    measured = result.get("work_ratio_at_fewest_users", {})
    return [
        *lines,
        "",
        f"workload: {result.get('users_workload', 'sharegpt')}; "
        f"work_ratio_bound: {_fmt(result.get('work_ratio_bound'))}",
        "",
        f"users_ratio_at_equal_tpot: {_fmt(result.get('users_ratio_at_equal_tpot'))}",
        "",
        *(
            f"- {policy}: users ratio {_fmt(ratio)}, work ratio at the fewest users {_fmt(measured.get(policy))}"
            for policy, ratio in ratios.items()
        ),
    ]


def _sim_single(result: Result) -> list[str]:
    rows = [
        [
            name,
            row["tpot_ms_mean"],
            row["norm_latency_ms_per_token_mean"],
            row["ttft_ms_p95"],
            row["max_over_median_load"],
        ]
        for name, row in result["points"].items()
    ]
    lines = _table(["point", "TPOT mean (ms)", "norm. latency (ms/token)", "TTFT p95 (ms)", "max/median load"], rows)
    keys = [
        k
        for k in (
            "latency_increase_at_10pct",
            "sticky_max_over_median",
            "symphony_max_over_median",
            "high_tpot_ratio_vs_recompute",
            "makespan_ratio_vs_recompute",
        )
        if k in result
    ]
    return lines + [""] + [f"{key}: {_fmt(result[key])}" for key in keys]


def _validate(result: Result) -> list[str]:
    rows = [
        [key, result["live"][key], result["simulated"][key], error] for key, error in result["relative_error"].items()
    ]
    table = _table(["figure", "live", "simulated", "relative error"], rows)
    return [*table, "", f"sim_vs_live_error: {_fmt(result['sim_vs_live_error'])}"]


def _calibrate(result: Result) -> list[str]:
    fit = result["fit_r2"]
    table = _table(["constant", "value"], list(result["engine"].items()))
    return [*table, "", f"fit R²: prefill {_fmt(fit['prefill'])}, decode {_fmt(fit['decode'])}"]


Section = tuple[str, Callable[[Result], list[str]], Callable[[Result, Path], None] | None]


def _section(result: Result) -> Section | None:
    """(title, table maker, plotter) for a result of a known shape, else None."""
    scenario = result.get("scenario")
    if scenario == "users":
        return "simulator: users (figure 12)", _sim_users, plot_sim_users
    if scenario == "missed_advisories":
        return "simulator: missed advisories (figure 17)", _sim_single, plot_sim_missed
    if scenario == "imbalance":
        return "simulator: load imbalance (figure 18)", _sim_single, plot_sim_imbalance
    if scenario == "agents":
        return "simulator: agent projects", _sim_single, plot_sim_agents
    if scenario == "priority":
        return "simulator: priority tiers", _sim_single, plot_sim_priority
    if scenario is not None:
        return f"simulator: {scenario}", _sim_single, None
    if "peer_fetch_gbps" in result:
        return "tiered store (bench tiers)", _tiers, plot_tiers
    if "ratio_to_engine_cache" in result:
        return f"resumed turn, {result.get('context_tokens')} tokens (bench resume)", _resume, plot_resume
    if "sim_vs_live_error" in result:
        return "simulator against the live cluster (bench validate)", _validate, None
    if "fit_r2" in result and "engine" in result:
        return "engine calibration (bench calibrate)", _calibrate, None
    policies = result.get("policies")
    if isinstance(policies, dict) and policies and all("decision_us_p99" in r for r in policies.values()):
        return "routing cost (bench route)", _route, plot_route
    if isinstance(policies, dict) and policies and all("ttft_ms_p95" in r for r in policies.values()):
        return "routing policies on the live cluster (bench cluster)", _cluster, plot_cluster
    return None


def build_report(directory: Path) -> Path:
    """Write DIR/report.md (and a PNG per result that has a plot); returns the report's path."""
    lines = [f"# Symphony benchmark report: {directory.name}", ""]
    skipped = []
    for path in sorted(directory.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            skipped.append(path.name)
            continue
        section = _section(result) if isinstance(result, dict) else None
        if section is None:
            skipped.append(path.name)
            continue
        title, table, plotter = section
        lines += [f"## {title}", "", f"From `{path.name}`.", ""]
        lines += table(result)
        targets = _targets(result)
        if targets:
            lines += ["", *targets]
        if plotter is not None:
            png = path.with_suffix(".png")
            plotter(result, png)
            lines += ["", f"![{title}]({png.name})"]
        lines.append("")
    if skipped:
        lines += ["## Not recognised", "", *[f"- `{name}`" for name in skipped], ""]
    report = directory / REPORT_NAME
    report.write_text("\n".join(lines))
    return report

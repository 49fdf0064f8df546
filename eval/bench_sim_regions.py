"""`symphony bench sim --scenario regions` (eval.sim.regions_scenario): runs it, writes the JSON,
prints the table, draws the plot."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eval.plots import plot_sim_regions
from eval.results import write_result
from eval.sim.presets import Preset
from eval.sim.regions_scenario import regions_scenario
from eval.workloads import Conversation, HumanTiming


def run_sim_regions_bench(
    *,
    out: Path,
    preset: Preset,
    workload: Path,
    conversations: Sequence[Conversation],
    policies: Sequence[str],
    arrivals_per_min: float,
    duration_s: float,
    timing: HumanTiming,
    slo_ms: float,
    reference_replicas: int,
    max_replicas: int,
    amplitude: float,
    seed: int,
    pooled_bound: bool = True,
    plot: Path | None = None,
) -> dict[str, Any]:
    started = time.monotonic()
    body = regions_scenario(
        preset,
        conversations,
        arrivals_per_min=arrivals_per_min,
        duration_ms=duration_s * 1000,
        timing=timing,
        policies=policies,
        slo_ms=slo_ms,
        reference_replicas=reference_replicas,
        max_replicas=max_replicas,
        amplitude=amplitude,
        pooled_bound=pooled_bound,
        seed=seed,
    )
    result = {
        "scenario": "regions",
        "preset": preset.name,
        "preset_source": preset.source,
        "duration_s": duration_s,
        "time_scale": timing.time_scale,
        "miss_rate": timing.advisory_miss_rate,
        "workload": str(workload),
        "conversations": len(conversations),
        "seed": seed,
        **body,
        "wall_s": round(time.monotonic() - started, 1),
    }
    write_result(result, out, table=print_sim_regions, plot=plot, plotter=plot_sim_regions)
    return result


def print_sim_regions(result: dict[str, Any]) -> None:
    reference = result["reference_replicas"]
    print(
        f"{result['users']:,} users over {result['duration_s']:g} s, SLO p95 TTFT {result['slo_ms']:g} ms in every "
        f"{result['slo_window_s']:g} s window (whole day: one p95); figures at {reference} replicas per region"
    )
    print(
        f"{'policy':<16}{'replicas':>9}{'whole day':>10}{'p50':>9}{'p95':>10}{'e2e p95':>10}"
        f"{'away':>7}{'moves':>7}{'max/mean':>9}"
    )
    most = result["max_replicas"]
    bound = result.get("pooled_bound")
    if bound is not None:
        print(f"{'(pooled bound)':<16}{_count(bound['replicas_for_slo'], most):>9}")
    for policy, replicas in result["replicas_for_slo"].items():
        row = result["at_reference"][policy]
        print(
            f"{policy:<16}{_count(replicas, most):>9}{_count(result['replicas_for_slo_whole_day'][policy], most):>10}"
            f"{_ms(row['ttft_ms_p50']):>9}{_ms(row['ttft_ms_p95']):>10}{_ms(row['e2e_ms_p95']):>10}"
            f"{row['served_away_from_client']:>7}{row['kv_moves_across_regions']:>7}"
            f"{row['max_over_mean_load'] or 0:>9.2f}"
        )
    for name, met in result.get("targets", {}).items():
        print(f"  {name}: {'met' if met else 'NOT met'}")


def _count(replicas: int | None, most: int) -> str:
    return str(replicas) if replicas is not None else f">{most}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"

"""`bench cluster`'s figures: one policy run's summary of its request records, issue 5's targets over
the per-policy figures, and the table printed at the end.

Keys per run: TTFT p50/p95, mean TPOT, mean normalized latency (end-to-end time per output token),
requests completed and failed, `max_over_mean_load` (per node busy time: the sum of its requests'
durations, busiest over mean), prompt tokens computed and in total, `kv_ready_at_arrival_frac`
(resumed turns that found at least 90% of their history cached when they arrived), the typing
advisories' round trips as the load generator saw them (`advisory_ms_p50/p99`) and their leads
(`advisory_lead_ms_p10/p50/p90`, `advisory_leads`: from the advisory to the request's arrival, in
real ms), and `prefix_hit_frac`: cached prompt tokens over the prompt tokens whose KV existed
somewhere in the cluster when the request was sent (`RequestRecord.existed_tokens`); `cold_requests`
(none of whose prompt existed anywhere) and `ttft_ms_p95_reusable` (the p95 of the others).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from eval.loadgen import RequestRecord
from eval.stats import percentile

READY_FRACTION = 0.9  # of a resumed turn's history, cached at arrival, to count as "ready"
BLOCK_SLACK_TOKENS = 32  # the history's last block may not be reusable (the answer's end re-templated)
INDEX_LAG_NOTE = (
    "index_lag_ms_p99: the bucket bound (ms) under which 99% of the nodes' block event batches, heartbeats "
    "included, reached the scheduler's index after the node published them (its histogram "
    "symphony_kv_index_lag_seconds), the median over repeats; nan: no batch arrived"
)


def _pcts(values: list[float], *qs: int) -> list[float]:
    return [percentile(values, q) if values else math.nan for q in qs]


def summarize(records: list[RequestRecord], nodes: list[str]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    busy = {node: 0.0 for node in nodes}
    for r in records:
        if r.node in busy:
            busy[r.node] += r.e2e_s
    mean_busy = statistics.fmean(busy.values()) if busy else 0.0
    advisory_ms = [r.advisory_ms for r in records if r.advisory_ms > 0]
    leads_ms = [r.advisory_lead_s * 1000 for r in records if r.advised]
    ready, resumed, new_tokens = 0, 0, 0
    history: dict[str, int] = {}  # session -> tokens its last turn left (prompt + answer)
    for r in sorted(ok, key=lambda r: (r.session, r.turn)):
        if r.session in history:
            resumed += 1
            ready += r.cached_tokens >= READY_FRACTION * history[r.session] - BLOCK_SLACK_TOKENS
        new_tokens += max(0, r.prompt_tokens - history.get(r.session, 0))
        history[r.session] = r.prompt_tokens + r.output_tokens
    existed = sum(r.existed_tokens for r in ok)
    cached_within = sum(min(r.cached_tokens, r.existed_tokens) for r in ok)
    ttft_ms = [r.ttft_s * 1000 for r in ok]
    reusable_ms = [r.ttft_s * 1000 for r in ok if r.existed_tokens > 0]
    lead_p10, lead_p50, lead_p90 = _pcts(leads_ms, 10, 50, 90)
    return {
        "ttft_ms_p50": percentile(ttft_ms, 50),
        "ttft_ms_p95": percentile(ttft_ms, 95),
        "tpot_ms_mean": statistics.fmean(r.tpot_s * 1000 for r in ok) if ok else float("nan"),
        "norm_latency_ms_per_token_mean": (
            statistics.fmean(r.e2e_s * 1000 / max(1, r.output_tokens) for r in ok) if ok else float("nan")
        ),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "busy_s_by_node": busy,
        "max_over_mean_load": max(busy.values()) / mean_busy if mean_busy else float("nan"),
        "prefill_tokens_computed": sum(r.computed_tokens for r in ok),
        "prefill_tokens_total": sum(r.prompt_tokens for r in ok),
        # What no cache can hold: first turns' prompts, later turns' new messages. Its share of the
        # total is the floor of computed/total for the workload as this policy's run replayed it.
        "prefill_tokens_new": new_tokens,
        "kv_ready_at_arrival_frac": ready / resumed if resumed else float("nan"),
        "resumed_turns": resumed,
        # Reuse of what could be reused: cached tokens (within what existed) over the tokens whose KV
        # existed somewhere at arrival. Cached tokens beyond that are counted apart: they mean the
        # workload's account of what existed missed something.
        "prefix_hit_frac": cached_within / existed if existed else float("nan"),
        "prefix_tokens_existed": existed,
        "prefix_tokens_cached": cached_within,
        "prefix_cached_beyond_existed_tokens": sum(max(0, r.cached_tokens - r.existed_tokens) for r in ok),
        # Requests with nothing to reuse (no KV of their prompt anywhere at arrival: every policy
        # computes them whole), and the p95 of the others: what routing can change.
        "cold_requests": sum(1 for r in ok if r.existed_tokens == 0),
        "ttft_ms_p95_reusable": percentile(reusable_ms, 95) if reusable_ms else float("nan"),
        "index_lag_ms_p99": None,  # INDEX_LAG_NOTE: from the scheduler's metrics, not the records
        # Client-side round trips (an upper bound on the scheduler's own time to answer).
        "advisory_ms_p50": percentile(advisory_ms, 50) if advisory_ms else float("nan"),
        "advisory_ms_p99": percentile(advisory_ms, 99) if advisory_ms else float("nan"),
        # How long before its request each advisory came (real time, after --time-scale).
        "advisory_lead_ms_p10": lead_p10,
        "advisory_lead_ms_p50": lead_p50,
        "advisory_lead_ms_p90": lead_p90,
        "advisory_leads": len(leads_ms),
        "requests_by_node": {node: sum(1 for r in ok if r.node == node) for node in nodes},
        # The scheduler's share of TTFT: routing, the push queue, waiting for a pull of the KV.
        "routed_ms_p50": percentile([r.routed_ms for r in ok], 50) if ok else float("nan"),
        "routed_ms_p95": percentile([r.routed_ms for r in ok], 95) if ok else float("nan"),
        "routes": {reason: sum(1 for r in ok if r.route == reason) for reason in sorted({r.route for r in ok})},
    }


OPEN_LOOP_KINDS = ("shared-prefix", "trace")  # workload kinds whose sessions share prefixes


def targets(result: dict[str, Any]) -> dict[str, bool]:
    """Issue 5's bars (issue 36's on the shared-prefix and trace workloads), for the policies the
    run measured, on the per-policy figures (over repeats: medians, errors and token counts summed).
    Which policy is faster beyond noise is `comparisons`' verdicts, not these."""
    by = result["policies"]
    out: dict[str, bool] = {}
    if "symphony" not in by:
        return out
    s = by["symphony"]
    out["symphony_errors_zero"] = s["errors"] == 0
    if result.get("workload_kind") in OPEN_LOOP_KINDS:
        # Issue 36's bars for prefixes shared across sessions.
        out["symphony_prefix_hit_frac_ge_0.9"] = s["prefix_hit_frac"] >= 0.9
        if "prefix_trie" in by:
            out["symphony_ttft_p95_le_0.8x_prefix_trie"] = s["ttft_ms_p95"] <= 0.8 * by["prefix_trie"]["ttft_ms_p95"]
        if "least_load" in by:
            out["symphony_ttft_p95_le_half_least_load"] = s["ttft_ms_p95"] <= 0.5 * by["least_load"]["ttft_ms_p95"]
        return out
    out["symphony_prefill_computed_le_0.1"] = s["prefill_tokens_computed"] <= 0.1 * s["prefill_tokens_total"]
    if "recompute" in by:
        out["symphony_ttft_p95_le_half_recompute"] = s["ttft_ms_p95"] <= 0.5 * by["recompute"]["ttft_ms_p95"]
    if "sticky" in by:
        out["symphony_ttft_p95_le_sticky"] = s["ttft_ms_p95"] <= by["sticky"]["ttft_ms_p95"]
        out["symphony_load_balance_le_sticky"] = s["max_over_mean_load"] <= by["sticky"]["max_over_mean_load"]
    return out


COLUMNS = (
    "ttft_ms_p50",
    "ttft_ms_p95",
    "tpot_ms_mean",
    "completed",
    "errors",
    "max_over_mean_load",
    "kv_ready_at_arrival_frac",
    "prefix_hit_frac",
)


def _cell(value: Any) -> str:
    return f"{value:>14.2f}" if isinstance(value, float) else f"{value!s:>14}"


def _interval(values: list[float] | None) -> str:
    return f"[{values[0]:.0f}, {values[1]:.0f}]" if values else "-"


def print_table(result: dict[str, Any]) -> None:
    """Every run's figures, then each policy over the repeats, then the pairwise verdicts."""
    kind = result["workload_kind"]
    if kind in ("sharegpt", "skewed"):
        load = f"{result['users']} users, time scale {result['time_scale']:g}"
        if result.get("typing_time_scale") is not None:
            load += f", typing time scale {result['typing_time_scale']:g}"
    else:
        rates = ", ".join(f"{run['workload']['rate_per_s']:.2f}" for run in result["runs"])
        load = f"open loop, arrivals per second by repeat: {rates}"
    print(f"{kind}: {load}; {result['duration_s']:.0f} s per policy run, {result['repeats']} repeat(s)")
    header = f"{'run':<5}{'policy':<14}" + "".join(f"{c[:13]:>14}" for c in COLUMNS)
    print(header + f"{'computed/total':>16}  advisory leads ms p10/p50/p90 (count)")
    for run in result["runs"]:
        for policy in run["order"]:
            s = run["policies"][policy]
            share = s["prefill_tokens_computed"] / (s["prefill_tokens_total"] or math.nan)
            leads = "/".join(f"{s[f'advisory_lead_ms_p{q}']:.0f}" for q in (10, 50, 90)) + f" ({s['advisory_leads']})"
            print(
                f"{run['repeat']:<5}{policy:<14}" + "".join(_cell(s[c]) for c in COLUMNS) + f"{share:>16.3f}  {leads}"
            )
    print(f"over repeats (median, 95% interval of the geometric mean over {result['repeats']} repeat(s)):")
    for policy, s in result["policies"].items():
        print(
            f"  {policy:<14} TTFT p50 {s['ttft_ms_p50']:.0f} ms {_interval(s['ttft_ms_p50_ci95'])}"
            f"  p95 {s['ttft_ms_p95']:.0f} ms {_interval(s['ttft_ms_p95_ci95'])}"
            f"  completed {s['completed']}, errors {s['errors']}"
        )
    for pair, figures in result["comparisons"].items():
        parts = []
        for key, c in figures.items():
            ci = f"[{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]" if c["ci95"] else "no interval"
            parts.append(f"{key[8:]} ratio {c['ratio_geomean']:.2f} {ci} {c['verdict']}")
        print(f"  {pair:<26} " + "; ".join(parts))
    if not result["order_balance"]["balanced"]:
        print("  (positions not balanced: repeats not a multiple of the number of policies)")
    for name, ok in result["targets"].items():
        print(f"  target {name}: {'met' if ok else 'NOT met'}")

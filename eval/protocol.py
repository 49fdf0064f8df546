"""The repeated-measures protocol of `bench cluster --repeats R`: in which order the policies run in
each repeat, how a policy's figures are summarised over repeats, and when one policy beats another.

Order. The order a policy runs in moved `bench cluster`'s TTFT more than the policy did (issue 36),
so each repeat runs the policies in another order: the rows of a Williams design (a Latin square
whose rows also balance which policy runs right after which), relabelled so that the first repeat
keeps the order given. Over R = n repeats (n policies) each policy runs once in each position; for
an even n each policy also follows each other policy exactly once, for an odd n that takes 2n
repeats (the mirrored rows follow). R not a multiple of that period: the rows are taken in turn,
so the first R mod period rows come once more than the rest and positions are not balanced;
`order_balance` in the result says so and counts each policy's positions.

Comparison. Two policies are compared repeat by repeat, each repeat giving the ratio of their
figures measured minutes apart on the same machine, so the host's drift between repeats cancels.
The 95% interval of the ratio is a t-interval on the log ratios (scipy.stats.ttest_1samp),
exponentiated. Chosen over a bootstrap because R is small (3 to 10 repeats): a percentile bootstrap
of 3 values spans about their range and would call 3 ratios below 1 a win, which happens one time in
four when the policies are equal; the t-interval widens with few repeats as it should. Logs because
ratios are multiplicative: a/b and b/a get mirrored intervals. It assumes log ratios roughly normal
across repeats. A policy beats another only when the whole interval is below 1 (lower TTFT), loses
when it is above 1, and ties otherwise, including with fewer than 2 repeats (no interval).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from scipy import stats as scipy_stats

CONFIDENCE = 0.95
COMPARED = ("ttft_ms_p50", "ttft_ms_p95")  # the figures with intervals and verdicts
# Over repeats these are summed (counts of a run, or maps of counts); every other number is the
# median of the runs' values.
SUMMED = frozenset(
    {
        "completed",
        "errors",
        "prefill_tokens_computed",
        "prefill_tokens_total",
        "prefill_tokens_new",
        "prefix_tokens_existed",
        "prefix_tokens_cached",
        "prefix_cached_beyond_existed_tokens",
        "resumed_turns",
        "cold_requests",
        "advisory_leads",
        "busy_s_by_node",
        "requests_by_node",
        "routes",
        "advised_requests_kv_ready",
        "prefetches_by_outcome",
        "route_pulls_by_outcome",
        "prefix_pulls_by_outcome",
        "cpu_s_by_role",
        # bench regions
        "requests_by_region",
        "residency_violations",
        "residency_violation_bytes",
        "residency_unplaced_bytes",
        "link_sniff_errors",
        "cross_region_kv_bytes",
        "kv_moves_across_regions",
    }
)


def _williams_first_row(n: int) -> list[int]:
    """0, 1, n-1, 2, n-2, ...: the first row of a Williams design."""
    row, low, high = [0], 1, n - 1
    for j in range(1, n):
        if j % 2:
            row.append(low)
            low += 1
        else:
            row.append(high)
            high -= 1
    return row


def rotation(policies: Sequence[str], repeats: int) -> list[list[str]]:
    """The order of `policies` in each of `repeats` repeats (the first is the order given)."""
    n = len(policies)
    if n == 0 or repeats < 1:
        raise ValueError("need a policy and a repeat")
    base = _williams_first_row(n)
    label = {symbol: j for j, symbol in enumerate(base)}  # relabelled: row 0 is 0, 1, ..., n-1
    period = n if n % 2 == 0 else 2 * n
    orders = []
    for k in range(repeats):
        r = k % period
        row = [label[(symbol + r) % n] for symbol in base]
        if r >= n:  # the mirrored half of an odd design
            row = [label[(symbol + r - n) % n] for symbol in base][::-1]
        orders.append([policies[i] for i in row])
    return orders


def order_balance(orders: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Each policy's count per position, and whether every policy held every position equally."""
    positions = {p: [0] * len(orders[0]) for p in orders[0]}
    for order in orders:
        for j, policy in enumerate(order):
            positions[policy][j] += 1
    counts = {c for row in positions.values() for c in row}
    return {"positions": positions, "balanced": len(counts) == 1}


def log_interval(values: Sequence[float]) -> tuple[float, float] | None:
    """95% t-interval of the geometric mean of positive `values` (the non-finite ones left out);
    None with fewer than 2."""
    logs = [math.log(v) for v in values if math.isfinite(v) and v > 0]
    if len(logs) < 2:
        return None
    if statistics.pstdev(logs) == 0:  # scipy's t statistic is undefined without spread
        return math.exp(logs[0]), math.exp(logs[0])
    low, high = scipy_stats.ttest_1samp(logs, 0.0).confidence_interval(CONFIDENCE)
    return math.exp(low), math.exp(high)


def verdict(interval: tuple[float, float] | None) -> str:
    """For a ratio a/b of figures where lower is better: a `beats` b, `loses`, or they `tie`."""
    if interval is None:
        return "tie"
    low, high = interval
    if high < 1:
        return "beats"
    if low > 1:
        return "loses"
    return "tie"


def compare(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """a over b, repeat by repeat (same index, same repeat): the ratios, their geometric mean, its
    interval and the verdict."""
    ratios = [x / y if y > 0 else math.nan for x, y in zip(a, b, strict=True)]
    finite = [r for r in ratios if math.isfinite(r) and r > 0]
    interval = log_interval(finite)
    return {
        "ratios": ratios,
        "ratio_geomean": math.exp(statistics.fmean(math.log(r) for r in finite)) if finite else math.nan,
        "ci95": list(interval) if interval else None,
        "repeats_used": len(finite),
        "verdict": verdict(interval),
    }


def _merge(values: list[Any]) -> Any:
    if all(isinstance(v, dict) for v in values):
        keys = sorted({k for v in values for k in v})
        return {k: sum(v.get(k, 0) for v in values) for k in keys}
    return sum(values)


def _median(values: list[Any]) -> Any:
    numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if len(numbers) != len(values):
        return values[0] if len(set(map(repr, values))) == 1 else None
    finite = [v for v in numbers if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def aggregate(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One policy's summaries over repeats (`runs`, in repeat order) as one: counts summed, other
    figures the median of the runs' (non-finite values left out), and for each compared figure
    its values per repeat (`<key>_runs`) and the 95% interval of their geometric mean (`<key>_ci95`)."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [run.get(key) for run in runs]
        out[key] = _merge(values) if key in SUMMED else _median(values)
    for key in COMPARED:
        figures: list[float] = [run[key] for run in runs]
        interval = log_interval(figures)
        out[f"{key}_runs"] = figures
        out[f"{key}_ci95"] = list(interval) if interval else None
    out["repeats"] = len(runs)
    return out


def pairs(policies: Sequence[str], first: str = "symphony") -> list[tuple[str, str]]:
    """Every pair once, `first` as the numerator wherever it is in the run, then the given order."""
    ordered = sorted(policies, key=lambda p: p != first)
    return [(a, b) for i, a in enumerate(ordered) for b in ordered[i + 1 :]]


def comparisons(by_policy_runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """`a/b` -> {figure: compare(a's runs, b's runs)} for every pair; verdicts are a's."""
    out: dict[str, Any] = {}
    for a, b in pairs(list(by_policy_runs)):
        out[f"{a}/{b}"] = {
            key: compare([run[key] for run in by_policy_runs[a]], [run[key] for run in by_policy_runs[b]])
            for key in COMPARED
        }
    return out

"""`symphony bench sim --scenario regions`: the global layer's policies at paper scale on the
simulator (`eval.sim.regions`): three regions with the WAN matrix of `[regions]`'s defaults, a
diurnal load, and per policy the fewest replicas per region that keep p95 TTFT under the SLO.

The load (`diurnal_users`): users arrive in each region at a rate that follows the region's day, a
sine of amplitude `amplitude` around the mean, the three regions a third of a day apart (us-east
peaks mid-run); each user holds one ShareGPT conversation (human reading and typing, a typing
advisory before each message) and leaves. A share of eu-west's users belong to an EU-only tenant.
With the peaks apart, the sum of the three regions' loads varies far less than any one region's:
a layer that sends a hot region's overflow to a cold one needs capacity for the mean, one that
keeps every client home needs it for each region's peak (SkyWalker's 9 replicas against 12).

`replicas_for_slo`: the fewest replicas per region (the same in every region) at which the
policy's p95 TTFT, as the client sees it (round trip included), is within `slo_ms` in every window of
the day (`window_ms`) for the clients of every region, and no request failed; found by bisection,
taking p95 to fall as replicas are added. `replicas_for_slo_whole_day` reads the SLO as one p95 over
the whole day instead, which a policy can meet while one region's peak hour misses it.

`pooled_bound`: the same users served by one pool of 3 x n replicas, every client 1 ms from it and
nothing recomputed for being sent away: what pooling without the WAN's costs needs (a reference for
the global policies, which pay round trips and recomputes to pool).
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from eval.sim.presets import Preset
from eval.sim.regions import RegionsSim, RegionUser, summarize_regions
from eval.sim.regions_defaults import (  # noqa: F401 (the scenario's settings, re-exported)
    AMPLITUDE,
    ARRIVALS_PER_MIN,
    DAY_S,
    EU_TENANT,
    HACKING_FACTOR,
    MAX_REPLICAS,
    POLICIES,
    REFERENCE_REPLICAS,
    REGIONS,
    REPLICAS_TARGET,
    SLO_MS,
    TIME_SCALE,
    WINDOW_S,
)
from eval.sim.workload import conversation_script
from eval.workloads import Conversation, HumanTiming
from global_layer.policies import make_region_policy
from symphony.priority import Priority
from symphony.regions import DEFAULT_WAN_LINKS, RegionTopology, build_topology


def regions_topology(eu_tenant: str = EU_TENANT) -> RegionTopology:
    return build_topology(
        [f"{name}:1" for name in REGIONS],
        list(DEFAULT_WAN_LINKS),
        1.0,
        [f"{eu_tenant}=eu-west"],
        links_are_default=True,
    )


def diurnal_users(
    conversations: Sequence[Conversation],
    timing: HumanTiming,
    *,
    arrivals_per_min: float,
    day_ms: float,
    amplitude: float = AMPLITUDE,
    eu_only_share: float = 0.25,
    max_answer_tokens: int = 512,
    seed: int = 0,
) -> list[RegionUser]:
    """Users arriving over one simulated day: in region k at `arrivals_per_min` on average, times
    1 + `amplitude` * sin(2 pi t / day - pi / 2 + 2 pi k / 3) (drawn by thinning a Poisson process)."""
    if not conversations:
        raise ValueError("no conversations to replay")
    if not 0 <= amplitude <= 1:
        raise ValueError(f"amplitude {amplitude} is not within [0, 1]")
    rng = random.Random(seed)
    peak_per_ms = arrivals_per_min * (1 + amplitude) / 60_000
    users: list[RegionUser] = []
    for k, region in enumerate(REGIONS):
        t = 0.0
        while True:
            t += rng.expovariate(peak_per_ms)
            if t >= day_ms:
                break
            rate = 1 + amplitude * math.sin(2 * math.pi * t / day_ms - math.pi / 2 + 2 * math.pi * k / 3)
            if rng.random() * (1 + amplitude) > rate:
                continue
            index = len(users)
            tenant = EU_TENANT if region == "eu-west" and rng.random() < eu_only_share else "default"
            script = conversation_script(
                conversations[index % len(conversations)],
                f"{region}-u{index}",
                timing.user(seed * 1_000_003 + index),
                t,
                max_answer_tokens,
                None,
                Priority.NORMAL,
            )
            users.append(RegionUser(region, script, tenant))
    return users


POOLED = "pooled_bound"


def run_regions_point(
    preset: Preset,
    policy: str,
    replicas: int,
    users: Sequence[RegionUser],
    duration_ms: float,
    slo_ms: float | None = None,
    window_ms: float = WINDOW_S * 1000,
) -> dict[str, Any]:
    """One policy at one replica count (with `slo_ms`: stopped once its p95 must miss it, over the
    day and in some window, `RegionsSim.run`). `POOLED`: every region's users on one pool of
    `replicas` x the regions, with the pool's 1 ms round trip for every client."""
    if policy == POOLED:
        pool = build_topology(["pool:1"], [], 1.0, [], links_are_default=True)
        users = [RegionUser("pool", u.script, u.tenant, u.region) for u in users]
        sim = RegionsSim(pool, make_region_policy("nearest"), preset, replicas * len(REGIONS))
    else:
        sim = RegionsSim(regions_topology(), make_region_policy(policy), preset, replicas)
    return summarize_regions(sim.run(users, duration_ms, slo_ms, window_ms), duration_ms, window_ms)


def fewest_replicas(meets: Callable[[int], bool], most: int) -> int | None:
    """The least n in [1, most] with `meets(n)`, taking `meets` to stay true once it is (None: not
    even at `most`)."""
    if not meets(most):
        return None
    low, high = 0, most  # meets(high); not meets(low), or low is 0
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return high


def regions_scenario(
    preset: Preset,
    conversations: Sequence[Conversation],
    *,
    arrivals_per_min: float,
    duration_ms: float,
    timing: HumanTiming,
    policies: Sequence[str] = POLICIES,
    slo_ms: float = SLO_MS,
    reference_replicas: int = REFERENCE_REPLICAS,
    max_replicas: int = MAX_REPLICAS,
    amplitude: float = AMPLITUDE,
    window_ms: float = WINDOW_S * 1000,
    pooled_bound: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Every policy's `replicas_for_slo` (and the pooled bound's, with `pooled_bound`)."""
    users = diurnal_users(
        conversations, timing, arrivals_per_min=arrivals_per_min, day_ms=duration_ms, amplitude=amplitude, seed=seed
    )
    searched = [*policies, POOLED] if pooled_bound else list(policies)
    points: dict[str, dict[int, dict[str, Any]]] = {p: {} for p in searched}
    with tqdm(desc="bench sim regions", unit="run", file=sys.stderr) as bar:

        def point(policy: str, replicas: int, stop_past_slo: bool = True) -> dict[str, Any]:
            row = points[policy].get(replicas)
            if row is None or (row["stopped_past_slo"] and not stop_past_slo):
                row = run_regions_point(
                    preset, policy, replicas, users, duration_ms, slo_ms if stop_past_slo else None, window_ms
                )
                points[policy][replicas] = row
                bar.set_postfix_str(f"{policy} x {replicas}: p95 {row['ttft_ms_p95'] or 0:.0f} ms")
                bar.update(1)
            return points[policy][replicas]

        def meets(policy: str, replicas: int, whole_day: bool = False) -> bool:
            row = point(policy, replicas)
            if row["stopped_past_slo"] or row["errors"]:
                return False
            p95 = row["ttft_ms_p95"] if whole_day else (row["worst_window"] or {}).get("ttft_ms_p95")
            return p95 is not None and p95 <= slo_ms

        replicas_for_slo = {p: fewest_replicas(lambda n, p=p: meets(p, n), max_replicas) for p in searched}  # type: ignore[misc]
        whole_day = {p: fewest_replicas(lambda n, p=p: meets(p, n, True), max_replicas) for p in searched}  # type: ignore[misc]
        at_reference = {p: point(p, reference_replicas, stop_past_slo=False) for p in policies}
        # GORGO's reward hacking, where gorgo meets the SLO: its p95 without the queue term there
        hacking_at = replicas_for_slo.get("gorgo") if "gorgo_no_queue" in policies else None
        if hacking_at is not None:
            point("gorgo_no_queue", hacking_at, stop_past_slo=False)
            point("gorgo", hacking_at, stop_past_slo=False)
    result: dict[str, Any] = {
        "regions": list(REGIONS),
        "wan_links": list(DEFAULT_WAN_LINKS),
        "users": len(users),
        "eu_only_users": sum(1 for u in users if u.tenant == EU_TENANT),
        "arrivals_per_min_per_region": arrivals_per_min,
        "amplitude": amplitude,
        "slo_ms": slo_ms,
        "slo_window_s": window_ms / 1000,
        "max_replicas": max_replicas,
        "reference_replicas": reference_replicas,
        "replicas_for_slo": {p: replicas_for_slo[p] for p in policies},
        "replicas_for_slo_whole_day": {p: whole_day[p] for p in policies},
        "pooled_bound": {"replicas_for_slo": replicas_for_slo[POOLED], "replicas_for_slo_whole_day": whole_day[POOLED]}
        if pooled_bound
        else None,
        "at_reference": at_reference,
        "hacking_at_replicas": hacking_at,
        "points": {p: {str(n): row for n, row in sorted(rows.items())} for p, rows in points.items()},
    }
    result.update(_ratios_and_targets(result, policies))
    return result


def _ratios_and_targets(result: dict[str, Any], policies: Sequence[str]) -> dict[str, Any]:
    replicas = result["replicas_for_slo"]
    out: dict[str, Any] = {}
    targets: dict[str, bool] = {}
    if "symphony" in policies and "nearest" in policies:
        ratio = _replicas_ratio(replicas["symphony"], replicas["nearest"], result["max_replicas"])
        out["symphony_replicas_over_nearest"] = ratio
        out["nearest_met_slo"] = replicas["nearest"] is not None
        targets[f"symphony_replicas_le_{REPLICAS_TARGET:g}x_nearest"] = ratio is not None and ratio <= REPLICAS_TARGET
        day = result["replicas_for_slo_whole_day"]
        out["symphony_replicas_over_nearest_whole_day"] = _replicas_ratio(
            day["symphony"], day["nearest"], result["max_replicas"]
        )
        bound = result["pooled_bound"]
        if bound is not None:
            out["pooled_bound_over_nearest"] = _replicas_ratio(
                bound["replicas_for_slo"], replicas["nearest"], result["max_replicas"]
            )
    if "gorgo" in policies and "gorgo_no_queue" in policies:
        # GORGO's reward hacking: without the queue term, requests stay where the round trip and
        # the prefix reward them however long the queue there grows. Judged where gorgo meets the
        # SLO (past saturation every policy's p95 is seconds, and the ratio says nothing).
        at = result["hacking_at_replicas"]
        rows = result["points"]
        ratio = None
        if at is not None:
            with_queue = rows["gorgo"][str(at)]["worst_window"]["ttft_ms_p95"]
            without = rows["gorgo_no_queue"][str(at)]["worst_window"]["ttft_ms_p95"]
            ratio = without / with_queue
        out["gorgo_no_queue_p95_over_gorgo"] = ratio
        out["gorgo_no_queue_replicas_over_gorgo"] = _replicas_ratio(
            replicas["gorgo_no_queue"], replicas["gorgo"], result["max_replicas"]
        )
        targets[f"gorgo_no_queue_p95_ge_{HACKING_FACTOR:g}x_gorgo"] = ratio is not None and ratio >= HACKING_FACTOR
    violations = sum(row["residency_violations"] for rows in result["points"].values() for row in rows.values())
    out["residency_violations"] = violations
    targets["residency_violations_eq_0"] = violations == 0
    out["targets"] = targets
    return out


def _replicas_ratio(mine: int | None, theirs: int | None, most: int) -> float | None:
    """`mine` over `theirs`; `theirs` never meeting the SLO counts as `most` (the ratio is then an
    upper bound); None when `mine` never met it."""
    if mine is None:
        return None
    return mine / (theirs if theirs is not None else most)

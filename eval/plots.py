"""PNG plots for benchmark results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "plotting needs matplotlib: pip install 'symphony-kv[bench]' (`make install` does this)"
        ) from None
    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    return plt


def _paired_bars(
    ax: Any, names: list[str], left: list[float], right: list[float], labels: tuple[str, str], rotation: int = 20
) -> None:
    """Two bars per name, side by side (a bound and its measurement, p50 and p99, ...)."""
    positions = range(len(names))
    ax.bar([p - 0.2 for p in positions], left, width=0.4, label=labels[0])
    ax.bar([p + 0.2 for p in positions], right, width=0.4, label=labels[1])
    ax.set_xticks(list(positions), names, rotation=rotation)
    ax.legend()


def _save(plt: Any, fig: Any, path: Path, dpi: int = 120) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot_proxy(result: dict[str, Any], path: Path) -> None:
    """Left: TTFT distribution per path. Right: per-round-pair overhead, with its median."""
    plt = _pyplot()
    raw = result["raw_ms"]
    fig, (cdf, pairs) = plt.subplots(1, 2, figsize=(11, 4))
    for name, label in (("direct", "direct to engine"), ("via_scheduler", "through the scheduler")):
        values = sorted(x for rnd in raw[name] for x in rnd)
        cdf.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    cdf.set_xlabel("TTFT (ms)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title(f"TTFT, {result['concurrency']} concurrent streams")
    cdf.legend()
    pairs.hist(result["per_pair_overhead_ms"], bins=40)
    pairs.axvline(
        result["overhead_ms_p50"], color="black", linestyle="--", label=f"median {result['overhead_ms_p50']:.1f} ms"
    )
    pairs.set_xlabel("via - direct, round medians (ms)")
    pairs.set_ylabel("round pairs")
    pairs.set_title("scheduler overhead per round pair")
    pairs.legend()
    _save(plt, fig, path, dpi=110)


def plot_tiers(result: dict[str, Any], path: Path) -> None:
    """Each Symphony path next to the hardware bound it is measured against."""
    plt = _pyplot()
    pairs = [
        ("DRAM load", "dram_load_gbps", "memcpy_gbps"),
        ("SSD write", "ssd_write_gbps", "disk_write_bound_gbps"),
        ("SSD read", "ssd_read_gbps", "disk_read_bound_gbps"),
        ("peer fetch", "peer_fetch_gbps", "loopback_bound_gbps"),
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(pairs))
    ax.bar([x - 0.2 for x in xs], [result[bound] for _, _, bound in pairs], width=0.4, label="bound (plain)")
    ax.bar([x + 0.2 for x in xs], [result[path_] for _, path_, _ in pairs], width=0.4, label="Symphony")
    ax.set_xticks(list(xs), [label for label, _, _ in pairs])
    ax.set_ylabel("GB/s")
    ax.set_title(f"KV tiers, {result['session_tokens']}-token session ({result['session_bytes'] / 1e6:.0f} MB)")
    ax.legend()
    _save(plt, fig, path)


def plot_resume(result: dict[str, Any], path: Path) -> None:
    """Median TTFT of the resumed turn per path, against vLLM's own prefix-cache hit."""
    plt = _pyplot()
    paths = list(result["ttft_ms"])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(paths)), [result["ttft_ms"][p] for p in paths])
    ax.axhline(result["ttft_ms"]["engine_cache"], color="grey", linestyle="--", label="engine_cache")
    ax.set_xticks(range(len(paths)), paths, rotation=20)
    ax.set_ylabel("TTFT, median (ms)")
    ax.set_title(f"Resumed turn after {result['context_tokens']} tokens of history")
    ax.legend()
    _save(plt, fig, path, dpi=110)


def plot_cluster(result: dict[str, Any], path: Path) -> None:
    """Per policy: every repeat's TTFT p50 and p95 (dots), their median (bar) and 95% interval (left);
    each pair's per-repeat p50 and p95 ratios with their interval, log scale (middle); the computed
    share of prompt tokens and the node imbalance, medians over repeats (right). A result without
    repeats (written before them) draws as one repeat."""
    plt = _pyplot()
    policies = list(result["policies"])
    stats = result["policies"]
    fig, (ttft, ratios, other) = plt.subplots(1, 3, figsize=(16, 4.5))
    for offset, key, colour in ((-0.18, "ttft_ms_p50", "tab:blue"), (0.18, "ttft_ms_p95", "tab:orange")):
        for i, policy in enumerate(policies):
            runs = stats[policy].get(f"{key}_runs", [stats[policy][key]])
            ttft.bar(
                i + offset, stats[policy][key], width=0.34, color=colour, alpha=0.35, label=key[8:] if i == 0 else None
            )
            ttft.scatter([i + offset] * len(runs), runs, color=colour, s=14, zorder=3)
            interval = stats[policy].get(f"{key}_ci95")
            if interval:
                ttft.plot([i + offset] * 2, interval, color="black", linewidth=1)
    ttft.set_xticks(range(len(policies)), policies, rotation=20)
    ttft.set_ylabel("TTFT (ms)")
    ttft.set_title("TTFT per repeat (dots), median (bar), 95% interval")
    ttft.legend()
    pairs = list(result.get("comparisons", {}))
    for offset, key, colour in ((-0.15, "ttft_ms_p50", "tab:blue"), (0.15, "ttft_ms_p95", "tab:orange")):
        for i, pair in enumerate(pairs):
            c = result["comparisons"][pair][key]
            ratios.scatter(
                [i + offset] * len(c["ratios"]), c["ratios"], color=colour, s=14, label=key[8:] if i == 0 else None
            )
            if c["ci95"]:
                ratios.plot([i + offset] * 2, c["ci95"], color="black", linewidth=1)
    ratios.axhline(1.0, color="grey", linestyle="--")
    ratios.set_yscale("log")
    plain = plt.FuncFormatter(lambda value, _: f"{value:g}")
    ratios.yaxis.set_major_formatter(plain)
    ratios.yaxis.set_minor_formatter(plain)
    ratios.set_xticks(range(len(pairs)), pairs, rotation=30, ha="right")
    ratios.set_ylabel("TTFT ratio, same repeat")
    ratios.set_title("pairs: below 1 the first is faster; verdict needs the interval off 1")
    if pairs:
        ratios.legend()
    x = range(len(policies))
    share = [stats[p]["prefill_tokens_computed"] / max(1, stats[p]["prefill_tokens_total"]) for p in policies]
    other.bar([i - 0.2 for i in x], share, width=0.4, label="prompt tokens computed / total")
    other.bar(
        [i + 0.2 for i in x],
        [stats[p]["max_over_mean_load"] - 1 for p in policies],
        width=0.4,
        label="busiest node over mean - 1 (median)",
    )
    other.set_xticks(list(x), policies, rotation=20)
    other.legend()
    repeats = result.get("repeats", 1)
    kind = result.get("workload_kind", "sharegpt")
    fig.suptitle(f"{kind}, {result['duration_s']:.0f} s per policy run, {repeats} repeat(s)")
    _save(plt, fig, path, dpi=110)


def plot_sim_users(result: dict[str, Any], path: Path) -> None:
    """Symphony's figure 12: mean TPOT and TTFT p95 per policy as the users grow."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for policy, rows in result["points"].items():
        users = [int(u) for u in rows]
        axes[0].plot(users, [rows[str(u)]["tpot_ms_mean"] or 0 for u in users], marker="o", label=policy)
        axes[1].plot(users, [rows[str(u)]["ttft_ms_p95"] or 0 for u in users], marker="o", label=policy)
    if result.get("tpot_bound_ms") is not None:
        # users_ratio_at_equal_tpot's bound: where each policy's curve crosses it is its limit.
        axes[0].axhline(
            result["tpot_bound_ms"],
            color="gray",
            linestyle="--",
            label=f"{result['tpot_bound']:g} x recompute at {min(result.get('start_users', result['users']))} users",
        )
    for ax, label in zip(axes, ("mean TPOT (ms)", "TTFT p95 (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("users")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"{result.get('users_workload', 'sharegpt')} users on {result['nodes']} x {result['preset']}")
    _save(plt, fig, path)


def plot_sim_missed(result: dict[str, Any], path: Path) -> None:
    """Symphony's figure 17: normalized latency as more typing advisories are missed."""
    plt = _pyplot()
    rates = list(result["points"])
    latency = [result["points"][r]["norm_latency_ms_per_token_mean"] or 0 for r in rates]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([float(r) * 100 for r in rates], latency, marker="o")
    ax.set_xlabel("advisories missed (%)")
    ax.set_ylabel("mean normalized latency (ms/token)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Symphony, {result['users']} users on {result['nodes']} x {result['preset']}")
    _save(plt, fig, path)


def plot_sim_imbalance(result: dict[str, Any], path: Path) -> None:
    """Symphony's figure 18: each node's busy time under sticky routing and under Symphony."""
    plt = _pyplot()
    policies = list(result["points"])
    fig, axes = plt.subplots(1, len(policies), figsize=(5 * len(policies), 4), sharey=True)
    for ax, policy in zip(axes if len(policies) > 1 else [axes], policies, strict=True):
        busy = result["points"][policy].get("busy_ms_by_node", {})
        ax.bar(range(len(busy)), [ms / 1000 for ms in busy.values()])
        ax.set_xticks(range(len(busy)), list(busy), rotation=45)
        ax.set_ylabel("busy time (s)")
        ax.set_title(f"{policy}: max/median {result['points'][policy]['max_over_median_load'] or 0:.2f}")
    _save(plt, fig, path)


def plot_route(result: dict[str, Any], path: Path) -> None:
    """Cost of one routing decision per policy, p50 and p99."""
    plt = _pyplot()
    names = list(result["policies"])
    fig, ax = plt.subplots(figsize=(8, 4))
    _paired_bars(
        ax,
        names,
        [result["policies"][n]["decision_us_p50"] for n in names],
        [result["policies"][n]["decision_us_p99"] for n in names],
        ("p50", "p99"),
    )
    ax.set_ylabel("µs per routing decision")
    ax.set_title(f"{result['nodes']} nodes, {result['sessions']:,} sessions")
    _save(plt, fig, path)


def plot_sim_priority(result: dict[str, Any], path: Path) -> None:
    """High-priority users' mean TPOT and output throughput per share of them, Symphony against recompute."""
    plt = _pyplot()
    shares = list(result["high_tpot_ratio_vs_recompute"])
    fig, (tpot, rate) = plt.subplots(1, 2, figsize=(10, 4))
    for offset, policy in ((-0.2, "symphony"), (0.2, "recompute")):
        rows = [result["points"][f"{policy}@{share}"] for share in shares]
        positions = [i + offset for i in range(len(shares))]
        tpot.bar(positions, [row["high_tpot_ms_mean"] or 0 for row in rows], width=0.4, label=policy)
        rate.bar(positions, [row["high_output_tokens_per_s"] for row in rows], width=0.4, label=policy)
    for ax, label in ((tpot, "high-priority mean TPOT (ms)"), (rate, "high-priority output tokens/s")):
        ax.set_xticks(range(len(shares)), [f"{float(s):.0%} high" for s in shares])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"{result['users']} users on {result['nodes']} x {result['preset']}, vLLM priority scheduling")
    _save(plt, fig, path)


def plot_sim_agents(result: dict[str, Any], path: Path) -> None:
    """Agent projects' makespan (mean and p95) per run."""
    plt = _pyplot()
    names = list(result["points"])
    fig, ax = plt.subplots(figsize=(7, 4))
    _paired_bars(
        ax,
        names,
        [(result["points"][n]["makespan_ms_mean"] or 0) / 1000 for n in names],
        [(result["points"][n]["makespan_ms_p95"] or 0) / 1000 for n in names],
        ("mean", "p95"),
        rotation=0,
    )
    ax.set_ylabel("project makespan (s)")
    ax.set_title(f"{result['users']} agent projects on {result['nodes']} x {result['preset']}")
    _save(plt, fig, path)


def plot_sim_regions(result: dict[str, Any], path: Path) -> None:
    """The worst window's p95 TTFT (client side) against replicas per region, one line per global
    policy (and the pooled bound), and the SLO."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for policy, rows in result["points"].items():
        # a run stopped once its p95 had to miss the SLO has no p95 to draw: shown at the top
        counts = sorted(int(n) for n in rows)
        top = 10 * result["slo_ms"]
        values = [
            top if rows[str(n)]["stopped_past_slo"] else rows[str(n)]["worst_window"]["ttft_ms_p95"] for n in counts
        ]
        ax.plot(counts, values, marker="o", label=policy, linestyle=":" if policy == "pooled_bound" else "-")
    ax.axhline(result["slo_ms"], color="grey", linestyle="--", label=f"SLO {result['slo_ms']:g} ms")
    ax.set_xlabel("replicas per region")
    ax.set_ylabel(f"worst {result['slo_window_s']:g} s window's p95 TTFT (ms, client side)")
    ax.set_yscale("log")
    ax.set_title(
        f"{len(result['regions'])} regions, {result['users']:,} users over a simulated day\n"
        f"(a run stopped once its p95 had to miss the SLO is drawn at {10 * result['slo_ms']:g} ms)"
    )
    ax.legend()
    _save(plt, fig, path)

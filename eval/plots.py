"""PNG plots for benchmark results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install 'symphony-kv[bench]' (`make install` does this)") \
            from None
    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    return plt


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
    pairs.axvline(result["overhead_ms_p50"], color="black", linestyle="--",
                  label=f"median {result['overhead_ms_p50']:.1f} ms")
    pairs.set_xlabel("via - direct, round medians (ms)")
    pairs.set_ylabel("round pairs")
    pairs.set_title("scheduler overhead per round pair")
    pairs.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""What pulls between nodes take, as the scheduler sees them: the link costs the `symphony` policy
prices a KV move with, corrected by the pulls it has followed.

The cost profile's links come from `symphony bench calibrate` / `bench tiers`: one pull at a time on
a quiet host. Under serving load a pull competes with the engines for the host's cores and with
other pulls for the link, and takes longer: on the development host's long-conversation bench a
rerouted request waited a median 0.074 ms a token for its history, where the profile priced
0.014 (docs/benchmarks.md). A move the policy thinks cheap then costs the request more than the
queue it left. `ObservedLinks` keeps, per (source, target) node pair, a moving average of the
observed time per token of finished pulls and gives the profile with those links in place of the
calibrated ones.

Pure: no I/O, no clocks; the dispatcher passes each pull's duration.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

from scheduler.cost_profile import CostProfile, NodeLink

# Pulls of fewer tokens say more of the round trips than of the link's rate.
MIN_PULL_TOKENS = 256
# Observed pulls of a pair before its observed rate replaces the calibrated one.
MIN_SAMPLES = 3
# The moving average's weight on the newest pull: the last ~4 pulls count most, so the rate follows
# the host's load within a few pulls.
NEWEST_WEIGHT = 0.25
# The slowest rate believed (ms a token, 100 KB/s for SmolLM2's 23 KB tokens): a pull that took
# longer measured a stall, not the link, and must not stop every move for good.
MAX_MS_PER_TOKEN = 0.25


@dataclass(frozen=True, slots=True)
class ObservedLink:
    """One node pair's pulls as observed, next to the calibrated rate they replace: ms per token
    beyond the round trip and the tier reads at both ends."""

    source: str
    target: str
    ms_per_token: float
    calibrated_ms_per_token: float
    pulls: int
    priced: bool  # the policy prices moves over this pair by the observed rate


class ObservedLinks:
    """Per node pair, the observed link rate of its pulls (ms per token, beyond the round trip and
    the tier reads and writes at both ends that the policy prices apart). Bounded: `max_pairs`
    pairs, the least recently observed dropped first."""

    def __init__(self, base: CostProfile, max_pairs: int = 4096) -> None:
        self.base = base
        self.max_pairs = max_pairs
        self._rates: OrderedDict[tuple[str, str], tuple[float, int]] = OrderedDict()  # -> (ms/token, samples)

    def observe(self, source: str, target: str, tokens: int, ms: float) -> CostProfile | None:
        """`target` pulled `tokens` of KV from `source` in `ms`, from the scheduler's request to the
        node's final answer: what a request waiting for such a pull waits, the node's queue of moves
        and the reads at both ends under the host's load included. Returns the profile with the
        observed links, when this pull changed one the policy prices by; else None."""
        if tokens < MIN_PULL_TOKENS or source == target or not ms >= 0:
            return None
        base = self.base
        ends = 2 * base.tier_load_ms_per_token.dram  # read at the source, landed at the target
        rate = min(max(0.0, (ms - base.link(source, target).rtt_ms) / tokens - ends), MAX_MS_PER_TOKEN)
        key = (source, target)
        old, samples = self._rates.pop(key, (rate, 0))
        self._rates[key] = (old + NEWEST_WEIGHT * (rate - old) if samples else rate, samples + 1)
        while len(self._rates) > self.max_pairs:
            self._rates.popitem(last=False)
        return self.profile() if samples + 1 >= MIN_SAMPLES else None

    def observed(self, source: str, target: str) -> tuple[float, int]:
        """The pair's observed rate (ms per token) and how many pulls it is from; (0, 0): none."""
        return self._rates.get((source, target), (0.0, 0))

    def describe(self) -> list[ObservedLink]:
        """Every observed node pair, in order (for /readyz, `symphony status` and the metrics)."""
        base = self.base
        return [
            ObservedLink(
                source,
                target,
                rate,
                base.kv_bytes_per_token / (base.link(source, target).bandwidth_gbps * 1e6),
                samples,
                samples >= MIN_SAMPLES,
            )
            for (source, target), (rate, samples) in sorted(self._rates.items())
        ]

    def profile(self) -> CostProfile:
        """The base profile, each pair observed `MIN_SAMPLES` times priced at its observed rate."""
        base = self.base
        observed = {key: rate for key, (rate, samples) in self._rates.items() if samples >= MIN_SAMPLES}
        if not observed:
            return base
        links = [link for link in base.links if (link.source, link.target) not in observed]
        floor = base.kv_bytes_per_token / 1e6 / 1e3  # no faster than 1 TB/s: a rate of 0 would divide by 0
        for (source, target), rate in observed.items():
            gbps = base.kv_bytes_per_token / max(rate, floor) / 1e6
            links.append(NodeLink(source, target, base.link(source, target).rtt_ms, gbps))
        return replace(base, links=tuple(links))

"""The fault suite's checker: pure judgements over what a scenario recorded.

What it holds a scenario to:
- every request ended within `bound_s`, with a 2xx or a well-formed OpenAI-style error body
  (`malformed` counts the others; a call whose connection broke mid-flight, to a process killed
  under it, is counted by kind, since no process was left to answer it);
- every greedy answer equals the recompute reference of its own prompt (`wrong_outputs`). A
  divergence at a position where the reference's best two tokens are within `tie_nats` of each
  other is numerics (a prefill over cached KV runs other kernels than a full one) and is counted
  apart (`near_tie_divergences`); any other divergence means wrong KV was served;
- sessions whose KV a node had on SSD before it was killed are still there after it restarted
  (`lost_sessions`);
- the cluster's counters come back to zero and its resources stay bounded (`leaks`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TIE_NATS = 0.05  # a reference whose top two tokens are closer than this is a near tie
LISTED_FAILURES = 100


@dataclass(frozen=True)
class Answer:
    """A greedy answer's tokens, with the margin (nats) between the best and the second-best
    token at each position, as the engine's top-2 logprobs gave it (inf with one candidate)."""

    tokens: tuple[str, ...]
    margins: tuple[float, ...] = ()


@dataclass
class RequestOutcome:
    """One request of a scenario, as its client saw it."""

    scenario: str
    tenant: str
    session: str
    started_s: float  # monotonic
    elapsed_s: float
    status: int  # HTTP status; 0 when no answer came (connection refused or broken, timeout)
    kind: str  # "ok", the error body's type/code, or "connect", "broken", "timeout", "malformed"
    messages: list[dict[str, str]] = field(default_factory=list)  # what was sent (for its reference)
    answer: Answer | None = None  # 2xx only
    node: str = ""  # x-symphony-node, when answered
    detail: str = ""  # what the error said (its first 200 characters)
    max_tokens: int = 0  # the answer's length asked for (its reference asks the same)


def well_formed_error(status: int, body: object) -> bool:
    """An OpenAI-style error: a 4xx/5xx whose JSON body is {"error": {"message": str, "type": str, ...}}."""
    if not 400 <= status < 600 or not isinstance(body, Mapping):
        return False
    error = body.get("error")
    return isinstance(error, Mapping) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


def divergence(served: Sequence[str], reference: Sequence[str]) -> int | None:
    """The first position where two token sequences differ (a length difference counts at the
    shorter one's end); None when they are equal."""
    for i, (a, b) in enumerate(zip(served, reference, strict=False)):
        if a != b:
            return i
    return None if len(served) == len(reference) else min(len(served), len(reference))


def judge_answer(served: Answer, reference: Answer, tie_nats: float = TIE_NATS) -> str:
    """ "same", "near_tie" (they part where the reference's top two were within `tie_nats`) or
    "wrong"."""
    at = divergence(served.tokens, reference.tokens)
    if at is None:
        return "same"
    margin = reference.margins[at] if at < len(reference.margins) else math.inf
    return "near_tie" if margin < tie_nats else "wrong"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank `q`-th percentile (0 < q ≤ 100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def check_requests(
    outcomes: Sequence[RequestOutcome],
    references: Sequence[Answer | None],
    bound_s: float,
    tie_nats: float = TIE_NATS,
    origin_s: float = 0.0,
) -> dict[str, Any]:
    """The request part of a scenario's report. `references[i]` is the recompute reference of
    `outcomes[i]`'s prompt (None: not an answered request, or its reference could not be made,
    counted in `unchecked`). Failed and over-bound requests are listed (the first
    `LISTED_FAILURES`), with their start after `origin_s`."""
    if len(references) != len(outcomes):
        raise ValueError("one reference (or None) per outcome")
    kinds: Counter[str] = Counter()
    verdicts: Counter[str] = Counter()
    wrong: list[str] = []
    for outcome, reference in zip(outcomes, references, strict=True):
        if outcome.kind != "ok":
            kinds[outcome.kind] += 1
            continue
        if outcome.answer is None or reference is None:
            verdicts["unchecked"] += 1
            continue
        verdict = judge_answer(outcome.answer, reference, tie_nats)
        verdicts[verdict] += 1
        if verdict == "wrong":
            wrong.append(outcome.session)
    return {
        "requests": len(outcomes),
        "ok": sum(1 for o in outcomes if o.kind == "ok"),
        "errors_by_kind": dict(sorted(kinds.items())),
        "server_5xx": sum(1 for o in outcomes if 500 <= o.status < 600),
        "malformed": kinds["malformed"],
        "over_bound": sum(1 for o in outcomes if o.elapsed_s > bound_s),
        "bound_s": bound_s,
        "checked_outputs": verdicts["same"] + verdicts["near_tie"] + verdicts["wrong"],
        "wrong_outputs": verdicts["wrong"],
        "wrong_sessions": sorted(set(wrong)),
        "near_tie_divergences": verdicts["near_tie"],
        "unchecked_outputs": verdicts["unchecked"],
        "tie_nats": tie_nats,
        "failures": [
            {
                "session": o.session,
                "at_s": round(o.started_s - origin_s, 2),
                "elapsed_s": round(o.elapsed_s, 2),
                "kind": o.kind,
                "status": o.status,
                "node": o.node,
                "detail": o.detail,
            }
            for o in outcomes
            if o.kind != "ok" or o.elapsed_s > bound_s
        ][:LISTED_FAILURES],
    }


@dataclass(frozen=True)
class Resources:
    """What the cluster held at one moment: open fds and resident memory summed over its
    processes, its files in /dev/shm, its SSD segment files (and the most bytes one node's SSD
    directory held), and the gauges that must return to zero once no request is in flight
    (scheduler in-flight and queued requests, pending advisories)."""

    fds: int
    rss_bytes: int
    shm_files: int
    ssd_segments: int
    ssd_bytes_max: int
    busy_gauges: float
    orphans: int = 0  # processes of the cluster's engines outside its process trees (outliving a node manager)
    # Anonymous resident memory (RssAnon) summed over its processes: what a leak grows, without the
    # shared memory (a node's DRAM arena, mapped by its manager and its engine) that fills by design.
    rss_anon_bytes: int = 0
    # (name, leader pid, fds of its process tree) per supervised process: one that was not restarted
    # in between is held to its own bound, so that a leak in a small process is not lost in the sum.
    processes: tuple[tuple[str, int, int], ...] = ()


# A resource "stays bounded" when, after the faults, it is within these of its value before them
# (taken once the warm-up filled connection pools and caches). Restarted processes open their
# listeners, channels and pools again, and a replica that took over its peer's clients holds more
# connections; a leak grows with every fault, which a longer run (more rounds) shows.
FD_RATIO = 1.5
PROCESS_FD_SLACK = 16  # a small process's few more connections are no leak
RSS_RATIO = 1.5
SHM_SLACK = 0


def leaks(before: Resources, after: Resources, ssd_bytes_limit: int) -> list[str]:
    """What did not stay bounded, in words; empty when everything did."""
    return fd_leaks(before, after) + other_leaks(before, after, ssd_bytes_limit)


def fd_leaks(before: Resources, after: Resources) -> list[str]:
    """The open fds past their bounds, summed and per process not restarted in between."""
    found = []
    if after.fds > before.fds * FD_RATIO:
        found.append(f"open fds grew from {before.fds} to {after.fds}")
    earlier = {(name, pid): fds for name, pid, fds in before.processes}
    for name, pid, fds in after.processes:
        if (name, pid) in earlier and fds > earlier[(name, pid)] * FD_RATIO + PROCESS_FD_SLACK:
            found.append(f"{name} (pid {pid}) went from {earlier[(name, pid)]} to {fds} open fds")
    return found


# fds are looked at again until this many looks in a row find none past their bounds (or a time is
# up): connections pooled by a replica that took over its peer's load close once idle (its engine
# pool: 4 s), a leak does not. Nothing else is looked at twice.
CLEAN_LOOKS = 2


def fds_settled(looks: Sequence[list[str]]) -> tuple[bool, list[str]]:
    """Given what `fd_leaks` found at each look, in order: whether the last CLEAN_LOOKS found
    nothing, and what to report (nothing then, else the latest look's finding that was not empty)."""
    if len(looks) >= CLEAN_LOOKS and not any(looks[-CLEAN_LOOKS:]):
        return True, []
    return False, next((found for found in reversed(looks) if found), [])


def other_leaks(before: Resources, after: Resources, ssd_bytes_limit: int) -> list[str]:
    """Every bound but the fds': memory, /dev/shm files, SSD bytes, orphans, the busy gauges."""
    found = []
    if after.rss_bytes > before.rss_bytes * RSS_RATIO:
        found.append(f"resident memory grew from {before.rss_bytes} to {after.rss_bytes} bytes")
    if after.shm_files > before.shm_files + SHM_SLACK:
        found.append(f"/dev/shm files grew from {before.shm_files} to {after.shm_files}")
    if after.ssd_bytes_max > ssd_bytes_limit:
        found.append(f"a node's SSD directory holds {after.ssd_bytes_max} bytes, over its {ssd_bytes_limit}")
    if after.orphans > 0:
        found.append(f"{after.orphans} engine processes outlived their node manager")
    if after.busy_gauges != 0:
        found.append(f"in-flight, queued and pending gauges sum to {after.busy_gauges}, not 0")
    return found


def lost_sessions(saved_before: Mapping[str, int], held_after: Mapping[str, int]) -> list[str]:
    """Sessions a node held `saved_before[s]` leading blocks of on SSD before a fault and fewer of
    after it (missing from `held_after`: none)."""
    return sorted(s for s, blocks in saved_before.items() if blocks > 0 and held_after.get(s, 0) < blocks)


def recovery_summary(recovery_ms: Iterable[float]) -> dict[str, float | None]:
    values = list(recovery_ms)
    return {
        "recovery_ms_p50": percentile(values, 50),
        "recovery_ms_p99": percentile(values, 99),
        "recovery_ms_max": max(values) if values else None,
    }

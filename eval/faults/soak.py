"""`symphony bench soak`: the fault bench's cluster under a long mixed load with faults on a
schedule, sampled all along, to show that what it holds stays flat.

The load is the fault scenarios' chats (`eval.faults.chats`), and every `ADVISE_EVERY_S` an
advised one: an advisory for a new conversation, then its first turn (an advisory whose turn never
comes would stay pending for its TTL). Every `fault_every_s`, the next fault of a schedule drawn
from the seed (every crash kind, and every link kind when the nodes' links run) is injected and
recovered from (`eval.faults.crashes`). Every `SAMPLE_EVERY_S` while no fault is in progress, the
cluster's resources are sampled (`eval.faults.checker.Resources`). At the end the checker judges
every answer and the leaks, as in the fault scenarios, and `flatness` compares the samples of the
run's last third with its first: a leak grows with time, which a bound on the end alone can miss
on a long run. An error in a sample, an advisory or a fault is recorded, and the soak goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from eval.faults import LINK_KINDS
from eval.faults.chats import ChatLoad
from eval.faults.checker import Resources, recovery_summary
from eval.faults.crashes import CrashRunner, Fault, schedule
from eval.faults.network import NodeLinks
from symphony.config import SymphonyConfig

SAMPLE_EVERY_S = 30.0
ADVISE_EVERY_S = 5.0
# A soak holds flat when the median of its last third is within these of its first third's (the
# first sample is taken after the warm-up, so pools and caches are full), over at least
# MIN_SAMPLES samples (none taken while a fault is in progress). Memory is anonymous resident
# memory: the nodes' DRAM arenas, shared, fill by design.
MIN_SAMPLES = 9
FLAT_RSS_RATIO = 1.25
FLAT_FD_RATIO = 1.25
FLAT_FD_SLACK = 16
FLAT_SHM_SLACK = 0
# Advisories go to the first replica, which the schedule kills now and then: this share of them,
# at least, must be answered 2xx.
ADVISED_SHARE = 0.9


@dataclasses.dataclass(frozen=True)
class Sample:
    at_s: float  # after the soak's start
    resources: Resources


def thirds(samples: Sequence[Sample]) -> tuple[list[Sample], list[Sample]]:
    """The first and last thirds of `samples` (each at least one sample when there are any)."""
    third = max(1, len(samples) // 3)
    return list(samples[:third]), list(samples[-third:])


def flatness(samples: Sequence[Sample], ssd_bytes_limit: int) -> dict[str, Any]:
    """Per resource, the medians of the first and last thirds, and whether it stayed flat (module
    docstring); the SSD bytes only need to stay within the configured capacity (the tier fills
    up to it by design)."""
    if len(samples) < MIN_SAMPLES:
        return {"samples": len(samples), "flat": False, "why": f"fewer than {MIN_SAMPLES} samples"}
    first, last = thirds(samples)

    def medians(pick: Callable[[Resources], float]) -> tuple[float, float]:
        return statistics.median(pick(s.resources) for s in first), statistics.median(pick(s.resources) for s in last)

    rss, fds, shm = medians(lambda r: r.rss_anon_bytes), medians(lambda r: r.fds), medians(lambda r: r.shm_files)
    most_ssd = max(s.resources.ssd_bytes_max for s in samples)
    found: dict[str, dict[str, Any]] = {
        "rss_anon_bytes": {"first": rss[0], "last": rss[1], "flat": rss[1] <= rss[0] * FLAT_RSS_RATIO},
        "fds": {"first": fds[0], "last": fds[1], "flat": fds[1] <= fds[0] * FLAT_FD_RATIO + FLAT_FD_SLACK},
        "shm_files": {"first": shm[0], "last": shm[1], "flat": shm[1] <= shm[0] + FLAT_SHM_SLACK},
        "ssd_bytes_max": {"most": most_ssd, "flat": most_ssd <= ssd_bytes_limit},
    }
    flat = all(v["flat"] for v in found.values())
    segments = medians(lambda r: r.ssd_segments)
    found["ssd_segments"] = {"first": segments[0], "last": segments[1]}  # grows until the tier is full
    return {"samples": len(samples), **found, "flat": flat}


class Soak:
    """Runs the soak (module docstring) under a started load."""

    def __init__(
        self,
        crashes: CrashRunner,
        faults: Sequence[Fault],
        sample: Callable[[], Awaitable[Resources]],
        advise: Callable[[], Awaitable[int]],
        say: Callable[[str], None],
        sample_every_s: float = SAMPLE_EVERY_S,
        advise_every_s: float = ADVISE_EVERY_S,
    ) -> None:
        self.crashes, self.faults, self.sample, self.advise, self.say = crashes, list(faults), sample, advise, say
        self.sample_every_s, self.advise_every_s = sample_every_s, advise_every_s
        self.samples: list[Sample] = []
        self.advisories: dict[int, int] = {}  # by status (0: no answer)
        self.errors: list[str] = []  # what went wrong in a sample, an advisory or a fault
        self.samples_skipped = 0  # due while a fault was in progress
        self._faulting = False

    async def run(self, duration_s: float, fault_every_s: float, origin_s: float) -> None:
        """Sample, advise and inject faults for `duration_s` (a fault in progress then ends first)."""
        started = time.monotonic()
        end = started + duration_s
        done = asyncio.Event()
        sampler = asyncio.create_task(self._every(self.sample_every_s, started, done, self._sample))
        adviser = asyncio.create_task(self._every(self.advise_every_s, started, done, self._advise))
        try:
            next_fault = started + fault_every_s if self.faults else math.inf
            number = 0
            while time.monotonic() < end:
                if time.monotonic() >= next_fault:
                    fault = self.faults[number % len(self.faults)]
                    number += 1
                    self.say(f"soak {time.monotonic() - started:.0f} s: fault {number}: {fault.describe()}")
                    self.crashes.origin_s = origin_s
                    self._faulting = True
                    try:
                        self.crashes.faults.append(await self.crashes.one(fault))
                    except Exception as exc:  # a soak goes on: recorded, and the fault counts as not recovered
                        self.errors.append(f"fault {fault.describe()}: {exc!r}")
                        self.crashes.faults.append({"fault": fault.describe(), "kind": fault.kind, "error": repr(exc)})
                    finally:
                        self._faulting = False
                    next_fault += fault_every_s
                with contextlib.suppress(TimeoutError):  # until the next fault is due, or the end
                    await asyncio.wait_for(done.wait(), max(0.0, min(next_fault, end) - time.monotonic()))
        finally:
            done.set()
            await asyncio.gather(sampler, adviser, return_exceptions=True)

    async def _every(
        self, period_s: float, started: float, done: asyncio.Event, action: Callable[[float], Awaitable[None]]
    ) -> None:
        while not done.is_set():
            try:
                await action(time.monotonic() - started)
            except Exception as exc:  # a soak goes on: recorded
                self.errors.append(f"{getattr(action, '__name__', 'action')}: {exc!r}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), period_s)

    async def _sample(self, at_s: float) -> None:
        if self._faulting:  # processes down or fresh: no measure of what a leak grows
            self.samples_skipped += 1
            return
        self.samples.append(Sample(round(at_s, 1), await self.sample()))

    async def _advise(self, _: float) -> None:
        status = await self.advise()
        self.advisories[status] = self.advisories.get(status, 0) + 1

    def report(self, ssd_bytes_limit: int) -> dict[str, Any]:
        faults = self.crashes.faults
        return {
            "faults": faults,
            "faults_recovered": sum(1 for f in faults if f.get("recovered")),
            "advisories_by_status": {str(k): v for k, v in sorted(self.advisories.items())},
            "errors": self.errors,
            "samples_skipped": self.samples_skipped,
            **recovery_summary(f["recovery_ms"] for f in faults if "recovery_ms" in f),
            "flatness": flatness(self.samples, ssd_bytes_limit),
            "samples": [{"at_s": s.at_s, **dataclasses.asdict(s.resources)} for s in self.samples],
        }


class SoakHost(Protocol):
    """What the soak needs of the fault bench (`eval.bench_faults.FaultBench`)."""

    settings: Any  # eval.bench_faults.FaultSettings
    config: SymphonyConfig
    links: NodeLinks | None
    say: Callable[[str], None]

    def crash_runner(self, load: ChatLoad) -> CrashRunner: ...

    async def resources(self) -> Resources: ...

    async def advise(self, tenant: str, session: str) -> int: ...

    async def checked(self, load: ChatLoad, before: Resources, distinct: bool = False) -> dict[str, Any]: ...


async def run_soak(host: SoakHost, load: ChatLoad, before: Resources, tenant: str) -> dict[str, Any]:
    """The soak under `load` (warmed up; `before`: what the cluster held then), advising `tenant`'s
    latest session; its report, the checker's included."""
    s, c = host.settings, host.config
    kinds = (*s.kinds, *(LINK_KINDS if host.links is not None else ()))
    rounds = max(1, math.ceil(s.soak_s / s.fault_every_s / len(kinds)))
    faults = schedule(s.seed, c.cluster.nodes, c.scheduler.replicas, rounds, kinds)
    crashes = host.crash_runner(load)
    await crashes.measure_baseline()

    advised = 0

    async def advise() -> int:  # then the turn it announced (module docstring)
        nonlocal advised
        advised += 1
        session = f"soak-advised-{advised}"
        status = await host.advise(tenant, session)
        await load.first_turn(tenant, session, advised)
        return status

    soak = Soak(crashes, faults, host.resources, advise, host.say)
    host.say(f"soak: {s.soak_s:g} s, a fault every {s.fault_every_s:g} s, a sample every {SAMPLE_EVERY_S:g} s")
    await soak.run(s.soak_s, s.fault_every_s, load.origin_s or 0.0)
    report = await host.checked(load, before)
    report.update({"seed": s.seed, "soak_s": s.soak_s, "fault_every_s": s.fault_every_s})
    report.update(soak.report(c.kv.ssd_bytes))
    return report


def soak_targets(report: dict[str, Any]) -> dict[str, bool]:
    """The soak's own targets: faults injected, every one recovered from, advisories answered, and
    flat (over enough samples)."""
    faults = report["faults"]
    statuses = {int(k): v for k, v in report["advisories_by_status"].items()}
    answered = sum(v for k, v in statuses.items() if 200 <= k < 300)
    return {
        "soak_every_fault_recovered": bool(faults) and all(f.get("recovered") and "skipped" not in f for f in faults),
        "soak_advisories_answered": answered > 0 and answered >= ADVISED_SHARE * sum(statuses.values()),
        "soak_flat": bool(report["flatness"]["flat"]),
    }

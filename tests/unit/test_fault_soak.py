"""The soak's pure parts (`eval.faults.soak`): flatness over the samples' thirds, its targets, and
the schedule of samples, advisories and faults over a short run."""

from __future__ import annotations

import dataclasses
from typing import Any

from eval.faults.checker import Resources
from eval.faults.crashes import Fault
from eval.faults.soak import FLAT_RSS_RATIO, MIN_SAMPLES, Sample, Soak, flatness, soak_targets

BASE = Resources(
    fds=400,
    rss_bytes=14 << 30,
    shm_files=4,
    ssd_segments=10,
    ssd_bytes_max=1 << 20,
    busy_gauges=0.0,
    rss_anon_bytes=6 << 30,
)
LIMIT = 16 << 30


def _samples(count: int, **last: int) -> list[Sample]:
    """`count` samples of BASE, the last third with `last`'s fields instead."""
    samples = []
    for i in range(count):
        resources = dataclasses.replace(BASE, **last) if i >= count - count // 3 else BASE
        samples.append(Sample(30.0 * i, resources))
    return samples


def test_a_run_holding_the_same_is_flat_and_segments_may_grow() -> None:
    found = flatness(_samples(9, ssd_segments=500), LIMIT)
    assert found["flat"] and found["samples"] == 9
    assert found["ssd_segments"] == {"first": 10, "last": 500}


def test_growth_past_a_bound_in_the_last_third_is_not_flat() -> None:
    rss = int(BASE.rss_anon_bytes * (FLAT_RSS_RATIO + 0.05))
    cases = [({"rss_anon_bytes": rss}, "rss_anon_bytes"), ({"fds": 600}, "fds"), ({"shm_files": 5}, "shm_files")]
    for fields, name in cases:
        found = flatness(_samples(9, **fields), LIMIT)
        assert not found["flat"] and not found[name]["flat"], name
    assert not flatness(_samples(9, ssd_bytes_max=LIMIT + 1), LIMIT)["flat"]


def test_one_sample_off_in_a_third_moves_no_median() -> None:
    samples = _samples(9)
    samples[-1] = Sample(samples[-1].at_s, dataclasses.replace(BASE, fds=4000))  # a fault's moment
    assert flatness(samples, LIMIT)["flat"]


def test_shared_memory_filling_is_not_growth_and_too_few_samples_are_not_flat() -> None:
    assert flatness(_samples(9, rss_bytes=20 << 30), LIMIT)["flat"]  # the arenas fill: not anonymous
    assert not flatness(_samples(MIN_SAMPLES - 1), LIMIT)["flat"]


def _report(**overrides: Any) -> dict[str, Any]:
    report = {
        "faults": [{"recovered": True}, {"recovered": True}],
        "advisories_by_status": {"202": 95, "0": 5},
        "flatness": {"flat": True},
    }
    return {**report, **overrides}


def test_the_soak_targets_fail_on_what_they_judge() -> None:
    assert all(soak_targets(_report()).values())
    assert not soak_targets(_report(faults=[{"recovered": False}]))["soak_every_fault_recovered"]
    assert not soak_targets(_report(advisories_by_status={"202": 80, "503": 20}))["soak_advisories_answered"]
    assert not soak_targets(_report(advisories_by_status={}))["soak_advisories_answered"]
    assert not soak_targets(_report(flatness={"flat": False}))["soak_flat"]
    assert not soak_targets(_report(faults=[]))["soak_every_fault_recovered"]  # none injected


class _Crashes:
    """Records the faults it is given (a fault's injection and recovery are `CrashRunner`'s)."""

    def __init__(self) -> None:
        self.faults: list[dict[str, Any]] = []
        self.origin_s = 0.0

    async def one(self, fault: Fault) -> dict[str, Any]:
        return {"kind": fault.kind, "recovered": True, "recovery_ms": 0.0}


async def test_a_short_soak_samples_advises_and_injects_its_faults_in_turn() -> None:
    crashes = _Crashes()
    faults = [Fault("engine_kill", 0, 0.0), Fault("replica_kill", 1, 0.0)]
    advised = []

    async def sample() -> Resources:
        return BASE

    async def advise() -> int:
        advised.append(1)
        return 202

    soak = Soak(crashes, faults, sample, advise, lambda _: None, sample_every_s=0.1, advise_every_s=0.1)  # type: ignore[arg-type]
    await soak.run(1.0, 0.3, origin_s=0.0)
    kinds = [f["kind"] for f in crashes.faults]
    assert 2 <= len(kinds) <= 4
    assert kinds == (["engine_kill", "replica_kill"] * 2)[: len(kinds)]  # the schedule, in turn, again
    assert len(soak.samples) >= 5 and len(advised) >= 5 and not soak.errors
    report = soak.report(LIMIT)
    assert report["faults_recovered"] == len(kinds) and report["flatness"]["flat"]


class _FailingCrashes(_Crashes):
    async def one(self, fault: Fault) -> dict[str, Any]:
        raise RuntimeError("the runner broke")


async def test_an_error_is_recorded_and_the_soak_goes_on() -> None:
    crashes = _FailingCrashes()

    async def sample() -> Resources:
        raise OSError("proc went away")

    async def advise() -> int:
        return 202

    soak = Soak(crashes, [Fault("etcd_kill", 0, 0.0)], sample, advise, lambda _: None, sample_every_s=0.1)  # type: ignore[arg-type]
    await soak.run(0.5, 0.2, origin_s=0.0)
    assert crashes.faults and all("error" in f for f in crashes.faults)
    assert any("proc went away" in e for e in soak.errors) and any("the runner broke" in e for e in soak.errors)
    assert not soak_targets(soak.report(LIMIT))["soak_every_fault_recovered"]

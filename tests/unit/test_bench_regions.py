"""`symphony bench regions`: its split of users, its residency count, its targets and its flags."""

from __future__ import annotations

import pytest

from eval.bench_regions import RegionLoadSettings, region_targets, summarize_regions
from eval.loadgen import RequestRecord
from symphony.cli import main
from symphony.regions import build_topology

NAMES = ("us-east", "eu-west", "ap-south")
TOPOLOGY = build_topology(
    ["us-east:1", "eu-west:1", "ap-south:1"],
    ["us-east~eu-west:75:1000", "us-east~ap-south:190:1000", "eu-west~ap-south:120:1000"],
    1.0,
    ["r0-symphony-eu=eu-west"],
)


@pytest.mark.parametrize(
    ("users", "hot_share", "split"),
    [
        (9, 0.6, {"us-east": 5, "eu-west": 2, "ap-south": 2}),
        (10, 0.6, {"us-east": 6, "eu-west": 2, "ap-south": 2}),
        (3, 0.9, {"us-east": 1, "eu-west": 1, "ap-south": 1}),
        (12, 0.5, {"us-east": 6, "eu-west": 3, "ap-south": 3}),
    ],
)
def test_users_are_split_with_the_hot_region_first(users: int, hot_share: float, split: dict[str, int]) -> None:
    assert RegionLoadSettings(users=users, hot_share=hot_share).users_by_region(NAMES) == split


def _record(session: str, node: str, ttft_s: float = 0.1) -> RequestRecord:
    return RequestRecord(
        0,
        session,
        0,
        0.0,
        False,
        0.0,
        node=node,
        ok=True,
        ttft_s=ttft_s,
        e2e_s=ttft_s * 2,
        prompt_tokens=100,
        cached_tokens=40,
        output_tokens=8,
    )


def test_a_restricted_tenants_request_served_outside_its_region_is_a_violation() -> None:
    records = [
        _record("r0-symphony-eu.eu-west-u0-c0", "node-1"),  # EU-only, in eu-west: fine
        _record("r0-symphony-eu.eu-west-u0-c1", "node-0"),  # EU-only, in us-east: a violation
        _record("r0-symphony.us-east-u0-c0", "node-0"),  # unrestricted
        _record("r0-symphony.eu-west-u1-c0", "node-2"),  # unrestricted, homed in eu-west: fine anywhere
    ]
    summary = summarize_regions(records, "r0-symphony-eu.", "r0-symphony-eu", TOPOLOGY, ["node-0", "node-1", "node-2"])
    assert summary["residency_violations"] == 1
    assert summary["requests_by_region"] == {"us-east": 2, "eu-west": 1, "ap-south": 1}
    assert summary["prefill_tokens_computed"] == 240 and summary["prefill_tokens_total"] == 400
    assert summary["e2e_ms_p95"] == pytest.approx(200)


def test_the_targets_compare_symphony_with_the_better_baseline_and_nearest() -> None:
    def policy(p95: float, errors: int = 0, violations: int = 0) -> dict[str, float]:
        return {"ttft_ms_p95": p95, "errors": errors, "residency_violations": violations}

    met = region_targets(
        {"nearest": policy(1000), "skywalker": policy(600), "gorgo": policy(700), "symphony": policy(500)}
    )
    assert met["symphony_p95_vs_best_of_skywalker_gorgo"] == pytest.approx(500 / 600)
    assert met["symphony_p95_vs_best_met"] and met["symphony_p95_vs_nearest_met"] and met["residency_violations_zero"]
    missed = region_targets(
        {"nearest": policy(600), "skywalker": policy(550), "gorgo": policy(700), "symphony": policy(500, violations=1)}
    )
    assert not missed["symphony_p95_vs_best_met"] and not missed["symphony_p95_vs_nearest_met"]
    assert not missed["residency_violations_zero"]
    on_the_wire = region_targets({"symphony": {**policy(500), "residency_violation_bytes": 120}})
    assert not on_the_wire["residency_violations_zero"]  # no request crossed, but its bytes did


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--policies", "nearest,teleport"], "--policies: unknown teleport"),
        (["--hot-share", "1.5"], "--hot-share 1.5"),
        (["--users", "2"], "--users 2: at least one per region"),
        (["--min-turns", "5", "--max-turns", "3"], "--min-turns 5 is above --max-turns 3"),
    ],
)
def test_bad_flags_are_named(capsys: pytest.CaptureFixture[str], flags: list[str], named: str) -> None:
    assert main(["bench", "regions", "--out", "/tmp/never-written.json", *flags]) == 2
    assert named in capsys.readouterr().err


def test_residency_on_the_wire_counts_the_tenants_bytes_out_of_its_regions_and_what_no_link_placed() -> None:
    from eval.bench_regions import _wire_residency
    from symphony.link_tenants import UNATTRIBUTED
    from symphony.regions import DEFAULT_WAN_LINKS, build_topology

    topology = build_topology(
        ["us-east:1", "eu-west:1", "ap-south:1"], list(DEFAULT_WAN_LINKS), 1.0, ["eu=eu-west"], links_are_default=True
    )
    links = [
        {"pair": "eu-west~us-east", "sniff_errors": 1, "tenant_bytes": {"eu-west>us-east": {"eu": 7, UNATTRIBUTED: 3}}},
        {"pair": "ap-south~us-east", "sniff_errors": 0, "tenant_bytes": {"us-east>ap-south": {"eu": 2, "other": 4}}},
        {"pair": "ap-south~eu-west", "sniff_errors": 0, "tenant_bytes": {"eu-west>ap-south": {"none": 50, "x": 9}}},
    ]
    assert _wire_residency(links, "eu", topology) == (9, 7, 1)
    with pytest.raises(ValueError, match="no residency rule"):
        _wire_residency(links, "x", topology)

"""scheduler.cost_profile and scheduler.profile_loader: the profile's checks, its file, and the
scheduler's fallback to defaults (with a warning, never a crash) for a missing, bad or stale file."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest

from scheduler.cost_profile import (
    DEFAULT_PROFILE,
    LinkCost,
    NodeLink,
    ProfileError,
    TierLoadCosts,
    from_dict,
    from_json,
    problems,
    staleness,
    to_dict,
    to_json,
)
from scheduler.profile_loader import ProfileStatus, load_cost_profile
from symphony.config import ConfigError, load_config

NOW = 1_800_000_000.0
DAY = 86_400.0
MEASURED = dataclasses.replace(
    DEFAULT_PROFILE,
    links=(NodeLink("node-0", "node-1", 0.3, 2.5), NodeLink("node-1", "node-0", 0.4, 2.0)),
    measured_at_unix_s=NOW - DAY,
    host="host-a",
    model="m",
    source="test",
)


def load(path: Path, **kwargs: object) -> object:
    args: dict[str, object] = {"host": "host-a", "model": "m", "now_unix_s": NOW, "max_age_s": 30 * DAY}
    args.update(kwargs)
    return load_cost_profile(path, **args)  # type: ignore[arg-type]


# -- the profile ------------------------------------------------------------------------------------
def test_the_defaults_and_a_measured_profile_are_plausible() -> None:
    assert problems(DEFAULT_PROFILE) == []
    assert problems(MEASURED) == []


def test_a_profile_survives_its_file_unchanged() -> None:
    assert from_json(to_json(MEASURED)) == MEASURED
    assert from_json(to_json(DEFAULT_PROFILE)) == DEFAULT_PROFILE
    assert json.loads(to_json(MEASURED))["links"][1] == {
        "source": "node-1",
        "target": "node-0",
        "rtt_ms": 0.4,
        "bandwidth_gbps": 2.0,
    }


def test_links_are_per_ordered_pair_with_a_default_for_the_rest() -> None:
    assert MEASURED.link("node-0", "node-1") == LinkCost(0.3, 2.5)
    assert MEASURED.link("node-1", "node-0") == LinkCost(0.4, 2.0)
    assert MEASURED.link("node-0", "node-2") == MEASURED.default_link
    # 1 MB at 2.5 GB/s is 0.4 ms, after the 0.3 ms round trip.
    assert MEASURED.link("node-0", "node-1").move_ms(1e6) == pytest.approx(0.7)


def test_prefill_and_step_prices_match_the_simulators_engine_model() -> None:
    p = dataclasses.replace(
        DEFAULT_PROFILE, prefill_ms_per_token=1.0, prefill_ms_per_token_kilotoken=0.5, step_ms=10.0,
        decode_ms_per_seq=2.0, decode_ms_per_kilotoken=3.0,
    )  # fmt: skip
    # 100 tokens after 900 held: mean position 950 -> 100 x 1 + 0.5 x 100 x 950 / 1000.
    assert p.prefill_ms(100, 1000) == pytest.approx(147.5)
    assert p.step_with(4, 2000) == pytest.approx(10 + 8 + 6)


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"step_ms": -1.0}, "step_ms: -1.0 is outside"),
        ({"prefill_ms_per_token": math.nan}, "prefill_ms_per_token: nan is not a finite number"),
        ({"decode_ms_per_seq": math.inf}, "decode_ms_per_seq: inf is not a finite number"),
        ({"request_overhead_ms": "fast"}, "request_overhead_ms: 'fast' is not a finite number"),
        ({"prefill_ms_per_token": 5_000.0}, "prefill_ms_per_token: 5000.0 is outside"),
        ({"prefill_ms_per_token": 0.0, "prefill_ms_per_token_kilotoken": 0.0}, "prefill costs nothing"),
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token: 0 is outside"),
        ({"version": 2}, "version: 2 is not 1"),
        ({"tier_load_ms_per_token": TierLoadCosts(0.0, 0.01, 0.001, 0.1)}, "hbm (0.01) costs more than dram (0.001)"),
        ({"tier_load_ms_per_token": TierLoadCosts(0.0, 0.001, 0.01, 0.005)}, "dram (0.01) costs more than ssd (0.005)"),
        ({"tier_load_ms_per_token": TierLoadCosts(0.5, 1.0, 1.0, 1.0)}, "engine: 0.5; the engine's own cache"),
        ({"tier_load_ms_per_token": TierLoadCosts(0.0, -0.1, 0.01, 0.1)}, "tier_load_ms_per_token.hbm: -0.1"),
        ({"default_link": LinkCost(0.2, 0.0)}, "default_link.bandwidth_gbps: 0.0 is outside"),
        ({"links": (NodeLink("a", "b", -3.0, 1.0),)}, "links[a->b].rtt_ms: -3.0 is outside"),
        ({"links": (NodeLink("a", "b", 1.0, 1.0), NodeLink("a", "b", 2.0, 1.0))}, "a node pair is listed twice"),
        ({"links": (NodeLink("a", "a", 1.0, 1.0),)}, "a link from a node to itself"),
    ],
)
def test_implausible_figures_are_named(change: dict[str, object], complaint: str) -> None:
    found = problems(dataclasses.replace(MEASURED, **change))  # type: ignore[arg-type]
    assert any(complaint in problem for problem in found), found


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("{", "not JSON"),
        ("[1, 2]", "profile: expected an object"),
        (json.dumps({**to_dict(MEASURED), "stepms": 1.0}), "unknown key(s) stepms"),
        (json.dumps({k: v for k, v in to_dict(MEASURED).items() if k != "step_ms"}), "missing key(s) step_ms"),
        (json.dumps({**to_dict(MEASURED), "default_link": {"rtt_ms": 1.0}}), "default_link: missing key(s)"),
        (json.dumps({**to_dict(MEASURED), "links": {"a": 1}}), "links: expected a list"),
        (json.dumps({**to_dict(MEASURED), "links": [{"source": 1, "target": "b", "rtt_ms": 1, "bandwidth_gbps": 1}]}),
         "links[0].source: expected a string"),
        (json.dumps({**to_dict(MEASURED), "host": 7}), "host: expected a string"),
    ],
)  # fmt: skip
def test_files_that_are_not_profiles_are_refused_with_the_reason(text: str, complaint: str) -> None:
    with pytest.raises(ProfileError) as excinfo:
        from_json(text)
    assert complaint in str(excinfo.value)


def test_links_are_optional_in_a_file() -> None:
    body = {k: v for k, v in to_dict(MEASURED).items() if k != "links"}
    assert from_dict(body) == dataclasses.replace(MEASURED, links=())


def test_a_profile_is_stale_when_old_from_another_host_or_model() -> None:
    fresh = {"host": "host-a", "model": "m", "now_unix_s": NOW, "max_age_s": 30 * DAY}
    assert staleness(MEASURED, **fresh) is None  # type: ignore[arg-type]
    assert "days ago" in (staleness(MEASURED, **{**fresh, "max_age_s": 0.5 * DAY}) or "")  # type: ignore[arg-type]
    assert "host 'host-a'" in (staleness(MEASURED, **{**fresh, "host": "host-b"}) or "")  # type: ignore[arg-type]
    assert "model 'm'" in (staleness(MEASURED, **{**fresh, "model": "other"}) or "")  # type: ignore[arg-type]
    assert "future" in (staleness(MEASURED, **{**fresh, "now_unix_s": NOW - 3 * DAY}) or "")  # type: ignore[arg-type]


# -- loading ----------------------------------------------------------------------------------------
def test_a_good_file_is_loaded(tmp_path: Path) -> None:
    path = tmp_path / "cost-profile.json"
    path.write_text(to_json(MEASURED))
    loaded = load(path)
    assert loaded.status == ProfileStatus.LOADED and loaded.profile == MEASURED and loaded.problem == ""  # type: ignore[attr-defined]
    shown = loaded.describe()  # type: ignore[attr-defined]
    assert shown["status"] == "loaded" and shown["host"] == "host-a" and shown["links"] == 2
    assert shown["prefill_ms_1k_tokens"] == pytest.approx(MEASURED.prefill_ms(1000, 1000), abs=0.05)


@pytest.mark.parametrize(
    ("write", "kwargs", "status", "problem"),
    [
        (None, {}, ProfileStatus.MISSING, "no cost profile file"),
        ("not json", {}, ProfileStatus.INVALID, "not JSON"),
        (to_json(dataclasses.replace(MEASURED, step_ms=-5.0)), {}, ProfileStatus.INVALID, "step_ms: -5.0"),
        (to_json(MEASURED), {"max_age_s": 3600.0}, ProfileStatus.STALE, "days ago"),
        (to_json(MEASURED), {"host": "host-b"}, ProfileStatus.STALE, "not on this one ('host-b')"),
        (to_json(MEASURED), {"model": "llama"}, ProfileStatus.STALE, "not 'llama'"),
    ],
)
def test_a_missing_bad_or_stale_file_leaves_the_defaults_and_a_warning(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    write: str | None,
    kwargs: dict[str, object],
    status: ProfileStatus,
    problem: str,
) -> None:
    path = tmp_path / "cost-profile.json"
    if write is not None:
        path.write_text(write)
    with caplog.at_level(logging.WARNING, logger="scheduler.profile_loader"):
        loaded = load(path, **kwargs)
    assert loaded.profile is DEFAULT_PROFILE and loaded.status == status  # type: ignore[attr-defined]
    assert problem in loaded.problem  # type: ignore[attr-defined]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    fields = warnings[0].symphony_fields  # type: ignore[attr-defined]  # the structured fields
    assert problem in fields["problem"] and fields["path"] == str(path) and fields["status"] == str(status)
    assert loaded.describe()["status"] == str(status)  # type: ignore[attr-defined]


def test_an_unreadable_file_leaves_the_defaults(tmp_path: Path) -> None:
    loaded = load(tmp_path)  # a directory: reading it fails
    assert loaded.status == ProfileStatus.INVALID and loaded.profile is DEFAULT_PROFILE  # type: ignore[attr-defined]


# -- configuration ----------------------------------------------------------------------------------
def test_the_profile_lives_under_the_home_unless_configured(tmp_path: Path) -> None:
    config = load_config(env={"SYMPHONY_HOME": str(tmp_path)})
    assert config.cost_profile_path == tmp_path / "cost-profile.json"
    elsewhere = load_config(env={"SYMPHONY_HOME": str(tmp_path), "SYMPHONY_SCHEDULER_COST_PROFILE": "/etc/p.json"})
    assert elsewhere.cost_profile_path == Path("/etc/p.json")
    with pytest.raises(ConfigError, match="cost_profile_max_age_days"):
        load_config(env={"SYMPHONY_SCHEDULER_COST_PROFILE_MAX_AGE_DAYS": "0"})

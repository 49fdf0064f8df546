"""symphony.cli.main: argument errors and `config show`, without starting anything."""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from symphony.cli import main


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No SYMPHONY_* from the caller's shell, home under tmp_path, root logger restored afterwards."""
    for name in list(os.environ):
        if name.startswith("SYMPHONY_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SYMPHONY_HOME", str(tmp_path / "home"))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    loggers = {
        name: logging.getLogger(name).level for name in ("symphony", "scheduler", "node_manager", "client_sdk", "eval")
    }
    access_disabled = logging.getLogger("uvicorn.access").disabled
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, old in loggers.items():
        logging.getLogger(name).setLevel(old)
    logging.getLogger("uvicorn.access").disabled = access_disabled


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_up_with_bad_node_count_is_a_usage_error(capsys: pytest.CaptureFixture[str], value: str) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["up", "--nodes", value])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "--nodes" in err
    assert "positive integer" in err


@pytest.mark.parametrize("value", ["-1", "81", "many"])
def test_bench_resume_conversations_out_of_range_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["bench", "resume", "--out", "r.json", "--conversations", value])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "--conversations" in err
    assert "from 0 to 80" in err


def test_bench_proxy_without_out_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["bench", "proxy"])
    assert excinfo.value.code == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt-tokens", "100", "--cpu-shared-tokens", "101"], "cannot be larger"),
        (["--cpu-only", "--cpu-requests", "0"], "measures nothing"),
    ],
)
def test_bench_proxy_cpu_flags_that_contradict_are_refused(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "proxy", "--out", "/tmp/never-written.json", *flags]) == 2
    assert message in capsys.readouterr().err


def test_bench_resume_context_must_fill_whole_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "resume", "--out", "/tmp/never-written.json", "--context-tokens", "1000"]) == 2
    err = capsys.readouterr().err
    assert "--context-tokens 1000" in err and "block_size" in err


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main([])
    assert excinfo.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_config_show_with_invalid_toml_returns_2_naming_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "broken.toml"
    bad.write_text("[scheduler\nport = 1\n")
    assert main(["config", "show", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "symphony: error:" in err
    assert "broken.toml" in err


def test_config_show_with_missing_file_returns_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["config", "show", "--config", str(tmp_path / "absent.toml")]) == 2
    assert "absent.toml" in capsys.readouterr().err


def test_config_show_applies_env_overrides(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SYMPHONY_SCHEDULER_PORT", "9001")
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert "port = 9001" in out
    shown = tomllib.loads(out)
    assert shown["scheduler"]["port"] == 9001
    assert shown["home"] == str(tmp_path / "home")


def test_config_show_reports_bad_env_value_naming_the_var(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYMPHONY_SCHEDULER_PORT", "ninety")
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert "symphony: error:" in err
    assert "SYMPHONY_SCHEDULER_PORT" in err


def test_config_show_reads_the_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "symphony.toml"
    path.write_text("[cluster]\nnodes = 5\n")
    assert main(["config", "show", "--config", str(path)]) == 0
    assert tomllib.loads(capsys.readouterr().out)["cluster"]["nodes"] == 5


@pytest.mark.parametrize(("preset", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_bench_tiers_runs_openmp_passive_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, preset: str | None, expected: str
) -> None:
    """The bench's memcpy bound must not leave OpenMP threads spinning on the cores the store's copy
    lanes are timed on next; a policy the user set wins."""
    import eval.bench_tiers

    if preset is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", preset)
    seen: list[str | None] = []
    monkeypatch.setattr(eval.bench_tiers, "run_tiers_bench", lambda **_: seen.append(os.environ.get("OMP_WAIT_POLICY")))
    assert main(["bench", "tiers", "--out", str(tmp_path / "f.json")]) == 0
    assert seen == [expected]


def test_status_describes_the_cost_profile_in_use(tmp_path: Path) -> None:
    from scheduler.cost_profile import DEFAULT_PROFILE
    from scheduler.profile_loader import LoadedProfile, ProfileStatus
    from symphony.cli_status import _describe_profile

    missing = LoadedProfile(DEFAULT_PROFILE, "/x/cost-profile.json", ProfileStatus.MISSING, "no cost profile file")
    text = _describe_profile(missing.describe())
    assert text.startswith("cost profile /x/cost-profile.json: missing (no cost profile file); routing on built-in")
    assert "prefill 924 ms per 1k tokens" in text and "dram 1.45" in text and "links: 0 measured" in text


def test_status_describes_the_observed_links_as_readyz_reports_them() -> None:
    import dataclasses
    import json

    from scheduler.cost_profile import DEFAULT_PROFILE
    from scheduler.pull_costs import ObservedLinks
    from symphony.cli_status import MAX_STATUS_LINKS, _describe_links

    links = ObservedLinks(DEFAULT_PROFILE)
    links.observe("node-0", "node-1", 1_000, 120.0)
    shown = [json.loads(json.dumps(dataclasses.asdict(x))) for x in links.describe()]  # as /readyz sends it
    calibrated = DEFAULT_PROFILE.kv_bytes_per_token / (DEFAULT_PROFILE.default_link.bandwidth_gbps * 1e6)
    observed = (120.0 - DEFAULT_PROFILE.default_link.rtt_ms) / 1_000 - 2 * DEFAULT_PROFILE.tier_load_ms_per_token.dram
    assert _describe_links(shown) == [
        f"  pulls node-0 -> node-1: {observed:.3f} ms/token over 1 pulls (calibrated {calibrated:.3f}), not priced yet"
    ]
    # A fleet's pairs run to thousands: the first few, and how many more.
    many = _describe_links(shown * (MAX_STATUS_LINKS + 4))
    assert len(many) == MAX_STATUS_LINKS + 1 and many[-1].startswith("  ... and 4 more observed links")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--regions", "us-east:0"], "--regions: 'us-east:0' is not"),
        (["--regions", ""], "--regions: name at least one region"),
        (["--regions", "a:1,a:2"], "--regions: region 'a' is given twice"),
        (["--regions", "a:1,b:2", "--nodes", "2"], "--nodes 2 disagrees with --regions, which places 3 nodes"),
    ],
)
def test_up_names_a_bad_regions_flag(capsys: pytest.CaptureFixture[str], flags: list[str], named: str) -> None:
    assert main(["up", *flags]) == 2
    assert named in capsys.readouterr().err


def test_the_region_commands_need_a_layout(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("global", "links"):
        assert main([command]) == 2
        assert "regions.layout is empty" in capsys.readouterr().err


def test_a_scheduler_of_a_multi_region_cluster_needs_its_region(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYMPHONY_REGIONS_LAYOUT", "us-east:1,eu-west:1")
    monkeypatch.setenv("SYMPHONY_REGIONS_LINKS", "us-east~eu-west:75:1000")
    monkeypatch.setenv("SYMPHONY_CLUSTER_NODES", "2")
    monkeypatch.setenv("SYMPHONY_KV_DATA_PLANE", "grpc")
    assert main(["scheduler"]) == 2
    assert "--region: regions.layout names regions; say which this scheduler serves (us-east, eu-west)" in (
        capsys.readouterr().err
    )


def test_status_shows_a_links_biggest_owners_of_bytes() -> None:
    from symphony.cli_status import STATUS_TENANTS, describe_region_links

    owners = {f"t{i}": 1_000 * (i + 1) for i in range(STATUS_TENANTS + 2)}
    link = {
        "pair": "eu-west~us-east",
        "rtt_ms": 75.0,
        "bandwidth_mbps": 1000.0,
        "jitter_ms": 0.0,
        "loss": 0.0,
        "fault": "none",
        "open": 1,
        "bytes": {"us-east>eu-west": sum(owners.values()) + 5_000_000, "eu-west>us-east": 0},
        "tenant_bytes": {"us-east>eu-west": {**owners, "acme": 5_000_000}, "eu-west>us-east": {}},
        "sniff_errors": 2,
    }
    lines = describe_region_links([link])
    assert len(lines) == 2
    assert lines[1].strip().startswith("by owner: acme 5.0 MB, t5 6.0 kB, t4 5.0 kB, t3 4.0 kB (+3 more)")
    assert "unread connections 2" in lines[1]
    del link["tenant_bytes"]  # a links process from before the counters: one line, as before
    assert len(describe_region_links([link])) == 1

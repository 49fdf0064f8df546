"""`symphony bench route` at tiny scale: every policy routes through the real tables and the result
has the keys the evaluation issue asks for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.bench_route import RouteWorkload, _Traffic, measure_policy
from symphony.cli import main
from symphony.config import SchedulerConfig


def test_traffic_is_deterministic_and_grows_each_sessions_history() -> None:
    one, two = _Traffic(RouteWorkload(4, 50, 5, 10, seed=3)), _Traffic(RouteWorkload(4, 50, 5, 10, seed=3))
    assert one.prompt(7, 2) == two.prompt(7, 2)
    assert one.prompt(7, 2).startswith(one.prompt(7, 1))  # a turn's text extends the last one's
    assert one.prompt(7, 0).startswith(one.system[7 % 5])  # sessions of a tenant share its system prompt
    assert one.prompt(7, 0) != one.prompt(8, 0)


@pytest.mark.parametrize("policy", ["symphony", "sticky", "prefix_trie", "consistent_hash"])
def test_each_policy_is_timed_and_its_state_measured(policy: str) -> None:
    row = measure_policy(policy, _Traffic(RouteWorkload(nodes=8, sessions=300, tenants=10, requests=400)))
    assert 0 < row["decision_us_p50"] <= row["decision_us_p99"]
    assert row["peak_memory_mb"] > 0
    assert row["sessions_tracked"] == 300  # every session's turns went through the session table
    assert row["queued"] < 400


def test_the_cli_writes_json_with_targets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "route.json"
    assert (
        main(
            [
                "bench",
                "route",
                "--out",
                str(out),
                "--nodes",
                "4",
                "--sessions",
                "200",
                "--requests",
                "200",
                "--policies",
                "symphony,prefix_trie",
                "--plot",
                str(tmp_path / "route.png"),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert set(result["policies"]) == {"symphony", "prefix_trie"}
    assert set(result["targets"]) == {"symphony_p99_le_500us", "prefix_trie_p99_le_1000us"}
    assert result["prefix_trie_max_chars"] == SchedulerConfig().prefix_trie_max_chars
    assert (tmp_path / "route.png").stat().st_size > 0
    assert "target symphony_p99_le_500us" in capsys.readouterr().out


def test_an_unknown_policy_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bench", "route", "--out", str(tmp_path / "r.json"), "--policies", "symphony,nope"]) == 2
    assert "--policies: unknown nope" in capsys.readouterr().err

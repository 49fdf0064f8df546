"""`symphony bench route` at tiny scale: every policy routes through the real tables, the policy
that locates KV through the real cluster KV index fed by node snapshots, and the result has the keys
the evaluation issue asks for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.bench_route import RouteWorkload, _build_index, _Traffic, measure_policy
from eval.route_kv import FINGERPRINT, FleetIndex, Streams, cluster_index
from scheduler.kv_index import NodePrefix
from symphony.cli import main
from symphony.config import SchedulerConfig
from symphony.kv_addressing import chain_block_keys


def test_traffic_is_deterministic_and_grows_each_sessions_history() -> None:
    one, two = _Traffic(RouteWorkload(4, 50, 5, 10, seed=3)), _Traffic(RouteWorkload(4, 50, 5, 10, seed=3))
    assert one.prompt(7, 2) == two.prompt(7, 2)
    assert one.prompt(7, 2).startswith(one.prompt(7, 1))  # a turn's text extends the last one's
    assert one.prompt(7, 0).startswith(one.system[7 % 5])  # sessions of a tenant share its system prompt
    assert one.prompt(7, 0) != one.prompt(8, 0)


def test_token_streams_extend_each_turn_and_share_the_tenants_system_prompt() -> None:
    streams = Streams(sessions=50, tenants=5, nodes=4, index_blocks=3000, block_size=16, seed=1)
    assert streams.blocks == 3000  # the system prompts' blocks and the histories' own
    first, later = streams.ids(7, 0), streams.ids(7, 2)
    assert len(first) == streams.tokens(7, 0) and len(later) == streams.tokens(7, 2) > len(first)
    assert (later[: len(first)] == first).all() and not later.flags.writeable
    assert all(64 <= streams.tokens(7, turn + 1) - streams.tokens(7, turn) < 512 for turn in range(6))
    system = streams.system[2]  # sessions 2 and 7 are tenant 2's
    assert (streams.ids(2, 0)[: len(system)] == system).all() and (first[: len(system)] == system).all()
    assert (streams.ids(2, 0)[len(system) : len(system) + 32] != first[len(system) : len(system) + 32]).any()


def test_the_fleet_index_holds_what_the_nodes_snapshots_and_live_batches_say() -> None:
    streams = Streams(sessions=60, tenants=3, nodes=4, index_blocks=5000, block_size=16)
    fleet = FleetIndex(streams, cluster_index(4, 10_000), batch_entries=64)
    population = fleet.populate()
    # As many as the streams hold, but where two sessions' first own blocks coincide (the same tokens
    # after a shared system prompt's partial block: the same key, one entry).
    assert population.blocks == fleet.index.blocks and streams.blocks - 3 <= population.blocks <= streams.blocks
    assert population.batches > 4 and all(fleet.index.synced(node) for node in fleet.node_ids)
    for session in range(60):
        keys = chain_block_keys(FINGERPRINT, streams.tenant(session), streams.history_ids(session), 16).block_keys
        held = fleet.index.prefix(keys)
        assert held[fleet.node_ids[streams.home[session]]].blocks == len(keys), "its history, on its node"
        system = len(streams.system[streams.tenant_of(session)]) // 16
        assert all(prefix.blocks >= system for prefix in held.values()), "a holder holds the system prompt"
    keys = chain_block_keys(FINGERPRINT, streams.tenant(5), streams.ids(5, 3), 16).block_keys
    other = fleet.node_ids[(streams.home[5] + 1) % 4]
    fleet.served(other, keys)
    assert fleet.index.prefix(keys)[other] == NodePrefix(len(keys), engine=len(keys))
    assert fleet.index.synced(other) and fleet.live_batches >= 1


def test_symphony_locates_each_prompt_in_the_index_and_others_do_not() -> None:
    traffic = _Traffic(RouteWorkload(nodes=4, sessions=200, tenants=10, requests=300, index_blocks=20_000))
    fleet, index = _build_index(traffic)
    assert traffic.streams.blocks == 20_000 and 19_990 <= index["index_blocks"] <= 20_000
    assert index["index_bytes"] >= index["index_array_bytes"] > 0
    assert index["kv_index_max_blocks"] == SchedulerConfig().kv_index_max_blocks  # the default holds 20k
    row = measure_policy("symphony", traffic, fleet=fleet)
    assert row["located_requests"] == 300
    assert row["located_prefix_frac_mean"] > 0.5, "the sessions' histories are found"
    assert 0 < row["located_prefix_tokens_mean"] < row["prompt_tokens_mean"]
    assert row["blocks_hashed_per_decision"] > 0  # each turn's new blocks at least
    assert "located_requests" not in measure_policy("sticky", traffic, fleet=fleet)


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
    assert 19_990 <= result["index_blocks"] <= 100 * 200 and result["index_bytes"] > 0  # 100 blocks a session
    assert result["tokenization"].startswith("excluded") and result["settings_needed"] == {}
    assert result["policies"]["symphony"]["located_prefix_tokens_mean"] > 0
    assert "located_prefix_tokens_mean" not in result["policies"]["prefix_trie"]
    assert (tmp_path / "route.png").stat().st_size > 0
    assert "target symphony_p99_le_500us" in capsys.readouterr().out


def test_an_unknown_policy_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bench", "route", "--out", str(tmp_path / "r.json"), "--policies", "symphony,nope"]) == 2
    assert "--policies: unknown nope" in capsys.readouterr().err

"""eval.traces: Mooncake and Azure traces, parsed, replayed with the right prefix sharing, grouped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.traces import (
    AZURE_SAMPLE,
    MOONCAKE_BLOCK_TOKENS,
    MOONCAKE_SAMPLE,
    TraceRequest,
    load_azure,
    load_mooncake,
    mooncake_prompt,
    sessions_of,
)
from symphony.cli import main


def _mooncake(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_prompts_share_exactly_the_blocks_their_hash_ids_share() -> None:
    a = TraceRequest(0, 3 * MOONCAKE_BLOCK_TOKENS - 100, 5, (7, 8, 9))
    b = TraceRequest(0, 2 * MOONCAKE_BLOCK_TOKENS + 10, 5, (7, 8, 11))
    pa, pb = mooncake_prompt(a), mooncake_prompt(b)
    assert (len(pa), len(pb)) == (a.input_tokens, b.input_tokens)
    shared = 2 * MOONCAKE_BLOCK_TOKENS
    assert pa[:shared] == pb[:shared] and pa[shared : shared + 10] != pb[shared:]
    assert mooncake_prompt(a) == pa  # seeded by the hash ids: the same in every process and run


def test_a_mooncake_trace_loads_in_arrival_order_scaled(tmp_path: Path) -> None:
    path = _mooncake(
        tmp_path,
        [
            {"timestamp": 2000, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 1000, "input_length": 10, "output_length": 4, "hash_ids": [1]},
        ],
    )
    requests = load_mooncake(path, time_scale=0.5)
    assert [(r.arrival_ms, r.input_tokens, r.hash_ids) for r in requests] == [(500, 10, (1,)), (1000, 600, (1, 2))]


@pytest.mark.parametrize(
    "row",
    [
        {"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 0, "input_length": 10, "output_length": 1},
        {"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]},
    ],
)
def test_a_bad_mooncake_record_is_named_by_line(tmp_path: Path, row: dict) -> None:
    path = _mooncake(tmp_path, [{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [3]}, row])
    with pytest.raises(ValueError, match=r"trace\.jsonl:2"):
        load_mooncake(path)


def test_a_conversations_turns_are_one_session_and_a_shared_system_prompt_is_not() -> None:
    requests = [
        TraceRequest(0, 100, 1, (0, 1, 2)),
        TraceRequest(1, 100, 1, (0, 1, 2, 3)),  # the next turn of the first
        TraceRequest(2, 100, 1, (0, 5, 6)),  # only the system prompt in common: another conversation
        TraceRequest(3, 100, 1, (0, 1, 2, 3, 4, 9)),  # the first again, one turn later
        TraceRequest(4, 100, 1, ()),
    ]
    assert sessions_of(requests) == ["s0", "s0", "s2", "s0", "s4"]


def test_the_azure_trace_gives_lengths_and_relative_arrivals(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:47.1805900,396,109\n"
    )
    requests = load_azure(path, time_scale=2.0)
    assert [(round(r.arrival_ms), r.input_tokens, r.output_tokens) for r in requests] == [
        (0, 374, 44),
        (1000, 396, 109),
    ]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n")
    with pytest.raises(ValueError, match=r"azure\.csv:2"):
        load_azure(path)


def test_the_published_traces_samples_load() -> None:
    mooncake = load_mooncake(MOONCAKE_SAMPLE)
    assert len(mooncake) == 300 and all(len(r.hash_ids) * 512 >= r.input_tokens for r in mooncake)
    assert len(set(sessions_of(mooncake))) < len(mooncake)  # some conversations have several turns here
    azure = load_azure(AZURE_SAMPLE, limit=100)
    assert len(azure) == 100 and azure[0].arrival_ms == 0 and azure[-1].arrival_ms > 0


def test_the_trace_scenario_replays_a_trace_under_each_policy(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 100 * i, "input_length": 300 + 50 * i, "output_length": 8, "hash_ids": list(range(i + 1))}
        for i in range(6)
    ]
    out = tmp_path / "sim.json"
    assert (
        main(
            [
                "bench",
                "sim",
                "--scenario",
                "trace",
                "--workload",
                str(_mooncake(tmp_path, rows)),
                "--policies",
                "symphony,recompute",
                "--nodes",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["requests"] == 6 and set(result["points"]) == {"symphony", "recompute"}
    assert all(row["completed"] == 6 for row in result["points"].values())
    # Every turn continues the same conversation: Symphony computes less of the prompts than recompute may.
    assert (
        result["points"]["symphony"]["prefill_tokens_computed"]
        <= result["points"]["recompute"]["prefill_tokens_computed"]
    )

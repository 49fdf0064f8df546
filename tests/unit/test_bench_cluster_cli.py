"""`symphony bench cluster`'s options: what workload, policies, repeats and settings they make (the
benchmark itself replaced by a recorder: no cluster starts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import eval.bench_cluster
from eval.live_workloads import ChatWorkload, SharedPrefixWorkload, TraceWorkload
from symphony.cli import main


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []

    def record(config: Any, **kwargs: Any) -> int:
        seen.append(kwargs)
        return 0

    monkeypatch.setattr(eval.bench_cluster, "run_cluster_bench", record)
    return seen


def _run(tmp_path: Path, *args: str) -> int:
    return main(["bench", "cluster", "--out", str(tmp_path / "c.json"), *args])


def test_the_defaults_replay_sharegpt_once_per_policy(tmp_path: Path, calls: list[dict[str, Any]]) -> None:
    assert _run(tmp_path) == 0
    [call] = calls
    assert call["policies"] == ["symphony", "recompute", "sticky", "least_load", "prefix_trie"]
    assert call["repeats"] == 5  # a full rotation
    assert isinstance(call["workload"], ChatWorkload) and call["workload"].kind == "sharegpt"
    assert call["workload"].timing.time_scale == 0.05 and call["workload"].timing.typing_time_scale is None
    settings = call["settings"]
    assert (settings.users, settings.duration_s, settings.max_answer_tokens, settings.seed) == (8, 90, 64, 7)
    assert call["header"]["conversations"] == len(call["workload"].conversations) > 100


def test_skewed_users_and_human_scale_typing(tmp_path: Path, calls: list[dict[str, Any]]) -> None:
    args = ("--workload", "skewed", "--heavy-share", "0.5", "--typing-time-scale", "1", "--repeats", "2")
    assert _run(tmp_path, *args) == 0
    workload = calls[0]["workload"]
    assert workload.kind == "skewed" and workload.skew.heavy_share == 0.5 and workload.skew.heavy_pace == 0.25
    assert workload.timing.typing_time_scale == 1.0 and calls[0]["repeats"] == 2
    assert calls[0]["header"]["skew"]["heavy_history_tokens"] == 4096


def test_shared_prefix_runs_the_prefix_policies(tmp_path: Path, calls: list[dict[str, Any]]) -> None:
    assert _run(tmp_path, "--workload", "shared-prefix", "--rate", "0.5", "--prefix-tokens", "1000-1200") == 0
    call = calls[0]
    assert call["policies"] == ["symphony", "prefix_trie", "least_load", "recompute"] and call["repeats"] == 4
    assert isinstance(call["workload"], SharedPrefixWorkload)
    shared = call["workload"].settings
    assert (shared.groups, shared.prefix_tokens, shared.question_tokens, shared.rate_per_s) == (
        16,
        (1000, 1200),
        (100, 200),
        0.5,
    )


def test_a_trace_is_replayed_within_the_context(tmp_path: Path, calls: list[dict[str, Any]]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}))
    assert _run(tmp_path, "--trace", str(trace), "--max-tokens", "32") == 0
    workload = calls[0]["workload"]
    assert isinstance(workload, TraceWorkload) and len(workload.trace) == 1
    assert workload.settings.max_prompt_tokens == 8192 - 32 - 1 and workload.settings.block_tokens == 64
    assert workload.settings.time_scale == 0.05  # --time-scale is the trace's clock


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--trace", "x.jsonl", "--workload", "skewed"), "--trace replaces --workload"),
        (("--workload", "shared-prefix", "--prefix-tokens", "8000-8000"), "pass the context"),
        (("--workload", "skewed", "--heavy-share", "0"), "heavy_share"),
        (("--typing-time-scale", "0"), "--typing-time-scale"),
        (("--workload", "no-such-file.jsonl"), "no such file"),
        (("--policies", "symphony,nope"), "unknown nope"),
    ],
)
def test_bad_options_are_refused_by_name(
    tmp_path: Path, calls: list[dict[str, Any]], capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    assert _run(tmp_path, *args) != 0
    assert message in capsys.readouterr().err and not calls


def test_a_token_range_is_low_high(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _run(tmp_path, "--question-tokens", "200-100")
    assert "LOW <= HIGH" in capsys.readouterr().err

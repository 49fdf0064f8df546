"""eval.workloads (ShareGPT replay, human timing) and eval.cluster_summary's summaries: pure, seeded."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from eval.cluster_summary import summarize, targets
from eval.loadgen import RequestRecord, server_timing_ms
from eval.workloads import SHAREGPT_SAMPLE, HumanTiming, Turn, answer_tokens, load_sharegpt


def test_the_vendored_sample_loads_as_multi_turn_conversations() -> None:
    conversations = load_sharegpt(SHAREGPT_SAMPLE)
    assert len(conversations) >= 110
    assert all(2 <= len(c.turns) <= 8 for c in conversations)
    assert all(t.message for c in conversations for t in c.turns)


def test_replay_skips_leading_answers_and_system_messages_and_cuts_long_messages(tmp_path: Path) -> None:
    record = {
        "id": "x",
        "conversations": [
            {"from": "gpt", "value": "an excerpt that starts mid-conversation"},
            {"from": "system", "value": "be nice"},
            {"from": "human", "value": "one two three four five"},
            {"from": "gpt", "value": "a b c"},
            {"from": "human", "value": "again"},
            {"from": "human", "value": "and again"},
        ],
    }
    path = tmp_path / "c.jsonl"
    path.write_text(
        json.dumps(record)
        + "\n"
        + json.dumps({"id": "short", "conversations": [{"from": "human", "value": "hi"}]})
        + "\n"
    )
    [conversation] = load_sharegpt(path, max_message_words=3)
    assert conversation.turns == (Turn("one two three", 3), Turn("again", 0), Turn("and again", 0))
    (tmp_path / "list.json").write_text(json.dumps([record]))
    assert load_sharegpt(tmp_path / "list.json")[0].conversation_id == "x"


@pytest.mark.parametrize("content", ["not json", json.dumps({"id": 1})])
def test_a_file_that_is_not_sharegpt_is_refused_by_name(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"bad\.jsonl"):
        load_sharegpt(path)


def test_users_read_and_type_at_human_speeds_reproducibly() -> None:
    timing = HumanTiming()
    users = [timing.user(seed) for seed in range(2000)]
    assert statistics.fmean(u.reading_wpm for u in users) == pytest.approx(184, abs=3)
    assert statistics.stdev(u.reading_wpm for u in users) == pytest.approx(29, abs=3)
    assert statistics.fmean(u.typing_wpm for u in users) == pytest.approx(52, abs=2)
    again = HumanTiming().user(7)
    assert (again.reading_wpm, again.typing_wpm) == (users[7].reading_wpm, users[7].typing_wpm)
    user = HumanTiming(time_scale=0.1).user(7)
    # 52 words at the user's typing speed, a tenth of the human time: the advisory's lead.
    assert user.typing_s(52) == pytest.approx(52 / user.typing_wpm * 6.0)
    assert user.reading_s(0) == 0


def test_the_miss_rate_drops_that_share_of_advisories() -> None:
    user = HumanTiming(advisory_miss_rate=0.25).user(3)
    assert sum(user.advises() for _ in range(4000)) / 4000 == pytest.approx(0.75, abs=0.03)
    assert all(HumanTiming().user(3).advises() for _ in range(100))


def test_answer_length_follows_the_original_within_bounds() -> None:
    assert answer_tokens(Turn("q", 100), cap=64) == 64
    assert answer_tokens(Turn("q", 20), cap=64) == 26
    assert answer_tokens(Turn("q", 0), cap=64) == 16
    assert answer_tokens(Turn("q", 0), cap=8) == 8  # the cap wins over the floor


def _record(
    session: str, turn: int, node: str, *, prompt: int, cached: int, out: int = 10, e2e: float = 1.0, ok: bool = True
) -> RequestRecord:
    return RequestRecord(
        0, session, turn, 0.0, True, 0.0, node, ok, "" if ok else "boom", 0.1, e2e, prompt, cached, out
    )


def test_summaries_count_work_balance_and_kv_readiness() -> None:
    records = [
        _record("s", 0, "a", prompt=100, cached=0, out=50, e2e=2.0),
        _record("s", 1, "b", prompt=200, cached=160, e2e=1.0),  # 160 >= 0.9 * 150 - 32: ready
        _record("s", 2, "b", prompt=300, cached=32, e2e=1.0),  # far from its 210-token history
        _record("t", 0, "a", prompt=10, cached=0, ok=False, e2e=3.0),
    ]
    summary = summarize(records, ["a", "b", "c"])
    assert (summary["completed"], summary["errors"]) == (3, 1)
    assert summary["busy_s_by_node"] == {"a": 5.0, "b": 2.0, "c": 0.0}
    assert summary["max_over_mean_load"] == pytest.approx(5.0 / (7.0 / 3))
    assert (summary["prefill_tokens_computed"], summary["prefill_tokens_total"]) == (100 + 40 + 268, 600)
    assert summary["prefill_tokens_new"] == 100 + (200 - 150) + (300 - 210)  # first prompt, then new messages
    assert (summary["resumed_turns"], summary["kv_ready_at_arrival_frac"]) == (2, 0.5)
    assert summary["requests_by_node"] == {"a": 1, "b": 2, "c": 0}


def test_summaries_tell_the_schedulers_share_of_the_wait() -> None:
    records = [_record("s", turn, "a", prompt=10, cached=0) for turn in range(3)]
    for record, (reason, routed_ms) in zip(
        records, [("least_load", 1.0), ("advised", 2.0), ("advised", 900.0)], strict=True
    ):
        record.route, record.routed_ms = reason, routed_ms
    summary = summarize(records, ["a"])
    assert summary["routes"] == {"advised": 2, "least_load": 1}
    assert summary["routed_ms_p50"] == 2.0 and summary["routed_ms_p95"] > 800.0


def test_targets_compare_symphony_with_the_baselines() -> None:
    symphony = {
        "errors": 0,
        "prefill_tokens_computed": 5,
        "prefill_tokens_total": 100,
        "ttft_ms_p95": 100.0,
        "max_over_mean_load": 1.1,
    }
    result = {
        "policies": {
            "symphony": symphony,
            "recompute": {"ttft_ms_p95": 150.0},
            "sticky": {"ttft_ms_p95": 120.0, "max_over_mean_load": 1.5},
        }
    }
    assert targets(result) == {
        "symphony_errors_zero": True,
        "symphony_prefill_computed_le_0.1": True,
        "symphony_ttft_p95_le_half_recompute": False,
        "symphony_ttft_p95_le_sticky": True,
        "symphony_load_balance_le_sticky": True,
    }


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("route;dur=12.5", 12.5),
        ('db;dur=3, route;desc="routing";dur=0.4', 0.4),
        ("route", 0.0),
        ("route;dur=fast", 0.0),
        ("", 0.0),
        ("other;dur=9", 0.0),
    ],
)
def test_server_timing_durations_are_read_by_name(header: str, expected: float) -> None:
    assert server_timing_ms(header, "route") == expected

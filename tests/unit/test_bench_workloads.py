"""`bench cluster`'s workloads without engines: the skewed users, the shared-prefix groups, the live
Mooncake mapping, what KV existed at each request's arrival, and the load generators themselves on
a fake OpenAI endpoint (advisory leads, idle compression), with a virtual clock for the users."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

import httpx
import pytest

from eval.cluster_summary import summarize
from eval.loadgen import LoadGenerator, LoadSettings, OpenLoopGenerator
from eval.open_loop import (
    OpenRequest,
    SharedPrefixSettings,
    TraceReplaySettings,
    existed_tokens,
    reusable_tokens,
    shared_prefix_requests,
    trace_requests,
)
from eval.skewed import SkewSettings, skewed_plans, turn_tokens
from eval.traces import TraceRequest, load_mooncake, mooncake_prompt
from eval.workloads import SHAREGPT_SAMPLE, Conversation, HumanTiming, Turn, load_sharegpt

ANSWER = "two words"


class VirtualClock:
    """Time that passes only when the one simulated user sleeps (the fake endpoint answers at once)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)
        await asyncio.sleep(0)


def _fake_endpoint(seen: list[dict[str, Any]]) -> httpx.AsyncClient:
    """An OpenAI-compatible endpoint answering every chat with ANSWER and every completion with one
    token, streamed with usage: 40 prompt tokens per chat message (32 cached), or the token ids."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        seen.append({"path": request.url.path, "session": request.headers.get("x-session-id"), **body})
        if request.url.path.endswith("/advisories"):
            return httpx.Response(200, json={})
        if request.url.path.endswith("/chat/completions"):
            prompt = 40 * len(body["messages"])
            delta: dict[str, Any] = {"delta": {"content": ANSWER}}
        else:
            prompt = len(body["prompt"])
            delta = {"text": "x"}
        chunks = [
            {"id": "c", "object": "chunk", "created": 0, "model": "m", "choices": [{"index": 0, **delta}]},
            {
                "id": "c",
                "object": "chunk",
                "created": 0,
                "model": "m",
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": 2,
                    "total_tokens": prompt + 2,
                    "prompt_tokens_details": {"cached_tokens": min(32, prompt)},
                },
            },
        ]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        headers = {"content-type": "text/event-stream", "x-symphony-node": "node-0"}
        return httpx.Response(200, headers=headers, content=sse.encode())

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


CONVERSATION = Conversation("c", (Turn("one two three four five six seven eight nine ten", 2), Turn("again " * 26, 2)))


def _replay(timing: HumanTiming, seen: list[dict[str, Any]], duration_s: float = 60.0) -> list[Any]:
    clock = VirtualClock()
    generator = LoadGenerator(
        "http://fake",
        "m",
        [CONVERSATION],
        timing,
        LoadSettings(users=1, duration_s=duration_s),
        http_client=_fake_endpoint(seen),
        clock=clock,
        sleep=clock.sleep,
    )
    return asyncio.run(generator.run())


def test_advisory_leads_are_the_typing_time_and_compress_with_the_time_scale() -> None:
    timing = HumanTiming(time_scale=0.05)
    user = timing.user(7 * 1_000)  # LoadSettings' seed 7, user 0
    records = _replay(timing, [])
    assert [r.turn for r in records[:4]] == [0, 1, 0, 1]  # the conversation again, as a new session
    typing = [user.typing_s(10), user.typing_s(26)]
    assert [r.advisory_lead_s for r in records[:2]] == pytest.approx(typing)
    assert typing[0] == pytest.approx(10 / user.typing_wpm * 60 * 0.05)  # 10 words: ~0.6 s, not ~12 s
    # Between two turns: reading the answer (compressed too), then typing.
    gap = records[1].sent_at_s - records[0].sent_at_s
    assert gap == pytest.approx(user.reading_s(len(ANSWER.split())) + typing[1])
    summary = summarize(records, ["node-0"])
    leads_ms = sorted(r.advisory_lead_s * 1000 for r in records)
    assert summary["advisory_leads"] == len(records)
    assert summary["advisory_lead_ms_p50"] == pytest.approx(statistics.median(leads_ms))
    assert summary["advisory_lead_ms_p10"] <= summary["advisory_lead_ms_p50"] <= summary["advisory_lead_ms_p90"]


def test_a_typing_time_scale_of_one_compresses_only_the_idle_time() -> None:
    timing = HumanTiming(time_scale=0.05, typing_time_scale=1.0)
    user = timing.user(7 * 1_000)
    records = _replay(timing, [], duration_s=600.0)
    human = [10 / user.typing_wpm * 60, 26 / user.typing_wpm * 60]  # seconds at human speed
    assert [r.advisory_lead_s for r in records[:2]] == pytest.approx(human)
    assert human[0] > 5  # a human-scale lead
    reading = len(ANSWER.split()) / user.reading_wpm * 60 * 0.05  # the idle part stays compressed
    assert records[1].sent_at_s - records[0].sent_at_s == pytest.approx(reading + human[1])


def test_missed_advisories_have_no_lead_and_do_not_count() -> None:
    records = _replay(HumanTiming(time_scale=0.05, advisory_miss_rate=1.0), [])
    assert records and not any(r.advised for r in records)
    summary = summarize(records, ["node-0"])
    assert summary["advisory_leads"] == 0 and math.isnan(summary["advisory_lead_ms_p50"])


def test_a_chat_turn_found_its_previous_turn_as_existing_kv() -> None:
    seen: list[dict[str, Any]] = []
    records = _replay(HumanTiming(time_scale=0.05), seen)
    first, second = records[:2]
    # Turn 0: nothing existed. Turn 1 (3 messages, 120 tokens): turn 0's 40 prompt tokens and all but
    # the last of its 2 answer tokens existed: 41 tokens.
    assert (first.existed_tokens, second.existed_tokens) == (0, 41)
    summary = summarize(records, ["node-0"])
    assert summary["prefix_tokens_existed"] == sum(r.existed_tokens for r in records)
    # The fake caches 32 tokens of every prompt: 32 of each 41 that existed, and 32 that did not.
    resumed = sum(r.existed_tokens > 0 for r in records)
    assert summary["prefix_tokens_cached"] == 32 * resumed and summary["prefix_hit_frac"] == pytest.approx(32 / 41)
    assert summary["prefix_cached_beyond_existed_tokens"] == 32 * sum(r.existed_tokens == 0 for r in records)
    cold = [r for r in records if r.existed_tokens == 0]
    assert summary["cold_requests"] == len(cold) == len(records) - resumed > 0
    reusable = sorted(r.ttft_s * 1000 for r in records if r.existed_tokens > 0)
    assert reusable[0] <= summary["ttft_ms_p95_reusable"] <= reusable[-1]
    assert {s["session_id"] for s in seen if s["path"].endswith("/advisories")} == {r.session for r in records}


def test_reusable_kv_is_never_the_last_prompt_token() -> None:
    assert reusable_tokens(100, 1000) == 100
    assert reusable_tokens(1000, 97) == 96  # the whole prompt existed: all but its last token
    assert reusable_tokens(0, 50) == 0 and reusable_tokens(-5, 50) == 0


def test_existing_kv_is_what_earlier_requests_had_prefilled_when_a_request_was_sent() -> None:
    prefix = list(range(100, 160))
    prompts = [
        prefix + [1] * 40,
        prefix + [2] * 40,
        prefix + [1, 1, 3] + [3] * 37,
        prefix[:40] + [4] * 40,
        prefix + [5] * 40,
        [7] * 10,
    ]
    sent = [0.0, 0.5, 2.0, 3.0, 4.0, 5.0]
    ready = [1.0, None, 2.5, 3.5, 4.5, 5.5]  # request 1 failed: it left no KV
    assert existed_tokens(prompts, sent, ready) == [
        0,  # the first
        0,  # sent before request 0's prefill was done
        62,  # request 0's prefix and its next two tokens
        40,  # only its first 40 tokens are the prefix
        60,  # the prefix, whichever earlier request carried it
        0,  # nothing in common
    ]
    assert existed_tokens([prefix, prefix], [0.0, 1.0], [0.5, 1.5]) == [0, 59]  # never the last token


def test_skewed_users_are_a_few_fast_long_sessions_among_short_slow_ones() -> None:
    conversations = load_sharegpt(SHAREGPT_SAMPLE)
    settings = SkewSettings(heavy_share=0.25, heavy_pace=0.25, heavy_history_tokens=4096, light_turns=2)
    plans = skewed_plans(conversations, 16, settings, max_answer_tokens=64, seed=3)
    heavy = [p for p in plans if p.heavy]
    light = [p for p in plans if not p.heavy]
    assert len(heavy) == 4 and len(light) == 12
    assert skewed_plans(conversations, 16, settings, max_answer_tokens=64, seed=3) == plans  # seeded
    assert all(p.pace == 0.25 for p in heavy) and all(p.pace == 1.0 for p in light)
    assert all(len(s.turns) <= 2 for p in light for s in p.sessions)
    for plan in heavy:
        for session in plan.sessions:
            tokens = sum(turn_tokens(t, 64) for t in session.turns)
            assert tokens <= 4096 or len(session.turns) == 1
    heavy_turns = statistics.fmean(len(s.turns) for p in heavy for s in p.sessions)
    light_turns = statistics.fmean(len(s.turns) for p in light for s in p.sessions)
    assert heavy_turns > 4 * light_turns
    # Heavy users' own conversations, every turn in order, chained: nothing lost or reordered.
    user = plans.index(heavy[0])
    own = [t for i in range(user, len(conversations), 16) for t in conversations[i].turns]
    assert [t for s in heavy[0].sessions for t in s.turns] == own
    # A heavy user's think time is heavy_pace of what it would be at the light pace.
    timing = HumanTiming(time_scale=0.05)
    assert timing.user(5, 0.25).reading_s(100) == pytest.approx(0.25 * timing.user(5).reading_s(100))
    assert timing.user(5, 0.25).typing_s(100) == pytest.approx(0.25 * timing.user(5).typing_s(100))
    assert len([p for p in skewed_plans(conversations, 3, settings, max_answer_tokens=64, seed=0) if p.heavy]) == 1


def test_shared_prefix_groups_share_exactly_their_prefix_and_arrive_as_poisson() -> None:
    settings = SharedPrefixSettings(groups=16, prefix_tokens=(1500, 2000), question_tokens=(100, 200), rate_per_s=1.0)
    requests, info = shared_prefix_requests(settings, duration_s=2000, max_tokens=32, seed=11)
    assert len(info["prefix_tokens"]) == 16 and all(1500 <= n <= 2000 for n in info["prefix_tokens"])
    assert info["requests"] == len(requests) and info["rate_per_s"] == pytest.approx(len(requests) / 2000)
    assert len(requests) == pytest.approx(2000, rel=0.05)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(requests)]
    assert statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.1)  # exponential gaps
    assert all(r.arrival_s < 2000 and r.max_tokens == 32 and r.turn == 0 for r in requests)
    assert len({r.session for r in requests}) == len(requests)  # each a session of its own
    per_group = [sum(r.group == g for r in requests) for g in range(16)]
    assert min(per_group) > 80  # many sessions per group
    prefix = {g: info["prefix_tokens"][g] for g in range(16)}
    for r in requests:
        assert 100 <= len(r.prompt) - prefix[r.group] <= 200
    a, b = [r for r in requests if r.group == 3][:2]
    assert a.prompt[: prefix[3]] == b.prompt[: prefix[3]] and a.prompt[prefix[3]] != b.prompt[prefix[3]]
    other = next(r for r in requests if r.group == 4)
    assert other.prompt[0] != a.prompt[0]
    assert shared_prefix_requests(settings, duration_s=2000, max_tokens=32, seed=11)[0] == requests
    with pytest.raises(ValueError, match="prefix_tokens"):
        SharedPrefixSettings(prefix_tokens=(2000, 1500))


def _trace() -> list[TraceRequest]:
    return [
        TraceRequest(0.0, 1500, 40, (1, 2, 3)),
        TraceRequest(2000.0, 1400, 300, (1, 2, 4)),  # the next turn of the first: shares blocks 1 and 2
        TraceRequest(4000.0, 600, 5, (7, 8)),
        TraceRequest(60_000.0, 512 * 6, 5, (9, 10, 11, 12, 13, 14)),
    ]


def test_a_mooncake_trace_maps_hash_ids_to_shared_prefixes_on_a_scaled_clock() -> None:
    settings = TraceReplaySettings(block_tokens=64, time_scale=0.5, rate_per_s=100.0, max_prompt_tokens=300)
    requests, info = trace_requests(_trace(), settings, duration_s=10.0, max_tokens=64, seed=1)
    assert info["sessions_fraction"] == 1.0  # asked for more than the trace has: every session
    assert [r.arrival_s for r in requests] == [0.0, 1.0, 2.0]  # the 4th arrives at 30 s, past the duration
    first, second, third = requests
    assert (first.turn, second.session, second.turn) == (0, first.session, 1) and third.session != first.session
    assert len(first.prompt) == math.ceil(1500 * 64 / 512) and len(second.prompt) == math.ceil(1400 * 64 / 512)
    assert first.prompt[:128] == second.prompt[:128] and first.prompt[128:] != second.prompt[128:]
    assert first.prompt[:64] == tuple(mooncake_prompt(TraceRequest(0, 64, 1, (1,)), 64))  # block 1, anywhere
    assert (first.max_tokens, second.max_tokens, third.max_tokens) == (40, 64, 5)
    cut, _ = trace_requests(_trace(), settings, duration_s=100.0, max_tokens=64, seed=1)
    assert len(cut[3].prompt) == 300 and _["prompts_cut"] == 1
    assert existed_tokens([r.prompt for r in requests], [0.0, 1.0, 2.0], [0.5, 1.5, 2.5]) == [0, 128, 0]


def test_sessions_are_sampled_to_the_rate_asked(tmp_path: Path) -> None:
    trace = [TraceRequest(1000.0 * i, 600, 5, (10_000 + i, 20_000 + i)) for i in range(400)]  # 1/s, 400 sessions
    settings = TraceReplaySettings(block_tokens=64, time_scale=1.0, rate_per_s=0.25)
    requests, info = trace_requests(trace, settings, duration_s=400.0, max_tokens=8, seed=2)
    assert info["sessions_fraction"] == pytest.approx(0.25 * 399 / 400)
    assert len(requests) == pytest.approx(100, abs=25) and info["rate_per_s"] == pytest.approx(len(requests) / 400)
    again, _ = trace_requests(trace, settings, duration_s=400.0, max_tokens=8, seed=2)
    assert again == requests
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": r.arrival_ms, "input_length": 600, "output_length": 5, "hash_ids": list(r.hash_ids)}
        for r in trace
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows))
    assert trace_requests(load_mooncake(path), settings, duration_s=400.0, max_tokens=8, seed=2)[0] == requests


def test_the_open_loop_generator_sends_token_ids_and_accounts_for_existing_kv() -> None:
    prefix = tuple(range(1000, 1064))
    requests = [
        OpenRequest(0.0, "g0-q0", 0, prefix + (1,) * 10, 4, 0),
        OpenRequest(0.05, "g0-q1", 0, prefix + (2,) * 10, 4, 0),
        OpenRequest(0.1, "g1-q2", 0, tuple(range(5000, 5074)), 4, 1),
    ]
    seen: list[dict[str, Any]] = []
    generator = OpenLoopGenerator(
        "http://fake", "m", requests, LoadSettings(users=1, duration_s=1.0), http_client=_fake_endpoint(seen)
    )
    records = asyncio.run(generator.run())
    assert [r.session for r in records] == ["open-g0-q0", "open-g0-q1", "open-g1-q2"]
    assert all(r.ok and r.prompt_tokens == 74 and r.node == "node-0" for r in records)
    sent = sorted((s for s in seen if s["path"].endswith("/completions")), key=lambda s: s["session"])
    assert [tuple(s["prompt"]) for s in sent] == [r.prompt for r in requests]
    assert all(s["ignore_eos"] and s["max_tokens"] == 4 and s["stream"] for s in sent)
    assert [r.sent_at_s >= q.arrival_s for r, q in zip(records, requests, strict=True)] == [True] * 3
    # Whatever the timing was, the accounting is the rule applied to what happened.
    expected = existed_tokens(
        [q.prompt for q in requests], [r.sent_at_s for r in records], [r.sent_at_s + r.ttft_s for r in records]
    )
    assert [r.existed_tokens for r in records] == expected and records[2].existed_tokens == 0

"""The fault suite's checker and crash schedule (eval.faults): pure judgements on hand-made records."""

from __future__ import annotations

import math

import pytest

from eval.faults import CRASH_KINDS
from eval.faults.checker import (
    Answer,
    RequestOutcome,
    Resources,
    check_requests,
    divergence,
    fd_leaks,
    fds_settled,
    judge_answer,
    leaks,
    lost_sessions,
    other_leaks,
    percentile,
    recovery_summary,
    well_formed_error,
)
from eval.faults.crashes import MIN_SLOW_S, SLOW_FACTOR, recovery_ms, schedule, slow_bound_s, unavailable


def _ok(session: str, tokens: tuple[str, ...], elapsed_s: float = 1.0, started_s: float = 0.0) -> RequestOutcome:
    return RequestOutcome("s", "t", session, started_s, elapsed_s, 200, "ok", [], Answer(tokens), "node-0")


def _failed(kind: str, status: int = 0, started_s: float = 0.0) -> RequestOutcome:
    return RequestOutcome("s", "t", "x", started_s, 0.5, status, kind)


def test_well_formed_errors_are_openai_style_bodies_with_an_error_status() -> None:
    assert well_formed_error(503, {"error": {"message": "no node", "type": "service_unavailable"}})
    assert not well_formed_error(200, {"error": {"message": "m", "type": "t"}})
    assert not well_formed_error(500, {"detail": "Internal Server Error"})
    assert not well_formed_error(400, {"error": {"message": "m"}})
    assert not well_formed_error(400, "plain text")


def test_divergence_is_the_first_differing_position_or_the_shorter_end() -> None:
    assert divergence(["a", "b"], ["a", "b"]) is None
    assert divergence(["a", "x", "c"], ["a", "b", "c"]) == 1
    assert divergence(["a"], ["a", "b"]) == 1


def test_a_divergence_at_a_near_tie_is_numerics_elsewhere_it_is_wrong() -> None:
    reference = Answer(("a", "b", "c"), (3.0, 0.01, 2.0))
    assert judge_answer(Answer(("a", "b", "c")), reference) == "same"
    assert judge_answer(Answer(("a", "z", "q")), reference) == "near_tie"
    assert judge_answer(Answer(("z", "b", "c")), reference) == "wrong"
    # Longer than the reference: the reference ended (EOS) with nothing to tie with.
    assert judge_answer(Answer(("a", "b", "c", "d")), reference) == "wrong"


def test_check_requests_counts_kinds_bounds_and_outputs() -> None:
    outcomes = [
        _ok("s1", ("a", "b")),
        _ok("s2", ("a", "x")),  # wrong: the reference was sure of "b"
        _ok("s3", ("a", "b"), elapsed_s=200.0),  # right, but over the bound
        _failed("503:no_node", status=503),
        _failed("malformed", status=500),
        _failed("connect"),
    ]
    sure = Answer(("a", "b"), (5.0, 5.0))
    report = check_requests(outcomes, [sure, sure, sure, None, None, None], bound_s=120.0)
    assert report["requests"] == 6 and report["ok"] == 3
    assert report["errors_by_kind"] == {"503:no_node": 1, "connect": 1, "malformed": 1}
    assert report["server_5xx"] == 2 and report["malformed"] == 1
    assert report["over_bound"] == 1
    assert report["checked_outputs"] == 3 and report["wrong_outputs"] == 1 and report["wrong_sessions"] == ["s2"]
    with pytest.raises(ValueError):
        check_requests(outcomes, [sure], bound_s=1.0)


def test_an_answer_without_a_reference_is_unchecked_not_right() -> None:
    report = check_requests([_ok("s", ("a",))], [None], bound_s=10.0)
    assert report["unchecked_outputs"] == 1 and report["checked_outputs"] == 0


def test_leaks_name_each_resource_that_grew_past_its_bound() -> None:
    before = Resources(fds=100, rss_bytes=1000, shm_files=4, ssd_segments=3, ssd_bytes_max=10, busy_gauges=0)
    assert leaks(before, before, ssd_bytes_limit=10) == []
    after = Resources(fds=200, rss_bytes=1600, shm_files=5, ssd_segments=9, ssd_bytes_max=11, busy_gauges=1)
    found = leaks(before, after, ssd_bytes_limit=10)
    assert len(found) == 5 and any("fds" in f for f in found) and any("gauges" in f for f in found)


def test_a_process_that_was_not_restarted_is_held_to_its_own_fd_bound() -> None:
    def at(*processes: tuple[str, int, int]) -> Resources:
        return Resources(1000, 1000, 4, 3, 10, 0, 0, processes=processes)

    before = at(("scheduler-0", 11, 30), ("node-0", 12, 400))
    assert leaks(before, at(("scheduler-0", 11, 60), ("node-0", 12, 400)), 10) == []  # within 1.5x + 16
    grew = leaks(before, at(("scheduler-0", 11, 200), ("node-0", 12, 400)), 10)
    assert grew == ["scheduler-0 (pid 11) went from 30 to 200 open fds"]  # the sum (1000) did not grow
    assert leaks(before, at(("scheduler-0", 99, 200), ("node-0", 12, 400)), 10) == []  # restarted: a new process


def test_a_session_is_lost_when_fewer_of_its_ssd_blocks_are_left() -> None:
    assert lost_sessions({"a/1": 3, "a/2": 2, "a/3": 0}, {"a/1": 3, "a/2": 1}) == ["a/2"]
    assert lost_sessions({"a/1": 3}, {}) == ["a/1"]
    assert lost_sessions({"a/1": 3}, {"a/1": 5}) == []


def test_percentiles_are_nearest_rank() -> None:
    assert percentile([], 99) is None
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0
    assert percentile(list(map(float, range(1, 101))), 99) == 99.0
    assert recovery_summary([10.0, 30.0])["recovery_ms_max"] == 30.0


def test_recovery_is_the_latest_end_of_a_failed_or_slow_probe_after_the_fault() -> None:
    probes = [
        _failed("connect", started_s=9.0),  # before the fault: not its doing
        _ok("p", ("OK",), started_s=10.0, elapsed_s=0.2),
        _failed("broken", started_s=10.3),  # ends at 10.8
        _ok("p", ("OK",), started_s=10.5, elapsed_s=0.2),
    ]
    assert recovery_ms(10.0, probes, slow_s=1.0) == pytest.approx(800.0)
    assert recovery_ms(10.0, probes[:2], slow_s=1.0) == 0.0
    # A probe that hung and then succeeded found no service either: it counts until it ended.
    hung = [_ok("p", ("OK",), started_s=10.05, elapsed_s=30.0)]
    assert unavailable(hung[0], slow_s=1.0) and recovery_ms(10.0, hung, slow_s=1.0) == pytest.approx(30_050.0)
    assert recovery_ms(10.0, hung, slow_s=60.0) == 0.0


def test_the_slow_bound_is_four_times_the_baseline_p99_and_at_least_a_second() -> None:
    assert SLOW_FACTOR == 4.0
    assert slow_bound_s([]) == MIN_SLOW_S
    assert slow_bound_s([_ok("p", ("OK",), elapsed_s=0.1)] * 10) == MIN_SLOW_S
    assert slow_bound_s([_ok("p", ("OK",), elapsed_s=t) for t in (0.5, 0.6, 2.0)]) == pytest.approx(8.0)
    assert slow_bound_s([_failed("connect")]) == MIN_SLOW_S  # failures say nothing of the speed


def test_fds_settle_after_clean_looks_in_a_row_and_a_leak_that_stays_is_reported() -> None:
    grew = ["scheduler-1 (pid 7) went from 26 to 60 open fds"]
    assert fds_settled([[]]) == (False, [])  # one look: not yet settled, nothing to report
    assert fds_settled([[], []]) == (True, [])
    assert fds_settled([grew]) == (False, grew)
    assert fds_settled([grew, []]) == (False, grew)  # one clean look is noise
    assert fds_settled([grew, [], []]) == (True, [])  # pooled connections that closed
    later = ["scheduler-1 (pid 7) went from 26 to 58 open fds"]
    assert fds_settled([grew, [], later, []]) == (False, later)  # the latest finding
    assert fds_settled([grew] * 15) == (False, grew)  # a leak stays


def test_leaks_split_into_fds_and_the_rest() -> None:
    before = Resources(100, 1000, 2, 3, 4, 0.0, processes=(("node-0", 5, 50),))
    after = Resources(200, 2000, 3, 3, 4, 1.0, orphans=1, processes=(("node-0", 5, 150),))
    assert fd_leaks(before, after) + other_leaks(before, after, 10) == leaks(before, after, 10)
    assert len(fd_leaks(before, after)) == 2 and all("fds" in found for found in fd_leaks(before, after))
    assert len(other_leaks(before, after, 10)) == 4 and not any("fds" in f for f in other_leaks(before, after, 10))


def test_a_schedule_is_the_seed_s_every_kind_once_per_round() -> None:
    first = schedule(7, nodes=2, replicas=2, rounds=3)
    assert first == schedule(7, nodes=2, replicas=2, rounds=3)
    assert first != schedule(8, nodes=2, replicas=2, rounds=3)
    for r in range(3):
        assert sorted(f.kind for f in first[r * len(CRASH_KINDS) : (r + 1) * len(CRASH_KINDS)]) == sorted(CRASH_KINDS)
    for fault in first:
        assert (fault.hold_s > 0) == fault.kind.endswith("_stop") and fault.hold_s <= 3.0
        assert 0 <= fault.target < 2 and (fault.target == 0 or not fault.kind.startswith("etcd"))
    assert not math.isnan(first[0].hold_s)

"""The scheduler's bounded tables and gates: sessions, priority tiers, the selective-push queue, auth."""

from __future__ import annotations

import asyncio

import pytest

from scheduler.auth import DEFAULT_TENANT, Authenticator, bearer
from scheduler.errors import ApiError
from scheduler.priorities import PriorityTable
from scheduler.push_queue import PushQueue, QueueFull
from scheduler.sessions import SessionTable

A, B = b"a" * 32, b"b" * 32  # two model fingerprints


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- sessions ---------------------------------------------------------------------------------------
def test_a_served_turn_records_where_the_sessions_kv_is() -> None:
    table = SessionTable(10, ttl_s=60)
    table.served(("t", "s"), "a", 100, fingerprint=A)
    table.served(("t", "s"), "b", 300, fingerprint=A)
    entry = table.get(("t", "s"))
    assert entry is not None and entry.last_node == "b"
    assert entry.kv_tokens == {"a": 100, "b": 300} and entry.history_tokens == 300
    table.moved(("t", "s"), "c", 250, A)  # a move asked for before the 300-token turn
    assert entry.kv_tokens["c"] == 250
    table.forget_node("a")
    assert "a" not in entry.kv_tokens
    assert table.get(("other", "s")) is None


def test_a_turn_the_node_never_started_is_undone() -> None:
    table = SessionTable(10, ttl_s=60)
    table.served(("t", "s"), "a", 100, fingerprint=A, high=True)
    undo = table.served(("t", "s"), "b", 300, fingerprint=A)
    undo()
    entry = table.get(("t", "s"))
    assert entry is not None and (entry.last_node, entry.high, entry.history_tokens) == ("a", True, 100)
    assert entry.kv_tokens == {"a": 100} and table.high_sessions == {"a": 1}
    # Undoing a turn of an entry evicted since changes nothing.
    small = SessionTable(1, ttl_s=60)
    undo = small.served(("t", "s"), "a", 5, fingerprint=A)
    small.served(("t", "other"), "a", 7, fingerprint=A)
    undo()
    assert small.get(("t", "s")) is None and len(small) == 1


def test_an_entry_records_its_model_and_forgets_copies_of_another() -> None:
    """A session that switches models keeps no copy of the old model's KV as its history: a node of
    the new model must never be told to pull it. Undoing the switching turn brings the copies back."""
    table = SessionTable(10, ttl_s=60)
    table.served(("t", "s"), "a", 100, fingerprint=A, model="smol")
    table.served(("t", "s"), "b", 200, fingerprint=A, model="smol")
    undo = table.served(("t", "s"), "c", 300, fingerprint=B, model="smol-tuned")
    entry = table.get(("t", "s"))
    assert entry is not None and (entry.model, entry.fingerprint, entry.kv_tokens) == ("smol-tuned", B, {"c": 300})
    table.moved(("t", "s"), "a", 200, A)  # a move of the old model's KV, finishing late: not this model's
    assert entry.kv_tokens == {"c": 300}
    undo()
    assert (entry.model, entry.fingerprint, entry.kv_tokens) == ("smol", A, {"a": 100, "b": 200})
    table.served(("t", "s"), "c", 300, fingerprint=B, model="smol-tuned")
    undo = table.served(("t", "s"), "d", 300, fingerprint=B, model="smol-tuned")
    undo()  # a later turn of the new model stays: the session does not go back to the old one
    assert (entry.fingerprint, entry.kv_tokens) == (B, {"c": 300})


def test_undoes_in_any_order_take_back_only_their_own_turn() -> None:
    table = SessionTable(10, ttl_s=60)
    undo_first = table.served(("t", "s"), "n1", 50, fingerprint=A)
    table.served(("t", "s"), "n2", 90, fingerprint=B)
    undo_first()  # the first turn failed after the second (of another model) went out
    entry = table.get(("t", "s"))
    assert entry is not None
    assert (entry.last_node, entry.fingerprint, entry.kv_tokens) == ("n2", B, {"n2": 90})  # no A copy under B
    # Same model, two nodes, undone out of order: each node's count goes back on its own.
    table.served(("t", "m"), "n1", 100, fingerprint=A)
    undo_n2 = table.served(("t", "m"), "n2", 200, fingerprint=A)
    undo_n1 = table.served(("t", "m"), "n1", 300, fingerprint=A)
    undo_n2()
    other = table.get(("t", "m"))
    assert other is not None and other.kv_tokens == {"n1": 300} and other.last_node == "n1"
    undo_n1()
    assert other.kv_tokens == {"n1": 100}


def test_sessions_are_bounded_by_count_and_age() -> None:
    clock = Clock()
    table = SessionTable(3, ttl_s=10, clock=clock)
    for i in range(5):
        table.served(("t", f"s{i}"), "a", 1, fingerprint=A)
    assert len(table) == 3 and table.get(("t", "s0")) is None
    clock.now = 11
    table.served(("t", "fresh"), "a", 1, fingerprint=A)
    table.purge()
    assert len(table) == 1 and table.get(("t", "fresh")) is not None


def test_high_priority_sessions_are_counted_per_node() -> None:
    table = SessionTable(2, ttl_s=60)
    table.served(("t", "h1"), "a", 1, fingerprint=A, high=True)
    table.served(("t", "h2"), "a", 1, fingerprint=A, high=True)
    table.served(("t", "h1"), "b", 1, fingerprint=A, high=True)
    assert table.high_sessions == {"a": 1, "b": 1}
    table.served(("t", "n"), "a", 1, fingerprint=A)  # evicts h2 (least recently used)
    assert table.high_sessions == {"b": 1}


# -- priorities -------------------------------------------------------------------------------------
def test_a_sessions_tier_wins_over_its_tenants_and_normal_clears_it() -> None:
    table = PriorityTable(10)
    assert table.of("t", "s") == "normal"
    table.set("t", "low")
    table.set("t", "high", "vip")
    assert (table.of("t", "s"), table.of("t", "vip"), table.of("u", "vip")) == ("low", "high", "normal")
    table.set("t", "normal", "vip")
    assert table.of("t", "vip") == "low" and len(table) == 1
    with pytest.raises(ValueError, match="priority must be one of"):
        table.set("t", "urgent")


def test_the_priority_table_is_bounded() -> None:
    table = PriorityTable(2)
    table.set("a", "high")
    table.set("b", "low", "s")
    table.set("a", "low")  # changing an existing entry needs no room
    with pytest.raises(OverflowError):
        table.set("c", "high")


# -- push queue -------------------------------------------------------------------------------------
async def _until_queued(queue: PushQueue, count: int) -> None:
    """Let the waiter tasks run until `count` of them wait (each needs one turn of the loop)."""
    for _ in range(100):
        if len(queue) >= count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{len(queue)} waiters queued, expected {count}")


async def test_the_queue_wakes_higher_tiers_first_and_fifo_within_a_tier() -> None:
    queue = PushQueue(10)
    order: list[str] = []

    async def waiter(name: str, priority: str) -> None:
        assert await queue.wait(priority, 5.0)
        order.append(name)

    tasks = [
        asyncio.create_task(waiter(name, priority))
        for name, priority in [("n1", "normal"), ("l1", "low"), ("h1", "high"), ("n2", "normal")]
    ]
    await _until_queued(queue, 4)
    assert queue.wake(2) == 2
    await asyncio.sleep(0)
    assert queue.wake(5) == 2
    await asyncio.gather(*tasks)
    assert order == ["h1", "n1", "n2", "l1"]


async def test_the_queue_is_bounded_and_waits_end() -> None:
    queue = PushQueue(1)
    waiting = asyncio.create_task(queue.wait("normal", 0.05))
    await _until_queued(queue, 1)
    with pytest.raises(QueueFull):
        await queue.wait("normal", 1.0)
    assert await waiting is False  # timed out
    assert len(queue) == 0


async def test_a_requeued_request_keeps_its_place_even_when_the_queue_is_full() -> None:
    queue = PushQueue(1)
    newcomer = asyncio.create_task(queue.wait("normal", 5.0))
    await _until_queued(queue, 1)
    # A request woken before that found no room again goes back to the head, never a 429.
    requeued = asyncio.create_task(queue.wait("normal", 5.0, front=True))
    await _until_queued(queue, 2)
    queue.wake(1)
    assert await requeued is True
    queue.wake(1)
    assert await newcomer is True


async def test_a_wake_that_lands_as_a_waiter_gives_up_goes_to_the_next() -> None:
    queue = PushQueue(5)
    leaving = asyncio.create_task(queue.wait("normal", 5.0))
    staying = asyncio.create_task(queue.wait("normal", 5.0))
    await _until_queued(queue, 2)
    queue.wake(1)  # wakes `leaving`, whose client hangs up before it runs
    leaving.cancel()
    outcome = (await asyncio.gather(leaving, return_exceptions=True))[0]
    if outcome is True:
        # Python 3.11's wait_for hands a cancelled waiter the result that was already there: the
        # wake was used, not lost. `staying` still waits for the next one.
        assert not staying.done() and len(queue) == 1
        queue.wake(1)
    else:
        assert isinstance(outcome, asyncio.CancelledError)  # 3.12+: the wake passed to `staying`
    assert await asyncio.wait_for(staying, 2.0) is True


async def test_newcomers_wait_behind_held_requests_of_their_tier_or_above() -> None:
    queue = PushQueue(5)
    held = asyncio.create_task(queue.wait("normal", 5.0))
    await _until_queued(queue, 1)
    assert queue.ahead_of("normal") and queue.ahead_of("low") and not queue.ahead_of("high")
    queue.wake(1)
    await held
    assert not queue.ahead_of("low")


async def test_a_requeued_waiter_keeps_its_place_at_the_head() -> None:
    queue = PushQueue(5)
    first = asyncio.create_task(queue.wait("normal", 5.0))
    second = asyncio.create_task(queue.wait("normal", 5.0))
    await _until_queued(queue, 2)
    queue.wake(1)
    assert await first
    again = asyncio.create_task(queue.wait("normal", 5.0, front=True))
    await _until_queued(queue, 2)
    queue.wake(1)
    assert await again
    assert not second.done()
    queue.wake(1)
    assert await second


# -- auth -------------------------------------------------------------------------------------------
def test_without_keys_everyone_is_the_default_tenant() -> None:
    auth = Authenticator([], "")
    assert auth.tenant(None) == DEFAULT_TENANT == auth.tenant("Bearer anything")


def test_keys_name_tenants_and_anything_else_is_refused() -> None:
    auth = Authenticator(["acme:k-acme", "rival:k:with:colons"], "")
    assert auth.tenant("Bearer k-acme") == "acme"
    assert auth.tenant("bearer   k:with:colons ") == "rival"
    for header in (None, "", "Bearer", "Basic k-acme", "Bearer k-acm", "k-acme"):
        with pytest.raises(ApiError) as excinfo:
            auth.tenant(header)
        assert excinfo.value.status == 401


@pytest.mark.parametrize(
    ("token", "header", "status"),
    [
        ("", "Bearer x", 403),  # the admin API is off
        ("s3cret", None, 401),
        ("s3cret", "Bearer wrong", 403),
        ("s3cret", "Bearer s3cre", 403),
    ],
)
def test_admin_calls_need_the_admin_token(token: str, header: str | None, status: int) -> None:
    with pytest.raises(ApiError) as excinfo:
        Authenticator([], token).check_admin(header)
    assert excinfo.value.status == status


def test_the_right_admin_token_passes() -> None:
    Authenticator([], "s3cret").check_admin("Bearer s3cret")
    assert bearer("Bearer  tok ") == "tok" and bearer("Token tok") is None

"""scheduler.control_watch.EntryOrder: a replica applies each control entry's changes in etcd's
order with its own writes, so that every replica ends with etcd's last write."""

from __future__ import annotations

from scheduler.control_watch import EntryOrder
from symphony.control_etcd import TenantEntry
from symphony.control_state import Changed

KEY = b"/symphony/control/scheduler/tenant/acme"
ACME = Changed("acme")
HIGH, LOW = TenantEntry(priority="high"), TenantEntry(priority="low")


def test_an_echo_of_its_own_write_is_not_applied_again() -> None:
    order = EntryOrder(100)
    order.begin(KEY)
    assert order.end(KEY, 11) is None
    assert not order.arrived(KEY, 11, ACME, HIGH)  # after the write ended
    order.begin(KEY)
    assert not order.arrived(KEY, 12, ACME, LOW)  # before it ended: held, then its own revision
    assert order.end(KEY, 12) is None


def test_another_replicas_later_write_waits_for_its_own_then_applies() -> None:
    order = EntryOrder(100)
    order.begin(KEY)
    assert not order.arrived(KEY, 12, ACME, LOW)  # etcd ordered it after this replica's (11)
    assert order.end(KEY, 11) == (ACME, LOW)
    assert not order.arrived(KEY, 11, ACME, HIGH)  # the echo of 11, late: older than what it holds


def test_an_older_change_queued_while_it_writes_is_dropped() -> None:
    order = EntryOrder(100)
    assert order.arrived(KEY, 10, ACME, LOW)  # another replica's, applied
    order.begin(KEY)
    assert not order.arrived(KEY, 10, ACME, LOW)
    assert order.end(KEY, 11) is None  # this replica's write (11) is etcd's last
    assert not order.arrived(KEY, 9, ACME, HIGH)


def test_a_failed_write_lets_what_waited_apply_and_overlapping_writes_wait_for_the_last() -> None:
    order = EntryOrder(100)
    order.begin(KEY)
    assert not order.arrived(KEY, 12, ACME, LOW)
    assert order.end(KEY, 0) == (ACME, LOW)  # nothing written: the other replica's change holds
    order.begin(KEY)
    order.begin(KEY)
    assert not order.arrived(KEY, 20, ACME, HIGH)
    assert order.end(KEY, 14) is None  # one write still under way
    assert order.end(KEY, 15) == (ACME, HIGH)


def test_what_it_remembers_is_bounded() -> None:
    order = EntryOrder(3)
    for i in range(10):
        assert order.arrived(f"k{i}".encode(), 5, ACME, HIGH)
    assert len(order.applied) <= 3

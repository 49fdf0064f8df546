"""Node membership under etcd leases (`symphony.membership`), against a real etcd: a node that
stops renewing (SIGSTOP, as a hung or cut-off node) leaves within its lease's TTL and comes back
when it resumes; one that stops cleanly leaves at once; etcd going away and coming back costs a
registration nothing but retries."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from symphony.etcd_client import EtcdClient, EtcdUnavailable
from symphony.membership import Member, Registration, members
from tests.etcd_support import running_etcd
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "/symphony-test"
TTL_S = 2


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[str]:
    with running_etcd(tmp_path) as (url, _):
        yield url


def _ids(client: EtcdClient) -> list[str]:
    return [member.node_id for member in members(client, PREFIX)]


def test_a_node_registers_and_a_clean_stop_leaves_at_once(etcd: str) -> None:
    client = EtcdClient([etcd])
    registration = Registration(client, PREFIX, Member(node_id="node-0", address="127.0.0.1:50051"), ttl_s=TTL_S)
    registration.start()
    assert members(client, PREFIX) == [registration.member]
    started = time.monotonic()
    registration.stop()
    assert _ids(client) == [] and time.monotonic() - started < TTL_S  # revoked, not expired


def test_a_stopped_node_leaves_within_its_ttl_and_returns_when_it_resumes(etcd: str) -> None:
    """A real process, registered, then SIGSTOPped (renewals stop, as in a hang or a partition)."""
    script = (
        "import signal, sys; from symphony.etcd_client import EtcdClient; "
        "from symphony.membership import Member, Registration; "
        f"r = Registration(EtcdClient([{etcd!r}]), {PREFIX!r}, Member(node_id='node-7', address='h:1'), "
        f"ttl_s={TTL_S}); r.start(); print('registered', flush=True); signal.pause()"
    )
    node = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE
    )
    client = EtcdClient([etcd])
    try:
        assert node.stdout is not None and node.stdout.readline().strip() == b"registered"
        assert _ids(client) == ["node-7"]
        os.kill(node.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_until(lambda: _ids(client) == [], 5 * TTL_S + 10, "the stopped node to leave")
        assert time.monotonic() - stopped >= TTL_S * 0.5  # its lease ran out; nothing removed it early
        os.kill(node.pid, signal.SIGCONT)
        wait_until(lambda: _ids(client) == ["node-7"], 5 * TTL_S, "the resumed node to register again")
    finally:
        node.kill()
        node.wait()


def test_etcd_going_away_costs_retries_and_a_new_registration_when_it_is_back(tmp_path: Path) -> None:
    with running_etcd(tmp_path / "a") as (url, process):
        client = EtcdClient([url], timeout_s=0.5)
        registration = Registration(client, PREFIX, Member(node_id="node-1", address="h:2"), ttl_s=TTL_S)
        registration.start()
        process.send_signal(signal.SIGSTOP)  # etcd hangs: renewals time out
        try:
            wait_until(lambda: registration.failed_renewals >= 2, 10 * TTL_S, "renewals to fail")
        finally:
            process.send_signal(signal.SIGCONT)
        # Back: the lease may have expired meanwhile; either way the node is a member again.
        wait_until(lambda: _ids(client) == ["node-1"], 10 * TTL_S, "the node to be a member again")
        registration.stop()
        assert _ids(client) == []
    with pytest.raises(EtcdUnavailable):
        Registration(EtcdClient([url], timeout_s=0.5), PREFIX, Member(node_id="n", address="h:3")).start()


def test_entries_that_are_not_members_are_skipped_and_bad_settings_refused(etcd: str) -> None:
    client = EtcdClient([etcd])
    client.put(PREFIX.encode() + b"/nodes/junk", b"{not json")
    client.put(PREFIX.encode() + b"/nodes/node-2", Member(node_id="node-2", address="h:4").model_dump_json().encode())
    assert _ids(client) == ["node-2"]
    with pytest.raises(ValueError, match="at least"):
        Registration(client, PREFIX, Member(node_id="n", address="h"), ttl_s=1)
    with pytest.raises(ValueError):
        Member(node_id="a/b", address="h")  # a node id names one key, no more

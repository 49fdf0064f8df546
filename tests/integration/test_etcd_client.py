"""`symphony.etcd_client` against a real etcd (Debian's etcd-server through its JSON gateway):
keys, prefixes, compare-and-swap, leases that expire and leases kept alive, and endpoint failover
with a deadline."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from symphony.etcd_client import EtcdClient, EtcdError, EtcdUnavailable, prefix_end
from tests.etcd_support import running_etcd
from tests.helpers import free_port, wait_until


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as (url, _):
        yield url


@pytest.fixture
def client(etcd: str) -> Iterator[EtcdClient]:
    made = EtcdClient([etcd])
    yield made
    made.delete(b"\0", b"\0")  # every key: each test starts empty
    made.close()


def test_keys_and_prefixes(client: EtcdClient) -> None:
    first = client.put(b"/t/nodes/a", b"1")
    client.put(b"/t/nodes/b", b"\x00\xff binary")
    client.put(b"/t/other", b"3")
    assert client.get(b"/t/nodes/a") is not None and client.get(b"/t/nodes/a").value == b"1"  # type: ignore[union-attr]
    assert client.get(b"/t/missing") is None
    listed = client.get_prefix(b"/t/nodes/")
    assert [(e.key, e.value) for e in listed] == [(b"/t/nodes/a", b"1"), (b"/t/nodes/b", b"\x00\xff binary")]
    assert listed[0].mod_revision == first
    assert len(client.get_prefix(b"/t/", limit=2)) == 2  # bounded
    assert client.delete(b"/t/nodes/", prefix_end(b"/t/nodes/")) == 2
    assert [e.key for e in client.get_prefix(b"/t/")] == [b"/t/other"]


def test_compare_and_swap(client: EtcdClient) -> None:
    assert client.put_if(b"/cas", b"v1", 0)  # created: it did not exist
    assert not client.put_if(b"/cas", b"again", 0)  # exists now
    entry = client.get(b"/cas")
    assert entry is not None
    assert client.put_if(b"/cas", b"v2", entry.mod_revision)
    assert not client.put_if(b"/cas", b"v3", entry.mod_revision)  # a writer got there first
    assert client.get(b"/cas").value == b"v2"  # type: ignore[union-attr]


def test_a_lease_not_kept_alive_takes_its_keys_with_it(client: EtcdClient) -> None:
    lease = client.grant(2)
    client.put(b"/members/gone", b"x", lease=lease)
    assert client.get(b"/members/gone").lease == lease  # type: ignore[union-attr]
    wait_until(lambda: client.get(b"/members/gone") is None, 15, "the lease to expire")
    assert client.keepalive(lease) == 0


def test_a_lease_kept_alive_keeps_its_keys_and_a_revoked_one_drops_them(client: EtcdClient) -> None:
    lease = client.grant(2)
    client.put(b"/members/here", b"x", lease=lease)
    deadline = time.monotonic() + 5  # past the TTL twice over
    while time.monotonic() < deadline:
        assert client.keepalive(lease) > 0
        assert client.get(b"/members/here") is not None
        time.sleep(0.5)  # not a race: time must pass the TTL while the lease is renewed
    client.revoke(lease)
    assert client.get(b"/members/here") is None


def test_failover_to_the_next_endpoint_and_a_deadline_when_none_answers(etcd: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with_dead_first = EtcdClient([dead, etcd], timeout_s=1.0)
    with_dead_first.put(b"/failover", b"ok")
    assert with_dead_first.get(b"/failover").value == b"ok"  # type: ignore[union-attr]
    with_dead_first.delete(b"/failover")
    only_dead = EtcdClient([dead], timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable, match=dead):
        only_dead.get(b"/x")
    assert time.monotonic() - started < 5


def test_an_error_answer_is_an_error(client: EtcdClient) -> None:
    with pytest.raises(EtcdError) as refused:
        client.revoke(123456789)  # no such lease: 404, an answer, not etcd being away
    assert not isinstance(refused.value, EtcdUnavailable)


def test_a_watch_moves_past_an_endpoint_that_connects_but_never_answers(etcd: str) -> None:
    """A hung etcd (it accepts connections, answers nothing) costs a watch one idle period: it goes
    on to the next endpoint, gets the changes from where it asked, and the next watch starts there;
    with every endpoint hung, the watch is unavailable (the caller backs off), not idle."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)  # connections complete in the backlog; nothing ever reads them
    hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    try:
        client = EtcdClient([hung_url, etcd], timeout_s=0.5)
        revision = client.put(b"/w/a", b"1")
        client.delete(b"/w/a")
        events = list(client.watch(b"/w/", revision, idle_timeout_s=0.5))
        assert [(e.key, e.value, e.previous) for e in events] == [(b"/w/a", b"1", None), (b"/w/a", None, b"1")]
        assert events[0].mod_revision == revision
        started = time.monotonic()
        assert list(client.watch(b"/w/", revision + 2, idle_timeout_s=0.5)) == []
        assert time.monotonic() - started < 0.9  # straight to the working endpoint: one idle period
        snapshot, at = client.snapshot(b"/w/", 10)
        assert snapshot == [] and at > revision
        client.close()
        alone = EtcdClient([hung_url], timeout_s=0.5)
        with pytest.raises(EtcdUnavailable, match="began a watch"):
            list(alone.watch(b"/w/", revision, idle_timeout_s=0.5))
        alone.close()
    finally:
        hung.close()

"""Ports picked for private clusters: free, and out of the kernel's ephemeral range, where a port
could be handed to an outgoing connection or a port-0 listener before the cluster binds it."""

from __future__ import annotations

import socket

import pytest

from eval import ports


def test_a_run_of_ports_lies_below_the_ephemeral_range_and_is_free() -> None:
    start = ports.ephemeral_start()
    for _ in range(20):
        base = ports.free_port_run(3)
        assert base >= ports.LOWEST_PORT and base + 2 < start
        assert all(ports._port_free(base + i) for i in range(3))


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        held = taken.getsockname()[1]
        free = ports._kernel_free_port()
        # The picker draws the held port first, then a free one.
        draws = iter([held, free])
        monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(draws))
        monkeypatch.setattr(ports, "ephemeral_start", lambda: 65_000)
        monkeypatch.setattr(ports, "LOWEST_PORT", 1_024)
        assert ports.free_port() == free


def test_without_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.LOWEST_PORT)
    port = ports.free_port()
    assert ports._port_free(port)
    assert port not in ports.DEFAULT_PORTS

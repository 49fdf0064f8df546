"""Free local ports for the private clusters benchmarks start."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_run(count: int) -> int:
    """The first of `count` consecutive ports free now (node i listens on base + i)."""
    for _ in range(100):
        base = free_port()
        if base + count < 65536 and all(_port_free(base + i) for i in range(1, count)):
            return base
    raise RuntimeError(f"no run of {count} free ports found")


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True

"""A single-member etcd on this host, for `symphony up --ha` (and the tests that need one): Debian's
etcd-server (`make etcd` installs it), its client and peer ports on one address, its data in a
directory of the caller's."""

from __future__ import annotations

import shutil
from pathlib import Path

INSTALL_HINT = "`make etcd` installs Debian's etcd-server"


def etcd_binary() -> str:
    """The `etcd` on PATH; FileNotFoundError saying how to get one."""
    binary = shutil.which("etcd")
    if binary is None:
        raise FileNotFoundError(f"etcd is not installed: {INSTALL_HINT}")
    return binary


def etcd_argv(binary: str, data_dir: Path, host: str, client_port: int, name: str = "symphony") -> list[str]:
    """The command line of a one-member etcd serving clients on `host:client_port` (its peer port
    the next), quiet but for warnings."""
    client, peer = f"http://{host}:{client_port}", f"http://{host}:{client_port + 1}"
    return [
        binary,
        "--name",
        name,
        "--data-dir",
        str(data_dir),
        "--listen-client-urls",
        client,
        "--advertise-client-urls",
        client,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        f"{name}={peer}",
        "--log-level",
        "warn",
    ]

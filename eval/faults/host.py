"""What a `symphony bench faults` cluster holds on its host: the figures the checker bounds
(`eval.faults.checker.Resources`), read from /proc, /dev/shm and the nodes' SSD directories."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from symphony.launcher import LocalCluster
from symphony.process import process_tree
from symphony.shm_files import orphaned_shm
from symphony.tenancy import ENGINE_KEY_ENV, engine_key


def host_resources(
    cluster: LocalCluster, started_wall: float
) -> tuple[int, int, int, int, int, int, int, tuple[tuple[str, int, int], ...]]:
    """fds, RSS and anonymous RSS of the cluster's processes (fds per supervised process too), its
    /dev/shm files, SSD files and most bytes, and its orphaned engine processes: those whose
    environment holds this cluster's engine key (an engine and its children) outside every
    leader's process tree."""
    config = cluster.config
    fds = rss = anon = 0
    page = os.sysconf("SC_PAGE_SIZE")
    tree: set[int] = set()
    processes: list[tuple[str, int, int]] = []
    for proc in [*cluster.nodes, *cluster.schedulers]:
        if proc.pid is None:
            continue
        members = process_tree(proc.pid)
        tree.update(members)
        counted = 0
        for pid in members:
            try:
                counted += len(os.listdir(f"/proc/{pid}/fd"))
                rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
                anon += _rss_anon(pid)
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
        processes.append((proc.name, proc.pid, counted))
        fds += counted
    marker = f"{ENGINE_KEY_ENV}={engine_key(config.cluster.secret.encode())}".encode()
    candidates = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) not in tree:
            with contextlib.suppress(OSError):
                if marker in Path(entry.path, "environ").read_bytes().split(b"\0"):
                    candidates.add(int(entry.name))
    # A process started between the two looks is in a tree by now: only the rest are orphans.
    leaders = [p.pid for p in [*cluster.nodes, *cluster.schedulers] if p.pid is not None]
    orphans = len(candidates - {m for leader in leaders for m in process_tree(leader)})
    # This cluster's own shared memory (its stores' arenas and block indexes, named by node and
    # gRPC port), and multiprocessing files made since the bench began that no process holds.
    own = tuple(
        f"symphony-kv-{config.node_id(i)}-{config.node.grpc_port_base + i}" for i in range(config.cluster.nodes)
    )
    shm = sum(1 for name in os.listdir("/dev/shm") if name.startswith(own))
    shm += len(orphaned_shm(started_wall))
    segments, most = 0, 0
    for i in range(config.cluster.nodes):
        sizes = []
        for f in config.kv_ssd_dir(i).rglob("*"):
            with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                if f.is_file():
                    sizes.append(f.stat().st_size)
        segments += len(sizes)
        most = max(most, sum(sizes))
    return fds, rss, anon, shm, segments, most, orphans, tuple(processes)


def _rss_anon(pid: int) -> int:
    """The process's anonymous resident bytes (its /proc status's RssAnon)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024  # kB
    return 0

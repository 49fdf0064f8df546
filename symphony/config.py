"""Configuration: one TOML file, every key overridable by a `SYMPHONY_<SECTION>_<KEY>` env var.

Precedence, lowest first: defaults < TOML file < environment < command-line flags. Every value is
validated once here, so the components can trust what they receive; an error names the key and
where the bad value came from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ENV_PREFIX = "SYMPHONY_"

# The enumerated keys' values; load_config refuses any other and names these.
PolicyName = Literal["symphony", "recompute", "sticky", "round_robin", "least_load", "consistent_hash", "prefix_trie"]
DataPlane = Literal["tcp", "grpc"]
EngineDtype = Literal["bfloat16", "float16", "float32", "auto"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


@dataclass(frozen=True)
class ClusterConfig:
    nodes: int = 2  # node managers (each with one engine) that `symphony up` starts


@dataclass(frozen=True)
class SchedulerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # gRPC addresses of the node managers ("host:port"). Empty: the local cluster's
    # node.host:node.grpc_port_base+i for i < cluster.nodes.
    node_addresses: list[str] = field(default_factory=list)
    policy: PolicyName = "symphony"  # scheduler.policies.POLICIES holds one policy per name
    poll_interval_ms: int = 100  # Status poll period per node
    node_down_after_ms: int = 1000  # no successful Status for this long -> node unroutable
    connect_timeout_s: float = 2.0  # to an engine; a dead engine must fail fast, not hang
    request_timeout_s: float = 600.0  # between bytes from an engine once connected
    max_inflight_requests: int = 1024  # beyond this the scheduler answers 429
    max_body_bytes: int = 4 * 1024 * 1024
    max_session_id_len: int = 128
    advisory_ttl_s: float = 120.0  # an advisory not followed by a request within this is dropped
    max_advisories: int = 100_000  # pending advisories kept (LRU beyond)
    max_expected_arrival_ms: int = 3_600_000  # hints further out than this are rejected
    typing_lead_ms: int = 10_000  # a typing advisory's prefetch deadline: when its request is likely to come
    max_prefetches: int = 256  # KV moves followed at once; beyond, an advisory routes but moves nothing
    # A request routed away from the node holding its session's KV with no advisory moving it there
    # (none came, or its node got a queue) waits at most this long for the KV to be pulled over;
    # 0: never pulls, the engine recomputes the history. On this kind of engine a pull costs tens of
    # ms where recomputing a long history costs seconds.
    route_pull_wait_ms: int = 3000
    route_pull_min_tokens: int = 64  # less history than this elsewhere is recomputed rather than pulled
    max_sessions: int = 100_000  # session table entries, and sticky's pinned sessions (least recently used beyond)
    prefix_trie_max_chars: int = 4_000_000  # prefix_trie's tree of served prompts (~1M tokens of text)
    session_ttl_s: float = 3600.0  # a session unused this long is forgotten
    max_priority_settings: int = 100_000  # tenant and session priority tiers an admin may set
    max_queued_requests: int = 1024  # requests held back by selective pushing; beyond: 429
    queue_timeout_s: float = 60.0  # a held-back request that finds no room by then: 503
    # Tenants' API keys, "tenant:key" each; empty: no authentication, every request is tenant "default".
    api_keys: list[str] = field(default_factory=list)
    admin_token: str = ""  # bearer token of the admin API (/admin/v1/...); empty: the admin API is off


@dataclass(frozen=True)
class NodeConfig:
    host: str = "127.0.0.1"  # bind and advertise address of the node manager and its engine
    grpc_port_base: int = 50051  # node i listens on grpc_port_base + i
    engine_port_base: int = 8100  # node i's engine listens on engine_port_base + i
    engine_scrape_interval_ms: int = 100  # how often the node manager reads the engine's /metrics


@dataclass(frozen=True)
class EngineConfig:
    enabled: bool = True  # false: the node manager runs only its KV store (storage-only nodes, tests)
    model: str = ""  # local HF model directory; empty: SmolLM2-135M-Instruct from `symphony model fetch`
    served_model_name: str = ""  # name clients pass as `model`; empty: the model directory's name
    dtype: EngineDtype = "bfloat16"
    block_size: int = 32  # vLLM CPU needs a multiple of 32
    max_model_len: int = 8192
    kv_cache_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE; ignored on GPU builds
    enforce_eager: bool = True  # skip torch.compile: ~30 s start instead of minutes on CPU
    kv_connector: bool = True  # Symphony's KV connector: turns load from and save to the node's tiers
    # CPU engines: the cores each computes on. "auto": the host's cores split between the local
    # cluster's engines; "vllm": vLLM's own binding (every engine on the same first cores); or vLLM
    # core lists per node index, "|"-separated ("0-3|4-7").
    cpu_cores: str = "auto"
    # Scheduling niceness of the engine process (0-19; 0: as the node manager), set for its whole
    # session's autogroup too (symphony.pdeathsig_exec). On a CPU host the engine's forward passes
    # would otherwise take every core from the scheduler and the node managers, whose work is short
    # but on every request's path (docs/design-notes.md#engine-niceness). On a GPU host the engine
    # needs little CPU.
    nice: int = 5
    # vLLM's AMX attention kernel on CPUs that have AMX (bfloat16, blocks of 32). Off: its vector
    # kernel serves instead (node_manager/vllm_plugin.py; docs/design-notes.md#amx-attention).
    cpu_amx_attention: bool = False
    extra_args: list[str] = field(default_factory=list)  # appended to the vLLM server command line
    startup_timeout_s: float = 300.0
    max_restarts: int = 5  # crash restarts before the node reports FAILED
    restart_backoff_s: float = 1.0  # first back-off; doubles per consecutive crash
    restart_backoff_max_s: float = 30.0
    stable_after_s: float = 120.0  # a run this long resets the consecutive-crash count
    stop_timeout_s: float = 20.0  # SIGTERM grace before SIGKILL
    liveness_timeout_s: float = 60.0  # a ready engine failing /health this long is restarted as hung


@dataclass(frozen=True)
class KVConfig:
    """The node manager's tiered KV store. Capacities are per node; lower tiers must be >= upper."""

    hbm_bytes: int = 256 * 1024**2  # staged pages in engine device memory (the CPU here)
    dram_bytes: int = 1024**3  # shared-memory arena the vLLM worker maps
    ssd_bytes: int = 16 * 1024**3  # segment files under ssd_dir
    ssd_dir: str = ""  # empty: <home>/kv/<node id>
    device: str = "cpu"  # HBM tier device: "cpu" or "cuda[:N]"
    io_threads: int = 2  # copy and file I/O threads per node
    max_inflight_jobs: int = 256  # queued layer loads and save copies; beyond, loads get RESOURCE_EXHAUSTED
    segment_max_bytes: int = 8 * 1024**2  # write-behind batches up to this many bytes per SSD file
    ssd_writers: int = 2  # write-behind threads: segments written at once (the SSD's queue depth)
    max_sessions: int = 100_000  # session records kept (LRU beyond; their pages age out by tier policy)
    max_session_tokens: int = 1_048_576
    max_pending_prefetches: int = 4096
    prefetch_concurrency: int = 2
    peer_timeout_s: float = 30.0  # a node-to-node page stream that stalls this long is abandoned
    # Node-to-node page pulls: "tcp" (a raw page stream; gRPC's FetchPages when the peer has none) or
    # "grpc" (FetchPages only, e.g. where only the gRPC port is open between nodes).
    data_plane: DataPlane = "tcp"
    data_port_base: int = 0  # node i's page stream listens on base + i; 0: a free port, advertised in status
    metrics_port_base: int = 9300  # node i serves Prometheus /metrics on base + i; 0 disables
    # A TIER_HBM prefetch ends with a warm-up request that puts the history in vLLM's own prefix
    # cache, sent only while no request waits and the engine's KV usage is below this fraction
    # (a warm-up must never delay a real request); 0 disables warm-ups.
    engine_warmup_max_kv_usage: float = 0.8
    engine_warmup_timeout_s: float = 30.0
    # At start, SSD segments of another model (another fingerprint: weights, tokenizer, dtype, block
    # size or page layout) are never loaded. false: they are deleted; true: kept on disk for a
    # rollback to that model, counted against ssd_bytes and evicted first when room is needed.
    ssd_keep_other_models: bool = False


@dataclass(frozen=True)
class LoggingConfig:
    level: LogLevel = "info"  # any case in the file or environment
    format: LogFormat = "text"  # text: key=value


@dataclass(frozen=True)
class SymphonyConfig:
    home: str = ""  # state directory; empty: $SYMPHONY_HOME or ~/.cache/symphony
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def home_path(self) -> Path:
        return Path(self.home).expanduser()

    @staticmethod
    def node_id(index: int) -> str:
        return f"node-{index}"

    def node_grpc_address(self, index: int) -> str:
        return f"{self.node.host}:{self.node.grpc_port_base + index}"

    def engine_port(self, index: int) -> int:
        return self.node.engine_port_base + index

    def kv_metrics_port(self, index: int) -> int:
        return self.kv.metrics_port_base + index if self.kv.metrics_port_base else 0

    def kv_socket_path(self, index: int) -> Path:
        """The node-local KV channel (Unix socket) between node manager `index` and its engine's
        connector. Under the temp directory, not the home: socket paths are limited to 107 bytes.
        Named by user and gRPC port, like the DRAM arena: unique per running node on this host."""
        return (
            Path(tempfile.gettempdir()) / f"symphony-{os.getuid()}-{self.node_id(index)}-"
            f"{self.node.grpc_port_base + index}.sock"
        )

    def kv_data_port(self, index: int) -> int:
        """The page stream's port for node `index`; 0: any free one."""
        return self.kv.data_port_base + index if self.kv.data_port_base else 0

    def kv_ssd_dir(self, index: int) -> Path:
        base = Path(self.kv.ssd_dir).expanduser() if self.kv.ssd_dir else self.home_path / "kv"
        return base / self.node_id(index)

    def scheduler_node_addresses(self) -> list[str]:
        if self.scheduler.node_addresses:
            return list(self.scheduler.node_addresses)
        return [self.node_grpc_address(i) for i in range(self.cluster.nodes)]

    @property
    def scheduler_url(self) -> str:
        return f"http://{self.scheduler.host}:{self.scheduler.port}"


_SECTION_TYPES: dict[str, type] = {
    name: hint for name, hint in typing.get_type_hints(SymphonyConfig).items() if name != "home"
}
SECTIONS: tuple[str, ...] = tuple(_SECTION_TYPES)


def default_home(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("SYMPHONY_HOME") or "~/.cache/symphony").expanduser()


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> SymphonyConfig:
    """Build the effective configuration from defaults, the TOML file, env vars and flag overrides."""
    env = os.environ if env is None else env
    layers: list[tuple[str, dict[str, Any]]] = []
    if path is not None:
        layers.append((str(path), _read_toml(Path(path))))
    layers.append(("environment", _env_layer(env)))
    if overrides:
        layers.append(("command line", {k: dict(v) for k, v in overrides.items()}))

    merged: dict[str, Any] = {}
    for source, layer in layers:
        for key, value in layer.items():
            if key == "home":
                merged["home"] = (source, value)
                continue
            if key not in SECTIONS:
                raise ConfigError(f"{source}: unknown section [{key}] (known: {', '.join(SECTIONS)})")
            if not isinstance(value, Mapping):
                raise ConfigError(f"{source}: [{key}] must be a table")
            section = merged.setdefault(key, {})
            for name, item in value.items():
                section[name] = (source, item)

    home_source, home_value = merged.pop("home", ("default", str(default_home(env))))
    home = _coerce("home", str, home_value, home_source) or str(default_home(env))
    sections = {name: _build_section(name, _SECTION_TYPES[name], merged.get(name, {})) for name in SECTIONS}
    config = SymphonyConfig(home=home, **sections)
    _validate(config)
    return config


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def _env_layer(env: Mapping[str, str]) -> dict[str, Any]:
    """Pick SYMPHONY_<SECTION>_<KEY> variables; values stay strings until coerced per field."""
    layer: dict[str, Any] = {}
    if env.get("SYMPHONY_HOME"):
        layer["home"] = env["SYMPHONY_HOME"]
    for section_name, section_type in _SECTION_TYPES.items():
        for f in dataclasses.fields(section_type):
            var = f"{ENV_PREFIX}{section_name}_{f.name}".upper()
            if var in env:
                layer.setdefault(section_name, {})[f.name] = _EnvString(var, env[var])
    return layer


class _EnvString(str):
    """A raw env value, remembered as such so list fields may be given as JSON or comma-separated."""

    def __new__(cls, var: str, value: str) -> _EnvString:
        obj = super().__new__(cls, value)
        obj.var = var  # type: ignore[attr-defined]
        return obj


def _build_section(name: str, section_type: type, values: dict[str, tuple[str, Any]]) -> Any:
    hints = typing.get_type_hints(section_type)
    known = {f.name for f in dataclasses.fields(section_type)}
    kwargs = {}
    for key, (source, raw) in values.items():
        if key not in known:
            raise ConfigError(f"{source}: unknown key {name}.{key} (known: {', '.join(sorted(known))})")
        where = raw.var if isinstance(raw, _EnvString) else f"{source}: {name}.{key}"  # type: ignore[attr-defined]
        kwargs[key] = _coerce(where, hints[key], raw, source)
    return section_type(**kwargs)


def _coerce(where: str, expected: Any, raw: Any, source: str) -> Any:
    from_env = isinstance(raw, _EnvString)
    origin = typing.get_origin(expected)
    if origin is list or expected is list:
        if from_env:
            text = str(raw).strip()
            try:
                raw = json.loads(text) if text.startswith("[") else [p.strip() for p in text.split(",") if p.strip()]
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: not a valid JSON list ({exc}); or give comma-separated values") from None
        if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
            raise ConfigError(f"{where}: expected a list of strings, got {raw!r}")
        return list(raw)
    if expected is bool:
        if from_env:
            lowered = str(raw).strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
        elif isinstance(raw, bool):
            return raw
        raise ConfigError(f"{where}: expected true or false, got {raw!r}")
    if expected is int:
        if from_env:
            try:
                return int(str(raw).strip())
            except ValueError:
                pass
        elif isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        raise ConfigError(f"{where}: expected an integer, got {raw!r}")
    if expected is float:
        if from_env:
            try:
                return float(str(raw).strip())
            except ValueError:
                pass
        elif isinstance(raw, int | float) and not isinstance(raw, bool):
            return float(raw)
        raise ConfigError(f"{where}: expected a number, got {raw!r}")
    if origin is Literal:
        choices = typing.get_args(expected)
        if isinstance(raw, str):
            for value in (str(raw), str(raw).strip().lower()):
                if value in choices:
                    return value
        shown = str(raw) if isinstance(raw, str) else raw
        raise ConfigError(f"{where}: expected one of {', '.join(choices)}, got {shown!r}")
    if expected is str:
        if isinstance(raw, str):
            return str(raw)
        raise ConfigError(f"{where}: expected a string, got {raw!r}")
    raise ConfigError(f"{where}: unsupported type {expected!r}")  # pragma: no cover - programming error


def _validate(config: SymphonyConfig) -> None:
    def check(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{key}: {message}")

    def port(key: str, value: int) -> None:
        check(1 <= value <= 65535, key, f"port {value} outside 1..65535")

    check(1 <= config.cluster.nodes <= 64, "cluster.nodes", f"{config.cluster.nodes} outside 1..64")
    s = config.scheduler
    port("scheduler.port", s.port)
    for name in (
        "poll_interval_ms",
        "node_down_after_ms",
        "max_inflight_requests",
        "max_body_bytes",
        "max_session_id_len",
        "max_advisories",
        "max_expected_arrival_ms",
        "connect_timeout_s",
        "request_timeout_s",
        "advisory_ttl_s",
        "typing_lead_ms",
        "max_prefetches",
        "max_sessions",
        "prefix_trie_max_chars",
        "session_ttl_s",
        "max_priority_settings",
        "max_queued_requests",
        "queue_timeout_s",
    ):
        check(getattr(s, name) > 0, f"scheduler.{name}", "must be positive")
    for name in ("route_pull_wait_ms", "route_pull_min_tokens"):
        check(getattr(s, name) >= 0, f"scheduler.{name}", "must not be negative")
    check(
        s.node_down_after_ms >= s.poll_interval_ms,
        "scheduler.node_down_after_ms",
        "must be at least scheduler.poll_interval_ms",
    )
    tenants_by_key: dict[str, str] = {}
    for entry in s.api_keys:
        tenant, sep, key = entry.partition(":")
        check(
            bool(sep and tenant and key),
            "scheduler.api_keys",
            'entries must be "tenant:key" (the tenant, a colon, the key)',
        )
        check(
            key not in tenants_by_key,
            "scheduler.api_keys",
            f"a key is given to both {tenants_by_key.get(key)!r} and {tenant!r}",
        )
        tenants_by_key[key] = tenant
    for address in s.node_addresses:
        host, sep, port_text = address.rpartition(":")
        check(
            bool(sep and host and port_text.isdigit() and 1 <= int(port_text) <= 65535),
            "scheduler.node_addresses",
            f"{address!r} is not host:port with a port in 1..65535",
        )
    n = config.node
    port("node.grpc_port_base", n.grpc_port_base)
    port("node.grpc_port_base + cluster.nodes - 1", n.grpc_port_base + config.cluster.nodes - 1)
    port("node.engine_port_base", n.engine_port_base)
    port("node.engine_port_base + cluster.nodes - 1", n.engine_port_base + config.cluster.nodes - 1)
    check(n.engine_scrape_interval_ms > 0, "node.engine_scrape_interval_ms", "must be positive")
    e = config.engine
    check(
        e.block_size > 0 and e.block_size % 32 == 0,
        "engine.block_size",
        f"{e.block_size} is not a positive multiple of 32 (vLLM CPU attention needs it)",
    )
    check(e.max_model_len > 0, "engine.max_model_len", "must be positive")
    check(e.kv_cache_space_gib > 0, "engine.kv_cache_space_gib", "must be positive")
    check(
        e.cpu_cores in ("auto", "vllm") or bool(re.fullmatch(r"[0-9,\-]+(\|[0-9,\-]+)*", e.cpu_cores)),
        "engine.cpu_cores",
        f"{e.cpu_cores!r} is not auto, vllm, or core lists like 0-3|4-7",
    )
    check(e.max_restarts >= 0, "engine.max_restarts", "must be >= 0")
    check(0 <= e.nice <= 19, "engine.nice", f"{e.nice} is not a niceness in 0..19")
    for name in (
        "startup_timeout_s",
        "restart_backoff_s",
        "restart_backoff_max_s",
        "stop_timeout_s",
        "liveness_timeout_s",
        "stable_after_s",
    ):
        check(getattr(e, name) > 0, f"engine.{name}", "must be positive")
    kv = config.kv
    check(
        0 <= kv.hbm_bytes <= kv.dram_bytes <= kv.ssd_bytes,
        "kv.hbm_bytes/dram_bytes/ssd_bytes",
        f"need 0 <= hbm_bytes <= dram_bytes <= ssd_bytes, got {kv.hbm_bytes}, {kv.dram_bytes}, {kv.ssd_bytes}",
    )
    for name in (
        "io_threads",
        "max_inflight_jobs",
        "segment_max_bytes",
        "ssd_writers",
        "max_sessions",
        "max_session_tokens",
        "max_pending_prefetches",
        "prefetch_concurrency",
        "peer_timeout_s",
    ):
        check(getattr(kv, name) > 0, f"kv.{name}", "must be positive")
    check(kv.device == "cpu" or kv.device.startswith("cuda"), "kv.device", f"{kv.device!r} is not cpu or cuda[:N]")
    check(
        0 <= kv.engine_warmup_max_kv_usage <= 1,
        "kv.engine_warmup_max_kv_usage",
        f"{kv.engine_warmup_max_kv_usage} is not a fraction in [0, 1]",
    )
    check(kv.engine_warmup_timeout_s > 0, "kv.engine_warmup_timeout_s", "must be positive")
    if kv.metrics_port_base:
        port("kv.metrics_port_base", kv.metrics_port_base)
        port("kv.metrics_port_base + cluster.nodes - 1", kv.metrics_port_base + config.cluster.nodes - 1)
    if kv.data_port_base:
        port("kv.data_port_base", kv.data_port_base)
        port("kv.data_port_base + cluster.nodes - 1", kv.data_port_base + config.cluster.nodes - 1)
    ports = [s.port] + [n.grpc_port_base + i for i in range(config.cluster.nodes)]
    ports += [n.engine_port_base + i for i in range(config.cluster.nodes)]
    if kv.metrics_port_base:
        ports += [kv.metrics_port_base + i for i in range(config.cluster.nodes)]
    if kv.data_port_base:
        ports += [kv.data_port_base + i for i in range(config.cluster.nodes)]
    check(len(set(ports)) == len(ports), "ports", f"scheduler, node and engine ports overlap: {sorted(ports)}")


def dump_toml(config: SymphonyConfig) -> str:
    """Render the effective configuration as TOML that load_config reads back unchanged."""
    lines = [f"home = {_toml_value(config.home)}"]
    for section_name in SECTIONS:
        lines.append(f"\n[{section_name}]")
        section = getattr(config, section_name)
        for f in dataclasses.fields(section):
            lines.append(f"{f.name} = {_toml_value(getattr(section, f.name))}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {value!r} as TOML")

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
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from symphony.config_checks import coordination_checks, coordination_ports, region_checks
from symphony.config_schema import (
    ClusterConfig,
    DataPlane,
    EngineConfig,
    EngineDtype,
    KVConfig,
    LogFormat,
    LoggingConfig,
    LogLevel,
    NodeConfig,
    PolicyName,
    QuotasConfig,
    RegionPolicyName,
    RegionsConfig,
    SchedulerConfig,
    SymphonyConfig,
)
from symphony.residency_rules import known_tenants
from symphony.tenant_quotas import quotas_from_config

__all__ = [
    "ENV_PREFIX",
    "KV_INDEX_MAX_NODES",
    "SECTIONS",
    "ClusterConfig",
    "ConfigError",
    "DataPlane",
    "EngineConfig",
    "EngineDtype",
    "KVConfig",
    "LogFormat",
    "LogLevel",
    "LoggingConfig",
    "NodeConfig",
    "PolicyName",
    "QuotasConfig",
    "RegionPolicyName",
    "RegionsConfig",
    "SchedulerConfig",
    "SymphonyConfig",
    "default_home",
    "dump_toml",
    "load_config",
]

ENV_PREFIX = "SYMPHONY_"
REDACTED = "<redacted>"  # a secret as `config show` prints it (symphony.config_secrets)
# Nodes the scheduler's KV index can hold: one bit each in a 64-bit mask (scheduler.kv_index.MAX_NODES).
KV_INDEX_MAX_NODES = 64
# How long httpx's pools (so the `openai` client's) reuse an idle connection: a server must keep one
# longer (scheduler.keep_alive_s), or a request sent as it closes the connection breaks.
CLIENT_POOL_KEEPALIVE_S = 5


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


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
    if sections["cluster"].ha and "replicas" not in merged.get("scheduler", {}):
        # cluster.ha means replicas: two unless a layer says how many.
        sections["scheduler"] = dataclasses.replace(sections["scheduler"], replicas=2)
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

    var: str  # the environment variable it came from

    def __new__(cls, var: str, value: str) -> _EnvString:
        obj = super().__new__(cls, value)
        obj.var = var
        return obj


def _build_section(name: str, section_type: type, values: dict[str, tuple[str, Any]]) -> Any:
    hints = typing.get_type_hints(section_type)
    known = {f.name for f in dataclasses.fields(section_type)}
    kwargs = {}
    for key, (source, raw) in values.items():
        if key not in known:
            raise ConfigError(f"{source}: unknown key {name}.{key} (known: {', '.join(sorted(known))})")
        where = raw.var if isinstance(raw, _EnvString) else f"{source}: {name}.{key}"
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
    region_ports = region_checks(config, check, port)  # first: the node addresses depend on the regions
    coordination_checks(config, check)
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
        "request_read_timeout_s",
        "advisory_ttl_s",
        "typing_lead_ms",
        "max_prefetches",
        "max_sessions",
        "prefix_trie_max_chars",
        "session_ttl_s",
        "max_priority_settings",
        "max_queued_requests",
        "queue_timeout_s",
        "max_queue_wait_s",
        "kv_index_max_blocks",
        "kv_watch_timeout_ms",
        "kv_watch_backoff_max_ms",
        "tokenizer_cache_sessions",
        "tokenizer_cache_tokens",
        "prefix_donor_blocks",
        "tokenize_timeout_ms",
        "cost_profile_max_age_days",
    ):
        check(getattr(s, name) > 0, f"scheduler.{name}", "must be positive")
    check(
        s.keep_alive_s > CLIENT_POOL_KEEPALIVE_S,
        "scheduler.keep_alive_s",
        f"{s.keep_alive_s} s: must be over {CLIENT_POOL_KEEPALIVE_S} s, for as long as the usual clients'"
        " pools (httpx, so the openai client) reuse an idle connection; a connection closed as it is"
        " reused breaks the request sent on it",
    )
    for name in ("route_pull_wait_ms", "route_pull_min_tokens"):
        check(getattr(s, name) >= 0, f"scheduler.{name}", "must not be negative")
    check(
        s.node_down_after_ms >= s.poll_interval_ms,
        "scheduler.node_down_after_ms",
        "must be at least scheduler.poll_interval_ms",
    )
    check(
        not s.kv_index_enabled or len(config.scheduler_node_addresses()) <= KV_INDEX_MAX_NODES,
        "scheduler.kv_index_enabled",
        f"the KV index holds up to {KV_INDEX_MAX_NODES} nodes; turn it off for more",
    )
    # What `config show` prints in place of a secret: a file copied from its output must not turn
    # the admin API on with a token anyone can read there.
    redacted = f"must be the secret itself, not config show's {REDACTED}"
    check(s.admin_token != REDACTED, "scheduler.admin_token", redacted)
    secret = config.cluster.secret  # 16 characters or more: never config show's REDACTED
    check(not secret or len(secret) >= 16, "cluster.secret", f"must be empty or 16 characters or more, {redacted}")
    tenants_by_key: dict[str, str] = {}
    for entry in s.api_keys:
        tenant, sep, key = entry.partition(":")
        check(
            bool(sep and tenant and key),
            "scheduler.api_keys",
            'entries must be "tenant:key" (the tenant, a colon, the key)',
        )
        check(key != REDACTED, "scheduler.api_keys", f"{tenant!r}'s key {redacted}")
        check(
            key not in tenants_by_key,
            "scheduler.api_keys",
            f"a key is given to both {tenants_by_key.get(key)!r} and {tenant!r}",
        )
        tenants_by_key[key] = tenant
    try:
        quotas_from_config(config.quotas, known_tenants(s.api_keys))
    except ValueError as exc:
        key, _, message = str(exc).partition(": ")
        raise ConfigError(f"quotas.{key}: {message}") from None
    served_names: set[str] = set()
    for entry in s.tokenizers:
        name, sep, path = entry.partition("=")
        check(bool(sep and name and path), "scheduler.tokenizers", f'{entry!r} is not "served_name=path"')
        check(name not in served_names, "scheduler.tokenizers", f"{name!r} is given twice")
        served_names.add(name)
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
    for name in ("advertise_grpc_port_base", "advertise_engine_port_base", "advertise_data_port_base"):
        if getattr(n, name):
            port(f"node.{name}", getattr(n, name))
            port(f"node.{name} + cluster.nodes - 1", getattr(n, name) + config.cluster.nodes - 1)
    check(
        not n.advertise_data_port_base or bool(config.kv.data_port_base and config.kv.data_plane == "tcp"),
        "node.advertise_data_port_base",
        'needs kv.data_port_base (and kv.data_plane = "tcp"): a proxy cannot target a port the kernel picks',
    )
    e = config.engine
    check(
        e.block_size > 0 and e.block_size % 32 == 0,
        "engine.block_size",
        f"{e.block_size} is not a positive multiple of 32 (vLLM CPU attention needs it)",
    )
    check(e.max_model_len > 0, "engine.max_model_len", "must be positive")
    check(e.max_num_seqs >= 0, "engine.max_num_seqs", "must be 0 (vLLM's default) or positive")
    check(e.kv_cache_space_gib > 0, "engine.kv_cache_space_gib", "must be positive")
    check(
        e.cpu_cores in ("auto", "vllm") or bool(re.fullmatch(r"[0-9,\-]+(\|[0-9,\-]+)*", e.cpu_cores)),
        "engine.cpu_cores",
        f"{e.cpu_cores!r} is not auto, vllm, or core lists like 0-3|4-7",
    )
    check(e.max_restarts >= 0, "engine.max_restarts", "must be >= 0")
    check(e.kv_events_max_blocks >= 0, "engine.kv_events_max_blocks", "must be >= 0 (0: sized from the engine)")
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
    capacities = tier_capacities_error(kv.hbm_bytes, kv.dram_bytes, kv.ssd_bytes)
    check(capacities is None, "kv.hbm_bytes/dram_bytes/ssd_bytes", f"need {capacities}")
    for name in (
        *STORE_POSITIVE_KEYS,
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
    check(kv.ssd_headroom_bytes >= 0, "kv.ssd_headroom_bytes", "must not be negative")
    for name in (
        "block_events_ring_batches",
        "block_events_ring_entries",
        "block_events_subscriber_backlog",
        "block_events_max_subscribers",
        "block_events_engine_keys",
        "block_events_heartbeat_s",
    ):
        check(getattr(kv, name) > 0, f"kv.{name}", "must be positive")
    check(kv.block_events_batch_entries >= 2, "kv.block_events_batch_entries", "must be at least 2")
    check(
        kv.block_events_subscriber_backlog <= kv.block_events_ring_batches,
        "kv.block_events_subscriber_backlog",
        "must not exceed kv.block_events_ring_batches (a backlog is read from the ring)",
    )
    check(
        kv.block_events_batch_entries <= kv.block_events_ring_entries,
        "kv.block_events_batch_entries",
        "must not exceed kv.block_events_ring_entries",
    )
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
    ports += region_ports + coordination_ports(config)
    twice = sorted({p for p in ports if ports.count(p) > 1})
    check(not twice, "ports", f"scheduler, node, engine and region ports overlap at {twice}")


# The KV store's keys that must be positive; the store checks them again when built without a config.
STORE_POSITIVE_KEYS = (
    "io_threads",
    "max_inflight_jobs",
    "segment_max_bytes",
    "ssd_writers",
    "max_sessions",
    "max_session_tokens",
)


def tier_capacities_error(hbm_bytes: int, dram_bytes: int, ssd_bytes: int) -> str | None:
    """What is wrong with per-node tier capacities (each lower tier at least the one above), or None."""
    if 0 <= hbm_bytes <= dram_bytes <= ssd_bytes:
        return None
    return f"0 <= hbm_bytes <= dram_bytes <= ssd_bytes, got {hbm_bytes}, {dram_bytes}, {ssd_bytes}"


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

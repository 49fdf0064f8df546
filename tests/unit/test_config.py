"""symphony.config: layering (defaults < TOML < env < command line), coercion, validation, dump round trip."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest
from openai._constants import DEFAULT_CONNECTION_LIMITS

from symphony.cluster_tls import config_hosts
from symphony.config import (
    CLIENT_POOL_KEEPALIVE_S,
    ClusterConfig,
    ConfigError,
    EngineConfig,
    LoggingConfig,
    NodeConfig,
    SchedulerConfig,
    SymphonyConfig,
    dump_toml,
    load_config,
)


def write_toml(tmp_path: Path, text: str, name: str = "symphony.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- defaults and layering --------------------------------------------------------------------------
def test_defaults_match_the_dataclass_defaults_when_nothing_is_given(tmp_path: Path) -> None:
    config = load_config(env={"SYMPHONY_HOME": str(tmp_path)})
    assert config.cluster == ClusterConfig()
    assert config.scheduler == SchedulerConfig()
    assert config.node == NodeConfig()
    assert config.engine == EngineConfig()
    assert config.logging == LoggingConfig()


def test_default_home_is_user_cache_when_symphony_home_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SYMPHONY_HOME", raising=False)
    config = load_config(env={})
    assert config.home_path == Path("~/.cache/symphony").expanduser()


def test_symphony_home_env_sets_home(tmp_path: Path) -> None:
    config = load_config(env={"SYMPHONY_HOME": str(tmp_path / "state")})
    assert config.home_path == tmp_path / "state"


def test_toml_file_values_replace_defaults(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        """
home = "/srv/symphony"

[cluster]
nodes = 3

[scheduler]
port = 9000
connect_timeout_s = 3
node_addresses = ["10.0.0.1:50051", "10.0.0.2:50051"]

[engine]
enforce_eager = false
extra_args = ["--seed", "7"]
""",
    )
    config = load_config(path, env={})
    assert config.home == "/srv/symphony"
    assert config.cluster.nodes == 3
    assert config.scheduler.port == 9000
    assert config.scheduler.connect_timeout_s == 3.0
    assert isinstance(config.scheduler.connect_timeout_s, float)  # an int in TOML is accepted for a float
    assert config.scheduler.node_addresses == ["10.0.0.1:50051", "10.0.0.2:50051"]
    assert config.engine.enforce_eager is False
    assert config.engine.extra_args == ["--seed", "7"]
    # untouched keys keep their defaults
    assert config.scheduler.host == SchedulerConfig().host


def test_env_var_beats_toml_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[scheduler]\nport = 9000\n")
    config = load_config(path, env={"SYMPHONY_SCHEDULER_PORT": "9001"})
    assert config.scheduler.port == 9001


def test_command_line_overrides_beat_env(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[scheduler]\nport = 9000\n")
    config = load_config(path, env={"SYMPHONY_SCHEDULER_PORT": "9001"}, overrides={"scheduler": {"port": 9002}})
    assert config.scheduler.port == 9002


def test_env_home_beats_toml_home(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'home = "/from/file"\n')
    config = load_config(path, env={"SYMPHONY_HOME": "/from/env"})
    assert config.home == "/from/env"


def test_overrides_only_touch_the_keys_they_name(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[scheduler]\nport = 9000\nmax_session_id_len = 64\n")
    config = load_config(path, env={}, overrides={"scheduler": {"port": 9002}})
    assert config.scheduler.max_session_id_len == 64


def test_env_vars_for_unknown_keys_are_ignored() -> None:
    config = load_config(env={"SYMPHONY_SCHEDULER_NO_SUCH_KEY": "1", "SYMPHONY_NOSECTION_PORT": "1"})
    assert config.scheduler == SchedulerConfig()


# -- unknown names ----------------------------------------------------------------------------------
def test_unknown_section_in_file_names_section_and_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[bogus]\nx = 1\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, env={})
    message = str(excinfo.value)
    assert "[bogus]" in message
    assert str(path) in message


def test_unknown_key_in_file_names_key_and_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[scheduler]\nprot = 8000\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, env={})
    message = str(excinfo.value)
    assert "scheduler.prot" in message
    assert str(path) in message


def test_unknown_key_from_command_line_names_its_source() -> None:
    with pytest.raises(ConfigError, match=r"command line: unknown key engine\.modle"):
        load_config(env={}, overrides={"engine": {"modle": "x"}})


def test_section_given_as_scalar_is_rejected(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "scheduler = 3\n")
    with pytest.raises(ConfigError, match=r"\[scheduler\] must be a table"):
        load_config(path, env={})


# -- types ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("toml", "key", "expected"),
    [
        ('[scheduler]\nport = "8000"\n', "scheduler.port", "integer"),
        ("[scheduler]\nport = true\n", "scheduler.port", "integer"),
        ("[scheduler]\nport = 8000.0\n", "scheduler.port", "integer"),
        ('[scheduler]\nconnect_timeout_s = "2"\n', "scheduler.connect_timeout_s", "number"),
        ("[scheduler]\nconnect_timeout_s = false\n", "scheduler.connect_timeout_s", "number"),
        ('[engine]\nenforce_eager = "true"\n', "engine.enforce_eager", "true or false"),
        ("[engine]\nenforce_eager = 1\n", "engine.enforce_eager", "true or false"),
        ("[engine]\nmodel = 5\n", "engine.model", "string"),
        ('[engine]\nextra_args = "--x"\n', "engine.extra_args", "list of strings"),
        ("[engine]\nextra_args = [1, 2]\n", "engine.extra_args", "list of strings"),
    ],
)
def test_wrong_type_in_file_names_key_and_expected_type(tmp_path: Path, toml: str, key: str, expected: str) -> None:
    path = write_toml(tmp_path, toml)
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, env={})
    message = str(excinfo.value)
    assert key in message
    assert expected in message
    assert str(path) in message


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("SYMPHONY_SCHEDULER_PORT", "eighty"),
        ("SYMPHONY_SCHEDULER_PORT", ""),
        ("SYMPHONY_SCHEDULER_PORT", "80.5"),
        ("SYMPHONY_SCHEDULER_CONNECT_TIMEOUT_S", "soon"),
        ("SYMPHONY_ENGINE_ENFORCE_EAGER", "maybe"),
        ("SYMPHONY_ENGINE_EXTRA_ARGS", '["--x", 1]'),
    ],
)
def test_wrong_type_from_env_names_the_env_var(var: str, value: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(env={var: value})
    assert var in str(excinfo.value)


def test_env_values_are_coerced_to_field_types() -> None:
    config = load_config(
        env={
            "SYMPHONY_SCHEDULER_PORT": " 9001 ",
            "SYMPHONY_SCHEDULER_CONNECT_TIMEOUT_S": "0.5",
            "SYMPHONY_CLUSTER_NODES": "4",
        }
    )
    assert config.scheduler.port == 9001
    assert config.scheduler.connect_timeout_s == 0.5
    assert config.cluster.nodes == 4


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("yes", True),
        ("on", True),
        ("false", False),
        ("False", False),
        ("0", False),
        ("no", False),
        (" off ", False),
    ],
)
def test_bool_from_env(text: str, expected: bool) -> None:
    config = load_config(env={"SYMPHONY_ENGINE_ENFORCE_EAGER": text})
    assert config.engine.enforce_eager is expected


def test_list_from_env_comma_separated_is_split_and_stripped() -> None:
    config = load_config(env={"SYMPHONY_SCHEDULER_NODE_ADDRESSES": " a:1, b:2,,c:3, "})
    assert config.scheduler.node_addresses == ["a:1", "b:2", "c:3"]


def test_list_from_env_as_json_keeps_commas_inside_items() -> None:
    value = '["--override-generation-config", "{\\"a\\": 1, \\"b\\": 2}"]'
    config = load_config(env={"SYMPHONY_ENGINE_EXTRA_ARGS": value})
    assert config.engine.extra_args == ["--override-generation-config", '{"a": 1, "b": 2}']


def test_empty_list_from_env() -> None:
    config = load_config(env={"SYMPHONY_ENGINE_EXTRA_ARGS": ""})
    assert config.engine.extra_args == []


def test_malformed_json_list_from_env_is_a_config_error_naming_the_var() -> None:
    with pytest.raises(ConfigError, match="SYMPHONY_ENGINE_EXTRA_ARGS"):
        load_config(env={"SYMPHONY_ENGINE_EXTRA_ARGS": '["--seed", 7'})


# -- validation -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"engine": {"block_size": 48}}, "engine.block_size"),
        ({"engine": {"block_size": 0}}, "engine.block_size"),
        ({"engine": {"max_model_len": 0}}, "engine.max_model_len"),
        ({"scheduler": {"port": 0}}, "scheduler.port"),
        ({"scheduler": {"port": 65536}}, "scheduler.port"),
        ({"node": {"grpc_port_base": 65535}}, "node.grpc_port_base + cluster.nodes - 1"),
        ({"scheduler": {"port": 50052}}, "ports"),  # node 1's gRPC port
        ({"node": {"engine_port_base": 50051}}, "ports"),  # engine ports on top of gRPC ports
        ({"cluster": {"nodes": 0}}, "cluster.nodes"),
        ({"cluster": {"nodes": 65}}, "cluster.nodes"),
        ({"scheduler": {"node_addresses": ["localhost"]}}, "scheduler.node_addresses"),
        ({"scheduler": {"node_addresses": ["localhost:grpc"]}}, "scheduler.node_addresses"),
        ({"scheduler": {"node_addresses": [":50051"]}}, "scheduler.node_addresses"),
        ({"scheduler": {"node_addresses": ["host:"]}}, "scheduler.node_addresses"),
        ({"scheduler": {"poll_interval_ms": 200, "node_down_after_ms": 199}}, "scheduler.node_down_after_ms"),
        ({"scheduler": {"max_session_id_len": 0}}, "scheduler.max_session_id_len"),
        ({"scheduler": {"advisory_ttl_s": 0.0}}, "scheduler.advisory_ttl_s"),
        ({"engine": {"max_restarts": -1}}, "engine.max_restarts"),
        ({"engine": {"kv_events_max_blocks": -1}}, "engine.kv_events_max_blocks"),
        ({"engine": {"nice": 20}}, "engine.nice"),
        ({"engine": {"nice": -1}}, "engine.nice"),
        ({"kv": {"ssd_writers": 0}}, "kv.ssd_writers"),
        ({"kv": {"data_port_base": 70000}}, "kv.data_port_base"),
        ({"kv": {"data_port_base": 50051}}, "ports"),  # on top of node 0's gRPC port
        ({"scheduler": {"kv_index_max_blocks": 0}}, "scheduler.kv_index_max_blocks"),
        ({"scheduler": {"kv_watch_timeout_ms": 0}}, "scheduler.kv_watch_timeout_ms"),
        ({"scheduler": {"kv_watch_backoff_max_ms": 0}}, "scheduler.kv_watch_backoff_max_ms"),
        ({"scheduler": {"node_addresses": [f"h:{1000 + i}" for i in range(65)]}}, "scheduler.kv_index_enabled"),
        ({"kv": {"block_events_batch_entries": 1}}, "kv.block_events_batch_entries"),
        ({"kv": {"block_events_heartbeat_s": 0.0}}, "kv.block_events_heartbeat_s"),
        ({"kv": {"block_events_max_subscribers": 0}}, "kv.block_events_max_subscribers"),
        (
            {"kv": {"block_events_ring_batches": 100, "block_events_subscriber_backlog": 101}},
            "kv.block_events_subscriber_backlog",
        ),
        (
            {"kv": {"block_events_ring_entries": 100, "block_events_batch_entries": 101}},
            "kv.block_events_batch_entries",
        ),
    ],
)
def test_invalid_values_are_rejected_naming_the_key(overrides: dict[str, dict[str, Any]], key: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(env={}, overrides=overrides)
    assert str(excinfo.value).startswith(f"{key}:")


@pytest.mark.parametrize(
    "overrides",
    [
        {"engine": {"block_size": 64}},
        {"scheduler": {"poll_interval_ms": 200, "node_down_after_ms": 200}},
        {"scheduler": {"node_addresses": ["[::1]:50051", "node-a.internal:7000"]}},
        {"cluster": {"nodes": 64}},
        {"engine": {"max_restarts": 0}},
        {"engine": {"kv_events": False, "kv_events_max_blocks": 0}},
        {"kv": {"data_plane": "grpc", "data_port_base": 9400}},
        {"scheduler": {"node_addresses": [f"h:{1000 + i}" for i in range(64)], "kv_index_max_blocks": 1}},
        {"scheduler": {"node_addresses": [f"h:{1000 + i}" for i in range(65)], "kv_index_enabled": False}},
        {"kv": {"block_events_batch_entries": 2, "block_events_ring_batches": 5, "block_events_subscriber_backlog": 5}},
    ],
)
def test_boundary_values_are_accepted(overrides: dict[str, dict[str, Any]]) -> None:
    config = load_config(env={}, overrides=overrides)
    for section, values in overrides.items():
        for key, value in values.items():
            assert getattr(getattr(config, section), key) == value


@pytest.mark.parametrize(
    ("section", "key", "bad", "choices"),
    [
        ("engine", "dtype", "int8", "bfloat16, float16, float32, auto"),
        ("logging", "level", "verbose", "debug, info, warning, error"),
        ("logging", "format", "xml", "text, json"),
        ("kv", "data_plane", "rdma", "tcp, grpc"),
        ("scheduler", "policy", "fastest", "symphony, recompute, sticky"),
    ],
)
def test_enumerated_keys_name_their_choices(section: str, key: str, bad: str, choices: str) -> None:
    with pytest.raises(ConfigError, match=rf"^command line: {section}\.{key}: expected one of {choices}"):
        load_config(env={}, overrides={section: {key: bad}})
    var = f"SYMPHONY_{section}_{key}".upper()
    with pytest.raises(ConfigError, match=rf"^{var}: expected one of {choices}.*, got '{bad}'$"):
        load_config(env={var: bad})


def test_enumerated_keys_take_any_case_and_keep_the_canonical_name() -> None:
    config = load_config(env={"SYMPHONY_LOGGING_LEVEL": "DEBUG"}, overrides={"kv": {"data_plane": "GRPC"}})
    assert (config.logging.level, config.kv.data_plane) == ("debug", "grpc")


def test_policy_names_in_the_config_are_the_registered_policies() -> None:
    from scheduler.policies import POLICIES
    from symphony.config import PolicyName

    assert set(typing.get_args(PolicyName)) == set(POLICIES)


def test_invalid_value_from_env_is_validated_too() -> None:
    with pytest.raises(ConfigError, match=r"^engine\.block_size:"):
        load_config(env={"SYMPHONY_ENGINE_BLOCK_SIZE": "16"})


# -- file errors ------------------------------------------------------------------------------------
def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="not found") as excinfo:
        load_config(missing, env={})
    assert str(missing) in str(excinfo.value)


def test_invalid_toml_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[scheduler\nport = \n")
    with pytest.raises(ConfigError, match="invalid TOML") as excinfo:
        load_config(path, env={})
    assert str(path) in str(excinfo.value)


def test_directory_instead_of_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(tmp_path, env={})


# -- dump round trip --------------------------------------------------------------------------------
def test_dump_then_load_gives_equal_default_config(tmp_path: Path) -> None:
    config = load_config(env={"SYMPHONY_HOME": str(tmp_path)})
    path = write_toml(tmp_path, dump_toml(config), "effective.toml")
    assert load_config(path, env={}) == config


def test_dump_then_load_gives_equal_config_with_every_kind_of_value(tmp_path: Path) -> None:
    base = load_config(
        env={},
        overrides={
            "cluster": {"nodes": 3},
            "scheduler": {
                "node_addresses": ["10.0.0.1:50051", "[::1]:50052"],
                "connect_timeout_s": 0.25,
                "advisory_ttl_s": 1e-3,
            },
            "engine": {
                "model": '/models/my "quoted" model',
                "served_model_name": "modèle-ünï \\ tab\t",
                "enforce_eager": False,
                "extra_args": ["--seed", "7", '--json={"a": [1, 2]}'],
            },
            "logging": {"level": "debug", "format": "json"},
        },
    )
    config = dataclasses.replace(base, home=str(tmp_path / "home with space"))
    path = write_toml(tmp_path, dump_toml(config), "effective.toml")
    loaded = load_config(path, env={})
    assert loaded == config
    assert isinstance(loaded.scheduler.connect_timeout_s, float)


# -- helpers ----------------------------------------------------------------------------------------
def test_node_grpc_address_and_engine_port_offset_by_index() -> None:
    config = load_config(
        env={}, overrides={"node": {"host": "10.1.2.3", "grpc_port_base": 6000, "engine_port_base": 7000}}
    )
    assert config.node_grpc_address(0) == "10.1.2.3:6000"
    assert config.node_grpc_address(2) == "10.1.2.3:6002"
    assert config.engine_port(0) == 7000
    assert config.engine_port(3) == 7003
    assert config.node_grpc_listen(2) == "10.1.2.3:6002" and config.engine_advertised_url(1) == "http://10.1.2.3:7001"
    assert config.kv_advertised_data_port(1, listening=41234) == 41234


def test_a_node_behind_a_proxy_is_advertised_there_and_listens_where_it_always_did() -> None:
    config = load_config(
        env={},
        overrides={
            "node": {
                "host": "10.1.2.3",
                "grpc_port_base": 6000,
                "engine_port_base": 7000,
                "advertise_host": "gw.example",
                "advertise_grpc_port_base": 16000,
                "advertise_engine_port_base": 17000,
                "advertise_data_port_base": 18000,
            },
            "kv": {"data_port_base": 19000},
        },
    )
    assert config.node_grpc_address(1) == "gw.example:16001"  # membership, the schedulers' node list
    assert config.node_grpc_listen(1) == "10.1.2.3:6001"
    assert config.engine_port(1) == 7001 and config.engine_advertised_url(1) == "http://gw.example:17001"
    assert config.kv_advertised_data_port(1, listening=41234) == 18001
    assert config_hosts(config) == ["10.1.2.3", "gw.example"]  # the member certificate names both
    with pytest.raises(ConfigError, match=r"node\.advertise_engine_port_base"):
        load_config(env={}, overrides={"node": {"advertise_engine_port_base": 65535}, "cluster": {"nodes": 2}})
    with pytest.raises(ConfigError, match=r"node\.advertise_data_port_base: needs kv\.data_port_base"):
        load_config(env={}, overrides={"node": {"advertise_data_port_base": 18000}})


def test_engine_events_endpoints_are_private_ipc_sockets_one_per_running_node() -> None:
    one = load_config(env={}, overrides={"cluster": {"nodes": 2}, "node": {"grpc_port_base": 6000}})
    other = load_config(env={}, overrides={"cluster": {"nodes": 2}, "node": {"grpc_port_base": 7000}})
    endpoints = [one.engine_events_endpoint(0), one.engine_events_endpoint(1), other.engine_events_endpoint(0)]
    assert len(set(endpoints)) == 3  # two nodes of a cluster, and two local clusters, never share one
    for index, endpoint in enumerate(endpoints[:2]):
        assert endpoint.startswith("ipc://")
        path = Path(endpoint.removeprefix("ipc://"))
        assert path.parent == one.kv_socket_path(index).parent  # beside the node's KV channel
        assert path != one.kv_socket_path(index)
        assert len(str(path).encode()) < 108  # a Unix socket path's limit


def test_scheduler_node_addresses_derived_from_cluster_when_not_listed() -> None:
    config = load_config(env={}, overrides={"cluster": {"nodes": 3}, "node": {"host": "h", "grpc_port_base": 6000}})
    assert config.scheduler_node_addresses() == ["h:6000", "h:6001", "h:6002"]


def test_scheduler_node_addresses_explicit_list_wins_and_is_a_copy() -> None:
    config = load_config(env={}, overrides={"cluster": {"nodes": 3}, "scheduler": {"node_addresses": ["a:1", "b:2"]}})
    addresses = config.scheduler_node_addresses()
    assert addresses == ["a:1", "b:2"]
    addresses.append("c:3")
    assert config.scheduler_node_addresses() == ["a:1", "b:2"]


def test_with_etcd_a_scheduler_starts_with_the_nodes_given_or_none() -> None:
    etcd = {"etcd_endpoints": ["http://127.0.0.1:2379"]}
    assert load_config(env={}, overrides={"cluster": etcd}).scheduler_node_addresses() == []
    given = load_config(env={}, overrides={"cluster": etcd, "scheduler": {"node_addresses": ["a:1"]}})
    assert given.scheduler_node_addresses() == ["a:1"]


@pytest.mark.parametrize(
    ("cluster", "scheduler", "message"),
    [
        ({"etcd_endpoints": ["127.0.0.1:2379"]}, {}, r"cluster\.etcd_endpoints: '127\.0\.0\.1:2379' is not an etcd"),
        ({"etcd_endpoints": ["http://h:2379/v3"]}, {}, r"cluster\.etcd_endpoints: 'http://h:2379/v3'"),
        ({"etcd_endpoints": ["http://h:1"] * 17}, {}, r"cluster\.etcd_endpoints: at most 16"),
        ({"etcd_prefix": "symphony"}, {}, r"cluster\.etcd_prefix: 'symphony' must start with /"),
        ({"membership_ttl_s": 1}, {}, r"cluster\.membership_ttl_s: 1 outside 2\.\.600"),
        ({}, {"membership_poll_ms": 10}, r"scheduler\.membership_poll_ms: 10 outside 50\.\.60000"),
    ],
)
def test_coordination_settings_are_checked(cluster: dict[str, Any], scheduler: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, overrides={"cluster": cluster, "scheduler": scheduler})


def test_scheduler_url_uses_host_and_port() -> None:
    config = load_config(env={}, overrides={"scheduler": {"host": "0.0.0.0", "port": 9100}})
    assert config.scheduler_url == "http://0.0.0.0:9100"


def test_config_is_frozen() -> None:
    config = SymphonyConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.scheduler.port = 1  # type: ignore[misc]


def test_replicas_need_etcd_and_one_region(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"scheduler\.replicas: 2 replicas share their state through etcd"):
        load_config(env={}, overrides={"scheduler": {"replicas": 2}})
    with pytest.raises(ConfigError, match=r"cluster\.ha: scheduler replicas with regions\.layout"):
        load_config(
            env={},
            overrides={
                "cluster": {"ha": True, "nodes": 2},
                "regions": {"layout": ["a:1", "b:1"], "links": ["a~b:10:1000"]},
                "kv": {"data_plane": "grpc"},
            },
        )
    with pytest.raises(ConfigError, match=r"ports: .*overlap at \[8001\]"):
        load_config(
            env={},
            overrides={"cluster": {"ha": True}, "scheduler": {"replicas": 2}, "node": {"engine_port_base": 8001}},
        )
    # cluster.ha without an etcd named: `symphony up` starts one and names it to its processes.
    config = load_config(env={"SYMPHONY_HOME": str(tmp_path)}, overrides={"cluster": {"ha": True}})
    assert config.scheduler_node_addresses() == ["127.0.0.1:50051", "127.0.0.1:50052"]


def test_the_scheduler_keeps_idle_connections_longer_than_the_openai_clients_pool() -> None:
    """The bound the check holds keep_alive_s to is the one the `openai` client has: a client's
    pool reusing a connection as the server closes it breaks a request."""
    expiry = DEFAULT_CONNECTION_LIMITS.keepalive_expiry  # None would be: reused for ever
    assert expiry is not None and expiry <= CLIENT_POOL_KEEPALIVE_S
    assert load_config(env={}).scheduler.keep_alive_s > CLIENT_POOL_KEEPALIVE_S
    with pytest.raises(ConfigError, match=r"scheduler\.keep_alive_s: 5 s: must be over 5 s"):
        load_config(env={}, overrides={"scheduler": {"keep_alive_s": 5}})

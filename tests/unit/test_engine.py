"""node_manager.engine.engine_launch: the vLLM server command line and environment."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from node_manager.engine import EngineLaunch, engine_cpu_cores, engine_launch
from node_manager.engine_auth import ENGINE_KEY_ENV
from node_manager.vllm_plugin import AMX_ATTENTION_ENV, DIES_WITH_PARENT_ENV, PARENT_ENV
from symphony.config import CLIENT_POOL_KEEPALIVE_S, EngineConfig
from symphony.models import ModelInfo

MODEL = ModelInfo(path=Path("/models/SmolLM2"), served_name="smol")


def option(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} should appear exactly once in {argv}"
    return argv[argv.index(flag) + 1]


def launch(engine: EngineConfig | None = None, base_env: dict[str, str] | None = None) -> EngineLaunch:
    return engine_launch(
        engine or EngineConfig(), MODEL, "10.0.0.7", 8123, base_env={} if base_env is None else base_env
    )


def test_argv_runs_the_openai_api_server_module_with_this_python() -> None:
    argv = launch(EngineConfig(nice=0)).argv
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def test_the_engine_runs_niced_so_the_scheduler_and_node_manager_keep_their_cores() -> None:
    assert launch(EngineConfig(nice=7)).nice == 7  # applied by ManagedProcess (tests/integration/test_process.py)
    assert launch(EngineConfig(nice=0)).nice == 0


def test_argv_carries_model_and_engine_settings() -> None:
    engine = EngineConfig(dtype="float16", block_size=64, max_model_len=2048)
    argv = launch(engine).argv
    assert option(argv, "--model") == str(MODEL.path)
    assert option(argv, "--served-model-name") == "smol"
    assert option(argv, "--host") == "10.0.0.7"
    assert option(argv, "--port") == "8123"
    assert option(argv, "--block-size") == "64"
    assert option(argv, "--max-model-len") == "2048"
    assert option(argv, "--dtype") == "float16"


@pytest.mark.parametrize(("enforce_eager", "present"), [(True, True), (False, False)])
def test_enforce_eager_flag_only_when_configured(enforce_eager: bool, present: bool) -> None:
    argv = launch(EngineConfig(enforce_eager=enforce_eager)).argv
    assert ("--enforce-eager" in argv) is present


def test_max_num_seqs_is_passed_when_set_and_extra_args_override_what_the_region_counts() -> None:
    assert "--max-num-seqs" not in launch(EngineConfig()).argv  # 0: vLLM's own default
    assert EngineConfig().max_running() == 128  # vLLM CPU's, which the region counts
    argv = launch(EngineConfig(max_num_seqs=64)).argv
    assert argv[argv.index("--max-num-seqs") + 1] == "64"
    assert EngineConfig(max_num_seqs=64).max_running() == 64
    # vLLM reads the command line's last, in either spelling; a value that is no count is vLLM's to refuse
    assert EngineConfig(max_num_seqs=64, extra_args=["--max-num-seqs", "8"]).max_running() == 8
    assert EngineConfig(extra_args=["--max_num_seqs=16", "--max-num-seqs=32"]).max_running() == 32
    assert EngineConfig(extra_args=["--max-num-seqs", "lots"]).max_running() == 128
    # What the scheduler holds its own requests back at: only a count set here (vLLM's default
    # depends on its build and GPU).
    assert EngineConfig().max_running_set() == 0
    assert EngineConfig(extra_args=["--max-num-seqs", "lots"]).max_running_set() == 0
    assert EngineConfig(max_num_seqs=64).max_running_set() == 64
    assert EngineConfig(extra_args=["--max_num_seqs=16"]).max_running_set() == 16


def test_extra_args_are_appended_last_in_order() -> None:
    extra = ["--seed", "7", "--max-num-seqs", "8"]
    argv = launch(EngineConfig(extra_args=extra)).argv
    assert argv[-len(extra) :] == extra
    assert argv.index("--enforce-eager") < len(argv) - len(extra)


def test_env_sets_kv_cache_space_and_offline_flags() -> None:
    env = launch(EngineConfig(kv_cache_space_gib=6)).env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "6"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["TRANSFORMERS_OFFLINE"] == "1"
    # Idle connections kept past httpx's pools' 5 s: none is closed as it is reused.
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) > CLIENT_POOL_KEEPALIVE_S


def test_env_keeps_base_env_entries_and_does_not_mutate_it() -> None:
    base = {"PATH": "/opt/bin", "OMP_NUM_THREADS": "4"}
    env = launch(base_env=base).env
    assert env["PATH"] == "/opt/bin"
    assert env["OMP_NUM_THREADS"] == "4"
    assert base == {"PATH": "/opt/bin", "OMP_NUM_THREADS": "4"}


def test_env_overrides_conflicting_base_entries() -> None:
    env = launch(
        EngineConfig(kv_cache_space_gib=2), base_env={"VLLM_CPU_KVCACHE_SPACE": "99", "HF_HUB_OFFLINE": "0"}
    ).env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["HF_HUB_OFFLINE"] == "1"


def test_the_engine_is_named_no_parent_to_check_its_own_against() -> None:
    """A node manager started from an engine's process (a test, a script) inherits PARENT_ENV; its
    engine's API server must not compare its parent with that (symphony.pdeathsig_exec does)."""
    env = launch(base_env={PARENT_ENV: "12345"}).env
    assert PARENT_ENV not in env and env[DIES_WITH_PARENT_ENV] == "1"


def test_empty_base_env_does_not_inherit_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYMPHONY_TEST_MARKER", "leak")
    assert "SYMPHONY_TEST_MARKER" not in launch(base_env={}).env


def test_no_base_env_inherits_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYMPHONY_TEST_MARKER", "inherited")
    env = engine_launch(EngineConfig(), MODEL, "127.0.0.1", 8100).env
    assert env["SYMPHONY_TEST_MARKER"] == "inherited"


def test_url_is_http_host_port() -> None:
    assert launch().url == "http://10.0.0.7:8123"


@pytest.mark.parametrize(
    ("setting", "nodes", "cpus", "expected"),
    [
        ("auto", 2, 2, ["0", "1"]),  # one core each, where vLLM would put both on core 0
        ("auto", 2, 16, ["0-7", "8-15"]),
        ("auto", 3, 2, ["0", "1", "0"]),  # more engines than cores: shared round the cores
        ("auto", 1, 8, [""]),  # one engine: vLLM's own choice (it reserves a core for its frontend)
        ("vllm", 2, 2, ["", ""]),
        ("0-3|4-7", 2, 8, ["0-3", "4-7"]),
    ],
)
def test_cpu_engines_get_cores_of_their_own(setting: str, nodes: int, cpus: int, expected: list[str]) -> None:
    assert [engine_cpu_cores(setting, i, nodes, cpus) for i in range(nodes)] == expected


def test_cpu_cores_reach_vllm_only_when_chosen() -> None:
    assert (
        engine_launch(EngineConfig(), MODEL, "h", 1, base_env={}, cpu_cores="1").env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    )
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_launch(EngineConfig(), MODEL, "h", 1, base_env={}).env


def test_engines_keep_off_the_amx_attention_kernel_unless_configured() -> None:
    assert launch(base_env={}).env[AMX_ATTENTION_ENV] == "0"
    assert launch(EngineConfig(cpu_amx_attention=True), base_env={}).env[AMX_ATTENTION_ENV] == "1"


def test_kv_events_are_published_on_the_given_endpoint_with_prefix_caching_on() -> None:
    endpoint = "ipc:///tmp/symphony-1000-node-0-50051.events"
    argv = engine_launch(EngineConfig(extra_args=["--seed", "1"]), MODEL, "h", 1, kv_events_endpoint=endpoint).argv
    events = json.loads(option(argv, "--kv-events-config"))
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    assert events["endpoint"] == endpoint and events["replay_endpoint"] is None
    assert "--enable-prefix-caching" in argv
    assert argv.index("--kv-events-config") < argv.index("--seed")  # extra_args still come last and win
    plain = launch().argv
    assert "--kv-events-config" not in plain and "--enable-prefix-caching" not in plain


def test_with_a_key_the_engine_loads_the_guard_and_holds_its_key_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_KEY_ENV, "a key from the caller's environment")  # scrubbed, then set
    keyed = engine_launch(EngineConfig(), MODEL, "h", 1, api_key="k" * 48)
    assert option(keyed.argv, "--middleware") == "node_manager.engine_auth.EngineKeyGuard"
    assert keyed.env[ENGINE_KEY_ENV] == "k" * 48
    assert keyed.headers == {"Authorization": f"Bearer {'k' * 48}"}
    assert "k" * 48 not in " ".join(keyed.argv)  # not in `ps`
    plain = engine_launch(EngineConfig(), MODEL, "h", 1)
    assert "--middleware" not in plain.argv and ENGINE_KEY_ENV not in plain.env and plain.headers == {}

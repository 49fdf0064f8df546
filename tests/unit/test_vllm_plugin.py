"""The vLLM plugin that keeps the engines' CPU attention off vLLM's AMX kernel, and the page layout
(attention kernel included) the model fingerprint covers: on the real vLLM module, with the host's
AMX support stubbed so that the choice can be seen on any CPU."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from vllm.v1.attention.backends import cpu_attn

from node_manager import vllm_plugin
from node_manager.connector.worker import WorkerSide, cache_page_layout
from node_manager.identity import served_page_layout
from node_manager.kv.ipc_server import LocalKVServer
from node_manager.vllm_plugin import AMX_ATTENTION_ENV
from symphony.config import EngineConfig
from symphony.kv_geometry import smollm2_geometry
from tests.helpers import OTHER_MODEL, TEST_MODEL
from tests.unit.kv_store_support import GEOMETRY, MakeStore


@pytest.fixture
def amx_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", cpu_attn._get_attn_isa)  # restored after the test


def test_vllm_picks_amx_on_such_a_host(amx_host: None) -> None:
    assert cpu_attn._get_attn_isa(torch.bfloat16, 32, 64) == "amx"  # what the plugin is there to steer


def test_symphony_engines_get_the_vector_kernel(amx_host: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AMX_ATTENTION_ENV, "0")
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may load plugins more than once in a process
    assert cpu_attn._get_attn_isa(torch.bfloat16, 32, 64) == "vec"
    assert cpu_attn._get_attn_isa(torch.float32, 32, 64) == "vec"  # other choices are left alone
    assert cpu_attn._get_attn_isa(torch.bfloat16, 32, 80) == "vec16"


@pytest.mark.parametrize("setting", [None, "1"])
def test_other_vllm_processes_are_left_alone(
    amx_host: None, monkeypatch: pytest.MonkeyPatch, setting: str | None
) -> None:
    if setting is None:
        monkeypatch.delenv(AMX_ATTENTION_ENV, raising=False)
    else:
        monkeypatch.setenv(AMX_ATTENTION_ENV, setting)
    vllm_plugin.register()
    assert cpu_attn._get_attn_isa(torch.bfloat16, 32, 64) == "amx"


# ---- the page layout the model fingerprint covers -------------------------------------------------


@pytest.mark.parametrize("amx_supported", [True, False], ids=["amx-host", "other-host"])
@pytest.mark.parametrize("allowed", [True, False], ids=["amx-allowed", "amx-steered"])
def test_the_declared_layout_is_the_one_vllm_packs(
    monkeypatch: pytest.MonkeyPatch, amx_supported: bool, allowed: bool
) -> None:
    """The node manager declares the layout without vLLM; the connector reads it off vLLM. They must
    agree on every host and setting, or the engine refuses to start."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx_supported)
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", cpu_attn._get_attn_isa)  # restored after the test
    monkeypatch.setenv(AMX_ATTENTION_ENV, "1" if allowed else "0")
    vllm_plugin.register()
    geometry = smollm2_geometry(32)
    for dtype in (torch.bfloat16, torch.float16):
        kv = torch.zeros(2, geometry.kv_heads, geometry.block_size, 2 * geometry.head_size, dtype=dtype)
        served = replace(geometry, dtype=str(dtype).removeprefix("torch."))
        assert cache_page_layout(kv, served, "auto") == served_page_layout(
            EngineConfig(cpu_amx_attention=allowed), served
        )


def test_a_worker_attaches_only_to_its_models_store_and_a_cache_in_the_declared_layout(
    make_store: MakeStore, tmp_path: Path
) -> None:
    server = LocalKVServer(make_store(hbm_pages=0), tmp_path / "kv.sock")
    cache = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(
            8, GEOMETRY.kv_heads, GEOMETRY.block_size, 2 * GEOMETRY.head_size, dtype=torch.bfloat16
        )
        for i in range(GEOMETRY.num_layers)
    }
    declared = cache_page_layout(cache["model.layers.0.self_attn.attn"], GEOMETRY, "auto")
    half = {name: kv.to(torch.float16) for name, kv in cache.items()}  # same bytes per page, other values
    try:
        for model, kv_caches, refusal in (
            (TEST_MODEL, cache, None),
            (TEST_MODEL, half, "laid out as"),
            (OTHER_MODEL, cache, "tiers are not used"),
        ):
            worker = WorkerSide(str(server.path), 1.0, model, declared)
            try:
                if refusal is None:
                    worker.register(kv_caches)
                else:
                    with pytest.raises(ValueError, match=refusal):
                        worker.register(kv_caches)
            finally:
                worker.close()
    finally:
        server.close()

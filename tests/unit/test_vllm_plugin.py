"""The vLLM plugin that keeps the engines' CPU attention off vLLM's AMX kernel: on the real vLLM
module, with the host's AMX support stubbed so that the choice can be seen on any CPU."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.attention.backends import cpu_attn

from node_manager import vllm_plugin
from node_manager.vllm_plugin import AMX_ATTENTION_ENV


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
def test_other_vllm_processes_are_left_alone(amx_host: None, monkeypatch: pytest.MonkeyPatch,
                                             setting: str | None) -> None:
    if setting is None:
        monkeypatch.delenv(AMX_ATTENTION_ENV, raising=False)
    else:
        monkeypatch.setenv(AMX_ATTENTION_ENV, setting)
    vllm_plugin.register()
    assert cpu_attn._get_attn_isa(torch.bfloat16, 32, 64) == "amx"

"""A vLLM general plugin (entry point `vllm.general_plugins`, see pyproject.toml). vLLM loads it in
each of its processes (API server, engine core, workers); it acts only in the engines Symphony
launches, which set AMX_ATTENTION_ENV.

What it does:
- every process of an engine started with DIES_WITH_PARENT_ENV dies (SIGKILL) when its parent
  does. The API server gets that from `symphony.pdeathsig_exec` when its node manager dies; vLLM's
  engine core and workers, its children, would otherwise outlive it, holding memory and CPU
  (`symphony bench faults`: a node manager killed with -9 left its engine core and worker running).
- keeps vLLM's CPU attention off its AMX kernel, which vLLM 0.32 picks by itself on CPUs
with AMX (Sapphire Rapids and later) for bfloat16 with blocks of 32, and which gave wrong greedy
answers there (docs/design-notes.md#amx-attention). The vector kernel serves the same dtype, block
size and KV cache.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

from symphony.pdeathsig_exec import set_death_signal

AMX_ATTENTION_ENV = "SYMPHONY_CPU_AMX_ATTENTION"  # "0": vLLM's CPU attention avoids its AMX kernel
DIES_WITH_PARENT_ENV = "SYMPHONY_ENGINE_DIES_WITH_PARENT"  # "1": each engine process dies with its parent

log = logging.getLogger("symphony.vllm_plugin")


def without_amx(choose_isa: Callable[..., str]) -> Callable[..., str]:
    """`choose_isa` (vLLM's `_get_attn_isa`), but the vector kernel where it would pick AMX."""

    def choose(*args: Any, **kwargs: Any) -> str:
        isa = choose_isa(*args, **kwargs)
        if isa != "amx":
            return isa
        if not getattr(choose, "warned", False):
            log.warning(
                "Symphony: CPU attention on vLLM's vector kernel, not AMX (engine.cpu_amx_attention "
                "= false): vLLM 0.32's AMX kernel gave wrong answers (node_manager/vllm_plugin.py)"
            )
            choose.warned = True  # type: ignore[attr-defined]  # a mark on the function: warn once
        return "vec"

    choose.wraps_without_amx = True  # type: ignore[attr-defined]  # a mark: steering is installed once
    return choose


def die_with_parent() -> None:
    """This process gets SIGKILL when the thread that started it ends (its parent process dying,
    for vLLM's processes, each started from its parent's main thread)."""
    if not set_death_signal(signal.SIGKILL):
        log.warning("Symphony: this engine process will not die with its parent (prctl failed)")


_at_fork = False  # die_with_parent registered for forked children (once per process)


def register() -> None:
    global _at_fork
    if os.environ.get(DIES_WITH_PARENT_ENV) == "1":
        die_with_parent()
        # A child vLLM forks (its start method where CUDA is not yet initialised) loses the
        # death signal at fork and inherits "plugins loaded", so it would never call this again.
        if not _at_fork:
            os.register_at_fork(after_in_child=die_with_parent)
            _at_fork = True
    if os.environ.get(AMX_ATTENTION_ENV, "1") != "0":
        return
    try:
        from vllm.v1.attention.backends import cpu_attn
    except ImportError:  # a build without the CPU backend (GPU wheels): nothing to steer
        return
    if not getattr(cpu_attn._get_attn_isa, "wraps_without_amx", False):  # loaded once per process, or more
        # Both callers (the attention backend and the platform's KV cache packing) look the name up
        # in the module when they run, so both see the same choice.
        cpu_attn._get_attn_isa = without_amx(cpu_attn._get_attn_isa)

"""A vLLM general plugin (entry point `vllm.general_plugins`, see pyproject.toml). vLLM loads it in
each of its processes (API server, engine core, workers); it acts only in the engines Symphony
launches, which set AMX_ATTENTION_ENV.

What it does:
- every process of an engine started with DIES_WITH_PARENT_ENV dies (SIGKILL) when its parent
  does. The API server gets that from `symphony.pdeathsig_exec` when its node manager dies; vLLM's
  engine core and workers, its children, would otherwise outlive it, holding memory and CPU
  (`symphony bench faults`: a node manager killed with -9 left its engine core and worker running).
  A process whose parent died before it armed that (vLLM's children load plugins seconds after they
  start) kills itself: PARENT_ENV, which each process sets for the ones it starts, names the parent
  it must still have.
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
from symphony.process import pid_running

AMX_ATTENTION_ENV = "SYMPHONY_CPU_AMX_ATTENTION"  # "0": vLLM's CPU attention avoids its AMX kernel
DIES_WITH_PARENT_ENV = "SYMPHONY_ENGINE_DIES_WITH_PARENT"  # "1": each engine process dies with its parent
# The pid of the process that started this one, as that process set it for its children; unset in
# the API server (symphony.pdeathsig_exec checked its parent before the exec).
PARENT_ENV = "SYMPHONY_ENGINE_PARENT_PID"

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


def die_with_parent(parent: int | None) -> None:
    """This process gets SIGKILL when the thread that started it ends (its parent process dying,
    for vLLM's processes, each started from its parent's main thread). `parent`: the pid it was
    started by; when that is no longer its parent and has ended, it died before the signal was
    armed, and this process gets SIGKILL now. (One still running is not this process's parent when
    a process vLLM started before loading plugins started this one: its parent then dies with it.)
    Then the processes this one starts are told its pid (PARENT_ENV)."""
    if not set_death_signal(signal.SIGKILL):
        log.warning("Symphony: this engine process will not die with its parent (prctl failed)")
    if parent is not None and os.getppid() != parent and not pid_running(parent):
        os.kill(os.getpid(), signal.SIGKILL)  # orphaned already: what the death signal would have done
    os.environ[PARENT_ENV] = str(os.getpid())


_at_fork = False  # die_with_parent registered for forked children (once per process)
_forking: int | None = None  # the pid of the process forking, as its child sees it


def _before_fork() -> None:
    global _forking
    _forking = os.getpid()


def _after_fork_in_child() -> None:
    die_with_parent(_forking)


def _parent_named() -> int | None:
    value = os.environ.get(PARENT_ENV, "")
    return int(value) if value.isdigit() else None


def register() -> None:
    global _at_fork
    if os.environ.get(DIES_WITH_PARENT_ENV) == "1":
        die_with_parent(_parent_named())
        # A child vLLM forks (its start method where CUDA is not yet initialised) loses the
        # death signal at fork and inherits "plugins loaded", so it would never call this again.
        if not _at_fork:
            os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
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

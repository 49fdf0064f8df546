"""The vLLM plugin's death signal: a process that loads it with DIES_WITH_PARENT_ENV set (as each
of an engine's processes does: API server, engine core, workers) dies when its parent is killed
with -9, where vLLM's engine core used to stay (`symphony bench faults`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from node_manager.vllm_plugin import DIES_WITH_PARENT_ENV
from symphony.process import proc_stat_fields
from tests.helpers import wait_until

# The parent starts a child that loads the plugin, prints the child's pid, and waits to be killed.
CHILD = (
    "from node_manager import vllm_plugin; import time; vllm_plugin.register(); "
    "print('ready', flush=True); time.sleep(120)"
)
PARENT = (
    "import subprocess, sys, time\n"
    f"child = subprocess.Popen([sys.executable, '-c', {CHILD!r}], stdout=subprocess.PIPE, text=True)\n"
    "child.stdout.readline()\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def _alive(pid: int) -> bool:
    fields = proc_stat_fields(pid)
    return fields is not None and fields[0] != "Z"


# A process that loads the plugin and then forks (vLLM's start method where CUDA is not yet
# initialised): the forked child has lost the death signal and will not load plugins again.
FORKING = (
    "from node_manager import vllm_plugin; import os, time\n"
    "vllm_plugin.register()\n"
    "armed, tell = os.pipe()\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"  # os.fork returns here after the at-fork handlers ran in this child
    "    os.write(tell, b'x')\n"
    "    time.sleep(120)\n"
    "    os._exit(0)\n"
    "os.read(armed, 1)\n"
    "print(pid, flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.mark.parametrize("script", [PARENT, FORKING], ids=["started", "forked"])
def test_a_process_of_an_engine_dies_with_its_killed_parent(script: str) -> None:
    """`script` prints the pid of a child of its own (started, or forked after loading the plugin)
    and waits to be killed."""
    env = {**os.environ, DIES_WITH_PARENT_ENV: "1"}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait(10)
        wait_until(lambda: not _alive(child), 10, "the child to get its death signal")
    finally:
        parent.kill()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)

"""The vLLM plugin's death signal: a process that loads it with DIES_WITH_PARENT_ENV set (as each
of an engine's processes does: API server, engine core, workers) dies when its parent is killed
with -9, where vLLM's engine core used to stay (`symphony bench faults`), and one orphaned before it
loaded the plugin dies when it does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from node_manager.vllm_plugin import DIES_WITH_PARENT_ENV, PARENT_ENV
from symphony.process import pid_running
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
        assert pid_running(child)
        parent.kill()
        parent.wait(10)
        wait_until(lambda: not pid_running(child), 10, "the child to get its death signal")
    finally:
        parent.kill()
        if child and pid_running(child):
            os.kill(child, signal.SIGKILL)


# A process of an engine (the API server, here) starts a child that loads the plugin only after
# its parent died, as vLLM's engine core may (it loads plugins seconds after it starts): armed then,
# the death signal would wait for a parent it no longer has.
LATE_CHILD = (
    "import os, sys, time\n"
    "parent = int(sys.argv[2])\n"
    "deadline = time.monotonic() + 30\n"
    "while os.getppid() == parent and time.monotonic() < deadline:\n"  # the parent exits first
    "    time.sleep(0.01)\n"
    "from node_manager import vllm_plugin\n"
    "vllm_plugin.register()\n"
    "open(sys.argv[1], 'w').write('survived')\n"
    "time.sleep(120)\n"
)
STARTS_AND_EXITS = (
    "import os, subprocess, sys\n"
    "from node_manager import vllm_plugin\n"
    "vllm_plugin.register()\n"  # an engine process: its children are told its pid
    # The child holds no end of this process's pipes: the test reads them to their end.
    f"argv = [sys.executable, '-c', {LATE_CHILD!r}, sys.argv[1], str(os.getpid())]\n"
    "child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    "print(child.pid, flush=True)\n"
)


def test_a_process_orphaned_before_it_loads_the_plugin_dies_when_it_does(tmp_path: Path) -> None:
    survived = tmp_path / "survived"
    env = {**os.environ, DIES_WITH_PARENT_ENV: "1"}
    env.pop(PARENT_ENV, None)
    parent = subprocess.run(
        [sys.executable, "-c", STARTS_AND_EXITS, str(survived)], capture_output=True, text=True, env=env, timeout=60
    )
    assert parent.returncode == 0, parent.stderr
    child = int(parent.stdout)
    try:
        wait_until(lambda: not pid_running(child) or survived.exists(), 30, "the orphan to load the plugin")
        assert not survived.exists(), "an orphaned engine process armed its death signal and lived on"
    finally:
        if pid_running(child):
            os.kill(child, signal.SIGKILL)


def test_a_process_named_a_parent_that_runs_on_is_not_killed() -> None:
    """A process vLLM started before it loaded plugins starts one that does: the parent named to the
    child (the test, here) is not its parent, but runs on; the child is no orphan and goes on."""
    child = "from node_manager import vllm_plugin; vllm_plugin.register(); print('went on')"
    between = f"import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', {child!r}]).returncode)"
    env = {**os.environ, DIES_WITH_PARENT_ENV: "1", PARENT_ENV: str(os.getpid())}
    done = subprocess.run([sys.executable, "-c", between], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "went on", (done.returncode, done.stderr)

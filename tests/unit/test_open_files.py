"""symphony.open_files: a process started with a low soft open-files limit raises it to its hard
limit (at most MAX_OPEN_FILES), and its children inherit the raised one; `symphony` does so first."""

from __future__ import annotations

import resource
import subprocess
import sys

from symphony.open_files import MAX_OPEN_FILES

LOW = 256
RAISE = "from symphony.open_files import raise_open_files_limit; print(raise_open_files_limit())"
CHILD = "import resource, subprocess, sys; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"


def _low_soft_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def _expected() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        with open("/proc/sys/fs/nr_open") as f:
            hard = int(f.read())
    return min(hard, MAX_OPEN_FILES)


def test_a_low_soft_limit_is_raised_and_children_inherit_it() -> None:
    assert _expected() > LOW  # else this host cannot show it
    script = f"{RAISE}; import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}])"
    done = subprocess.run(
        [sys.executable, "-c", script], preexec_fn=_low_soft_limit, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    raised, inherited = (int(line) for line in done.stdout.split())
    assert raised == inherited == _expected()


def test_the_cli_raises_it_before_any_command() -> None:
    script = (
        "import resource, sys; from symphony.cli import main; main(['config', 'show']);"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], file=sys.stderr)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], preexec_fn=_low_soft_limit, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stderr.split()[-1]) == _expected()

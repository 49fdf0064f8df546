"""`python -m symphony.pdeathsig_exec PARENT_PID [--nice N] [--death-signal SIG] ARGV...`: exec
ARGV so that it gets SIGTERM (or signal number SIG) when its parent dies, optionally at niceness N.

Supervised children are started through this instead of with a `preexec_fn`: running Python code
between fork and exec in a process that has gRPC threads runs gRPC's at-fork handlers in the child,
which can abort a freshly forked vLLM engine (docs/design-notes.md#supervised-children). This
costs one interpreter start per child, against an engine start of ~30 s.

Niceness is set twice, because a supervised child leads a session of its own (its process group
is what gets stopped). With the kernel's autogroup scheduling on (the default of most desktop and
many VM kernels), every session is one scheduling group: CPU is shared between groups first, and a
process's niceness only weighs against others of its session (docs/design-notes.md#engine-niceness).
So the session's own group gets the niceness too (`/proc/self/autogroup`, writable
by the owner to lower priority); where there is no autogroup the file is absent and plain niceness
is what counts.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
# Resolved once, at import: a forked child of a threaded process (the vLLM plugin's at-fork hook)
# must not take the dynamic loader's lock, which another thread may have held at the fork.
_LIBC = ctypes.CDLL(None, use_errno=True)
_USAGE = "usage: python -m symphony.pdeathsig_exec PARENT_PID [--nice N] [--death-signal SIG] COMMAND [ARG...]"


def set_death_signal(sig: int) -> bool:
    """Have this process get `sig` when the thread that started it ends; False if prctl failed."""
    return int(_LIBC.prctl(_PR_SET_PDEATHSIG, sig)) == 0


def lower_priority(nice: int) -> None:
    """This process (and what it execs) at niceness `nice`, its session's autogroup as well."""
    os.nice(nice - os.nice(0))
    # No autogroup scheduling here (no such file): the plain niceness is what counts.
    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as group:
        group.write(str(nice))


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit(_USAGE)
    parent, command = int(argv[0]), argv[1:]
    death_signal = int(signal.SIGTERM)
    while command and command[0] in ("--nice", "--death-signal"):
        if len(command) < 3 or not command[1].isdigit():
            sys.exit(_USAGE)
        if command[0] == "--nice":
            lower_priority(int(command[1]))
        else:
            death_signal = int(command[1])
            if death_signal not in set(signal.Signals):
                sys.exit(f"pdeathsig_exec: --death-signal {death_signal} is no signal")
        command = command[2:]
    if not command:
        sys.exit(_USAGE)
    if not set_death_signal(death_signal):
        sys.exit(f"pdeathsig_exec: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != parent:
        sys.exit(1)  # the parent died before the death signal was armed: nobody wants us any more
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])

"""`python -m symphony.pdeathsig_exec PARENT_PID ARGV...`: exec ARGV so that it gets SIGTERM when its
parent dies.

Supervised children are started through this instead of with a `preexec_fn`: running Python code
between fork and exec in a process that has gRPC threads runs gRPC's at-fork handlers in the child,
which here aborted a freshly forked vLLM engine (SIGABRT, "epoll_wait error: Bad file descriptor").
This costs one interpreter start per child, against an engine start of ~30 s.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -m symphony.pdeathsig_exec PARENT_PID COMMAND [ARG...]")
    parent, command = int(argv[0]), argv[1:]
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        sys.exit(1)  # the parent died before the death signal was armed: nobody wants us any more
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])

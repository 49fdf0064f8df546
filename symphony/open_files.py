"""The open-files limit of a Symphony process, raised to what the system allows.

A scheduler at `scheduler.max_inflight_requests` (1,024 by default) holds a client connection and an
engine connection per request, and its idle clients' connections for `scheduler.keep_alive_s`; a
node manager holds its peers' channels and SSD segments. The soft limit many systems start a
process with (1,024) is below that, and the first connection past it fails with EMFILE. The hard
limit is the administrator's bound, and stays.
"""

from __future__ import annotations

import resource
from pathlib import Path

_NR_OPEN = Path("/proc/sys/fs/nr_open")  # the kernel's ceiling on a process's open files (Linux)
# Ample for the bounds above, and no larger: a program that walks every possible fd (closing them
# before an exec, say) pays for the limit, not for what is open.
MAX_OPEN_FILES = 65_536


def raise_open_files_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE towards its hard limit (the kernel's ceiling when the
    hard one is unlimited), at most to MAX_OPEN_FILES, for itself and the children it starts after.
    Returns the soft limit now in force; one already as high, or that cannot be raised, stays."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(_NR_OPEN.read_text())
        except (OSError, ValueError):
            return soft
    target = min(target, MAX_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft
        return target
    return soft

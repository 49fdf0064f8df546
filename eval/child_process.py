"""Stopping a benchmark's helper process (a peer node manager, a policy's scheduler)."""

from __future__ import annotations

import subprocess
from typing import IO

STOP_TIMEOUT_S = 20.0  # a clean shutdown (closing stores and channels) takes well under this


def stop_child(process: subprocess.Popen[bytes], log: IO[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited in STOP_TIMEOUT_S; closes its log."""
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()

"""A benchmark's helper process (a peer node manager, a policy's scheduler, a global layer):
waiting for it to be ready, and stopping it."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import IO

import httpx

STOP_TIMEOUT_S = 20.0  # a clean shutdown (closing stores and channels) takes well under this


def stop_child(process: subprocess.Popen[bytes], log: IO[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited in STOP_TIMEOUT_S; closes its log."""
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()


async def await_ready(
    process: subprocess.Popen[bytes],
    what: str,
    log: IO[bytes],
    ready: Callable[[httpx.AsyncClient], Awaitable[bool]],
    not_ready: str,
    within_s: float = 60.0,
) -> None:
    """Until `ready` says so (an HTTP error or a malformed answer counts as not yet). RuntimeError
    naming `what` and its log when it exits first, or with `not_ready` after `within_s`; `ready`
    may raise RuntimeError itself to give up at once."""
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited; see {log.name}")
            try:
                if await ready(client):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{not_ready}; see {log.name}")
            await asyncio.sleep(0.2)  # polling a starting child process

"""A process that supervises one fake child and then waits to be killed (for the PDEATHSIG tests).
`python supervising_parent.py PORT LOG [kill]`: with `kill`, the child ignores SIGTERM and is given
SIGKILL as its death signal (as an engine is)."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import grpc
import httpx

from symphony.process import ManagedProcess


async def main(port: int, log_path: Path, kill: bool) -> None:
    # A live gRPC server, like the node manager's: forking next to its threads must be safe.
    server = grpc.aio.server()
    server.add_insecure_port("127.0.0.1:0")
    await server.start()

    async def serving() -> bool:  # ready only once the child runs the target program, past the exec
        async with httpx.AsyncClient(timeout=0.5) as client:
            try:
                return (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200
            except httpx.HTTPError:
                return False

    child = ManagedProcess(
        "child",
        [sys.executable, str(Path(__file__).with_name("fake_child.py")), "--port", str(port)]
        + (["--ignore-term"] if kill else []),
        log_path=log_path,
        ready_probe=serving,
        probe_interval_s=0.02,
        death_signal=signal.SIGKILL if kill else signal.SIGTERM,
    )
    child.start()
    await child.wait_ready(30)
    print(child.pid, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:] == ["kill"]))

"""A stand-in child process for supervision tests: serves /health, can crash, hang or leak shm.

Fault injection only: the real engine is exercised end to end in tests/e2e.
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--exit-code", type=int, help="exit at once with this status")
    parser.add_argument("--never-ready", action="store_true", help="never answer /health")
    parser.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM (forces SIGKILL)")
    parser.add_argument("--shm", help="create and map /dev/shm/<name>.<pid>")
    parser.add_argument(
        "--late-shm", help="once serving, create and map /dev/shm/psm_<name>.<pid> (as vLLM's multiprocessing does)"
    )
    parser.add_argument("--attach-shm", type=Path, help="map this existing /dev/shm file (as vLLM maps the arena)")
    parser.add_argument("--grandchild", action="store_true", help="spawn a long sleep in our process group")
    parser.add_argument(
        "--session-shm",
        help="spawn a descendant in a session of its own (as a node manager starts its engine) that, once we "
        "are up, creates and maps /dev/shm/<name>.<its pid> and waits",
    )
    parser.add_argument(
        "--session-linger-s",
        type=float,
        help="with --session-shm: the descendant outlives us this long (dying of a death signal takes a while)",
    )
    parser.add_argument("--unhealthy-flag", type=Path, help="answer 503 once this file exists")
    parser.add_argument("--pidfile", type=Path, help="append our pid (and the grandchild's) to this file")
    parser.add_argument("--metrics", type=Path, help="serve this file's text at /metrics (vLLM-style gauges)")
    parser.add_argument(
        "--filter-metrics",
        action="store_true",
        help="also serve /metrics/?name[]=... with only the named series, as vLLM does",
    )
    parser.add_argument("--request-log", type=Path, help="append every request's path to this file")
    args = parser.parse_args()

    if args.exit_code is not None:
        sys.exit(args.exit_code)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    keep = []
    if args.shm:
        path = f"/dev/shm/{args.shm}.{os.getpid()}"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        keep.append(mmap.mmap(fd, 4096))
    if args.attach_shm:
        with args.attach_shm.open("r+b") as fh:
            keep.append(mmap.mmap(fh.fileno(), 0))
    pids = [os.getpid()]
    if args.grandchild:
        pids.append(subprocess.Popen(["sleep", "600"]).pid)
    if args.session_shm:
        # After a pause: the shared memory appears only after we answer /health (an engine starts late).
        script = (
            "import mmap, os, signal, time; time.sleep(0.5); "
            f"p = '/dev/shm/{args.session_shm}.' + str(os.getpid()); "
            "fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600); os.ftruncate(fd, 4096); "
            "m = mmap.mmap(fd, 4096); "
        )
        if args.session_linger_s is None:
            script += "signal.pause()"
        else:  # until its parent is gone, then a while longer, holding the file: then gone, leaving it
            script += f"parent = {os.getpid()}\nwhile os.getppid() == parent: time.sleep(0.02)\n"
            script += f"time.sleep({args.session_linger_s})"
        pids.append(subprocess.Popen([sys.executable, "-c", script], start_new_session=True).pid)
    if args.pidfile:
        with args.pidfile.open("a") as fh:
            fh.write(" ".join(map(str, pids)) + "\n")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if args.request_log:
                with args.request_log.open("a") as log:
                    log.write(self.path + "\n")
            url = urlsplit(self.path)
            whole = url.path == "/metrics" and not url.query
            if args.metrics and (whole or (args.filter_metrics and url.path == "/metrics/")):
                names = parse_qs(url.query).get("name[]")
                lines = args.metrics.read_text().splitlines()
                body = "".join(
                    f"{line}\n" for line in lines if names is None or line.partition("{")[0].partition(" ")[0] in names
                ).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            healthy = not (args.unhealthy_flag and args.unhealthy_flag.exists())
            self.send_response(200 if healthy else 503)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    if args.late_shm:

        def late() -> None:  # after the supervisor's readiness scan: only a sweep can find it
            time.sleep(0.3)
            path = f"/dev/shm/psm_{args.late_shm}.{os.getpid()}"
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
            os.ftruncate(fd, 4096)
            keep.append(mmap.mmap(fd, 4096))

        threading.Thread(target=late, daemon=True).start()
    if args.never_ready:
        signal.pause()
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()

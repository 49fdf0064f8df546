"""Scenario 3 of the fault suite: a node's SSD tier broken on a real, small filesystem under load.

The last node's SSD directory is a tmpfs of `small_disk_bytes` (the configured headroom plus
`SMALL_DISK_ROOM`), mounted in a mount namespace of the bench's own (`unshare --mount`; for a user
other than root, with a user namespace too, which needs no privileges), so it vanishes with the
bench. The whole bench runs in that namespace (`reexec_in_namespace`), so the cluster's processes
and the bench see the same files.

Faults, one at a time, on that node, in an order drawn from the seed:
- `segment_corrupt`: in three of its segment files, one has a byte flipped in each page of its
  second half (pages whose MAC fails on load), one its header's magic (a format error at
  rebuild), one is cut to half its length; then the node manager is killed (SIGKILL) and restarts on the same directory
  (`eval.faults.crashes` runs the kill and probes the recovery);
- `disk_full`: a file from outside fills the filesystem to ENOSPC while the load goes on, and new
  conversations are sent until the node counts a save refused for the full disk; the node must
  keep serving, then save again once the file is gone;
- `dtype_change`: the node restarts with the engine's other dtype (another model fingerprint) on
  the same home, then with its own again. The load pauses meanwhile: its answers are compared with
  one dtype's reference.
Every answer of the load is then checked as in every scenario (no page that failed its MAC or its
checksum may have been served), and the node's own counters say what it found.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import httpx
from prometheus_client.parser import text_string_to_metric_families

from eval.faults.chats import ChatLoad
from eval.faults.crashes import CrashRunner, Fault
from node_manager.kv.segments import SUFFIX, parse_header
from symphony.config import SymphonyConfig, dump_toml
from symphony.config_schema import EngineDtype
from symphony.config_secrets import write_private
from symphony.process import ManagedProcess, ProcessState

# Root gets a mount namespace alone; anyone else a user namespace too (no privileges needed). In
# it the bench mounts a /dev/shm of its own (`private_shm`): no process outside, which a user
# namespace cannot read, can hold a file there, so the leak checks and the launcher's sweep
# (`symphony.shm_files.orphaned_shm`) see every holder.
ROOT_NAMESPACE = ["unshare", "--mount", "--propagation", "private"]
USER_NAMESPACE = ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]


def namespace_argv() -> list[str]:
    return ROOT_NAMESPACE if os.geteuid() == 0 else USER_NAMESPACE


# Set in the namespace the bench re-executed itself in: the mount namespace it left (its inode).
NAMESPACE_ENV = "SYMPHONY_FAULTS_LEFT_MOUNT_NS"
# What the tier may hold on the small disk past its headroom: more than the other scenarios' loads
# save there (so that the small disk changes nothing for them), little enough to fill at once.
SMALL_DISK_ROOM = 1 << 30
SEGMENTS_WANTED = 3  # segment files the corruption needs (one per kind of damage)
FILL_CHUNK = 4 << 20
SSD_FULL = "symphony_kv_save_degraded_total{reason=ssd_full}"  # pages a full disk kept off the SSD
NEW_CONVERSATIONS = 40  # sent at most for the node to save something (the load may be elsewhere)
SCRAPE_TRIES = 3  # a node's /metrics asked this many times before its counters count as unknown
OTHER_MODEL = "symphony_kv_ssd_segments_other_model_total"  # a `node_counters` key's start
SSD_WRITTEN = "symphony_kv_io_bytes_total{direction=write,tier=SSD}"  # a `node_counters` key
OTHER_DTYPE: dict[str, EngineDtype] = {
    "bfloat16": "float32",
    "float32": "bfloat16",
    "float16": "float32",
    "auto": "float32",
}


def small_disk_bytes(config: SymphonyConfig) -> int:
    return config.kv.ssd_headroom_bytes + SMALL_DISK_ROOM


def _mount_ns() -> str:
    return str(os.stat("/proc/self/ns/mnt").st_ino)


def in_namespace() -> bool:
    """Whether this process is the bench re-executed in a mount namespace of its own."""
    left = os.environ.get(NAMESPACE_ENV)
    return left is not None and left != _mount_ns()


def reexec_in_namespace() -> NoReturn:
    """Run this very command (`sys.orig_argv`: the CLI's) again in a mount namespace of its own
    (module docstring). Raises RuntimeError, naming why and the flag that leaves the scenario out,
    where the host allows no such namespace or no tmpfs mount in it."""
    namespace = namespace_argv()
    why = ""
    try:
        probe = subprocess.run(
            [*namespace, "sh", "-c", "mount -t tmpfs -o size=1m symphony-probe /mnt"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        why = probe.stderr.strip() if probe.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = str(exc)
    if why:
        raise RuntimeError(
            f"the disk scenario needs a mount namespace with a tmpfs of its own ({why}); "
            "leave it out with --scenarios crashes,network,attacks,overload"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(namespace[0], [*namespace, *sys.orig_argv], {**os.environ, NAMESPACE_ENV: _mount_ns()})


def _mount_tmpfs(directory: Path, options: str) -> None:
    if not in_namespace():
        raise RuntimeError("a tmpfs is mounted only in the bench's own mount namespace")
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "symphony-bench", str(directory)], check=True)


def mount_small_disk(directory: Path, nbytes: int) -> None:
    """A tmpfs of `nbytes` on `directory` (made if missing); only in the bench's namespace."""
    _mount_tmpfs(directory, f"size={nbytes},mode=0700")


def private_shm() -> None:
    """A /dev/shm of the namespace's own (module docstring); only in the bench's namespace."""
    _mount_tmpfs(Path("/dev/shm"), "mode=1777")


def unmount(directory: Path) -> None:
    """Unmount what `mount_small_disk` mounted (so that the home can be removed); quiet if gone."""
    subprocess.run(["umount", str(directory)], capture_output=True, check=False)


def segment_files(directory: Path) -> list[Path]:
    """The tier's committed segment files, oldest first (their names carry their sequence)."""
    return sorted(directory.glob(f"*{SUFFIX}"))


def _flip(f: BinaryIO, at: int) -> None:
    """Invert the byte at offset `at` of the open file `f`."""
    f.seek(at)
    byte = f.read(1)
    f.seek(at)
    f.write(bytes([byte[0] ^ 0xFF]))


def damage(files: list[Path], rng: random.Random) -> dict[str, str]:
    """One kind of damage per file (module docstring); returns each damaged file's kind by name.
    A file evicted meanwhile is skipped."""
    done: dict[str, str] = {}
    kinds = ["pages_flipped", "header_flipped", "truncated"]
    for path, kind in zip(rng.sample(files, min(len(files), len(kinds))), kinds, strict=False):
        try:
            with open(path, "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                if kind == "pages_flipped":  # a byte in the middle of every page of its second half
                    f.seek(0)
                    header = parse_header(f.read())
                    count = len(header.entries)
                    for index in range(count // 2, count):
                        _flip(f, header.page_offset(index) + header.page_bytes // 2)
                elif kind == "header_flipped":
                    _flip(f, 0)
                else:
                    f.truncate(size // 2)
        except FileNotFoundError:
            continue
        done[path.name] = kind
    return done


FILLER = "filler-from-outside"


def fill(directory: Path) -> int:
    """Write a file from outside into `directory` until its filesystem is full (ENOSPC); its bytes.
    Unbuffered: a short write ends it, and nothing is left to fail at close."""
    written = 0
    chunk = memoryview(b"\0" * FILL_CHUNK)
    with open(directory / FILLER, "wb", buffering=0) as f:
        while True:
            try:
                count = f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
            written += count or 0  # a short write: the next one meets ENOSPC
    return written


@dataclasses.dataclass
class DiskTarget:
    """What the disk faults act on: the small-disk node and how to reach its process and counters."""

    node: int
    process: ManagedProcess
    ssd_dir: Path
    metrics_url: str
    config: SymphonyConfig
    config_path: Path  # the cluster's effective config, which the node's argv names
    whole: Callable[[], Awaitable[bool]]


async def node_counters(url: str) -> dict[str, float]:
    """The node's KV counters and gauges, by sample name and labels ({} when it does not answer).
    A connection of its own each time: one kept from before a restart would meet a closed socket."""
    text = None
    for attempt in range(SCRAPE_TRIES):
        try:
            async with httpx.AsyncClient(timeout=10.0) as http:
                text = (await http.get(url)).text
            break
        except httpx.HTTPError:
            await asyncio.sleep(0.5 * (attempt + 1))
    if text is None:
        return {}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("symphony_kv_ssd") and family.name not in (
            "symphony_kv_load_errors",
            "symphony_kv_save_degraded",
            "symphony_kv_tier_bytes",
            "symphony_kv_io_bytes",
            "symphony_kv_evictions",
            "symphony_connector_load_error_blocks",
        ):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            found[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return found


class DiskRunner:
    """Runs the disk faults (module docstring) under `load`, one at a time."""

    def __init__(
        self,
        load: ChatLoad,
        target: DiskTarget,
        crashes: CrashRunner,
        seed: int,
        warmup_turns: int,
        recover_timeout_s: float,
        say: Callable[[str], None],
    ) -> None:
        self.load, self.target, self.crashes = load, target, crashes
        self.rng = random.Random(seed)
        self.warmup_turns, self.recover_timeout_s, self.say = warmup_turns, recover_timeout_s, say
        self.faults: list[dict[str, Any]] = []
        self._conversations = 0

    async def run(self, kinds: tuple[str, ...]) -> None:
        """The faults of `kinds`, in an order drawn from the seed."""
        order = list(kinds)
        self.rng.shuffle(order)
        for number, kind in enumerate(order, 1):
            self.say(f"disk fault {number}/{len(order)}: {kind} node-{self.target.node}")
            started = time.monotonic()
            record: dict[str, Any] = {"kind": kind, "counters_before": await self._counters()}
            record.update(await getattr(self, kind)())
            record["counters_after"] = await self._counters()
            record["took_s"] = round(time.monotonic() - started, 1)
            self.faults.append(record)

    async def _counters(self) -> dict[str, float]:
        return await node_counters(self.target.metrics_url)

    async def _more_turns(self) -> bool:
        return await self.load.wait_turns(self.load.turns_done() + self.warmup_turns, self.recover_timeout_s)

    async def _new_conversation(self, label: str) -> None:
        """One new conversation's first turn, checked like the load's: a session with no KV
        anywhere goes to the least loaded node, so it reaches this one when the load's sessions
        are all kept on another."""
        self._conversations += 1
        session = f"disk-{label}-{self._conversations}-{self.rng.randrange(1 << 24):06x}"
        await self.load.first_turn(self.load.tenants[0].name, session, self._conversations)

    async def _converse_until(self, label: str, done: Callable[[], Awaitable[bool]]) -> bool:
        """New conversations, one at a time, until `done()` or NEW_CONVERSATIONS were sent."""
        for _ in range(NEW_CONVERSATIONS):
            if await done():
                return True
            await self._new_conversation(label)
        return await done()

    async def segment_corrupt(self) -> dict[str, Any]:
        async def enough() -> bool:
            return len(segment_files(self.target.ssd_dir)) >= SEGMENTS_WANTED

        await self._converse_until("segments", enough)
        found = len(segment_files(self.target.ssd_dir))
        damaged = damage(segment_files(self.target.ssd_dir), self.rng)
        self.crashes.origin_s = self.load.origin_s or 0.0
        kill = await self.crashes.one(Fault("node_kill", self.target.node, 0.0))
        # Sessions some of whose blocks were in a damaged segment lose those blocks by design.
        kill["sessions_with_damaged_blocks"] = kill.pop("lost_sessions", [])
        # Read at once: a later restart of the node would start its counters again.
        at_restart = await self._counters()
        return {
            "segments_found": found,
            "damaged": damaged,
            "kill": kill,
            "counters_at_restart": at_restart,
            "load_went_on": await self._more_turns(),
        }

    async def disk_full(self) -> dict[str, Any]:
        pid = self.target.process.pid
        refused_before = (await self._counters()).get(SSD_FULL)
        filler = self.target.ssd_dir / FILLER
        try:
            filled = await asyncio.to_thread(fill, self.target.ssd_dir)
            free_when_full = shutil.disk_usage(self.target.ssd_dir).free

            async def refused() -> bool:
                now = (await self._counters()).get(SSD_FULL)
                return now is not None and now > (refused_before or 0.0)

            went_on, met = await asyncio.gather(self._more_turns(), self._converse_until("full", refused))
            at_full = await self._counters()
        finally:
            filler.unlink(missing_ok=True)
        written_at_full = at_full.get(SSD_WRITTEN)

        async def written() -> bool:
            now = (await self._counters()).get(SSD_WRITTEN)
            return written_at_full is not None and now is not None and now > written_at_full

        resumed = await self._converse_until("resumed", written)
        return {
            "filled_bytes": filled,
            "free_bytes_when_full": free_when_full,
            "saves_met_full_disk": met,
            "refused_pages": max(0.0, at_full.get(SSD_FULL, 0.0) - (refused_before or 0.0)),
            "load_went_on": went_on,
            "counters_at_full": at_full,
            "segments_at_full": len(segment_files(self.target.ssd_dir)),
            "node_survived": self.target.process.pid == pid,
            "saves_resumed": resumed,
        }

    async def dtype_change(self) -> dict[str, Any]:
        config, process = self.target.config, self.target.process
        other = OTHER_DTYPE[config.engine.dtype]
        variant = self.target.config_path.with_name(f"cluster-{other}.toml")
        changed = dataclasses.replace(config, engine=dataclasses.replace(config.engine, dtype=other))
        own_argv = list(process.argv)
        other_argv = [str(variant) if a == str(self.target.config_path) else a for a in own_argv]
        if other_argv == own_argv:
            raise RuntimeError(f"the node's command names no {self.target.config_path} to change: {own_argv}")
        await self.load.stop()  # its answers are compared with one dtype's reference
        segments_before = len(segment_files(self.target.ssd_dir))
        record: dict[str, Any] = {"dtype": other, "segments_before": segments_before}
        try:
            write_private(variant, dump_toml(changed))
            process.argv = other_argv
            record["other_dtype"] = await self._restart()
            record["segments_other_dtype"] = len(segment_files(self.target.ssd_dir))
        finally:
            process.argv = own_argv
            variant.unlink(missing_ok=True)
            record["own_dtype"] = await self._restart()
            self.load.start()
        record["load_went_on"] = await self._more_turns()
        return record

    async def _restart(self) -> dict[str, Any]:
        """Kill the node manager (its engine goes with it); wait for its replacement, then for the
        cluster to stay whole as long as a crash's recovery must (`CrashRunner.stable_s`); how long
        that took and its counters then."""
        process = self.target.process
        pid = process.pid
        started = time.monotonic()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = started + self.recover_timeout_s
        whole, since = False, None
        while time.monotonic() < deadline and process.state != ProcessState.FAILED:
            if process.pid not in (None, pid) and await self.target.whole():
                since = since if since is not None else time.monotonic()
                if time.monotonic() - since >= self.crashes.stable_s:
                    whole = True
                    break
            else:
                since = None
            await asyncio.sleep(0.5)
        return {
            "whole": whole,
            "state": process.state.value,
            "whole_after_s": round(time.monotonic() - started, 1),
            "counters": await self._counters(),
        }


def disk_targets(report: dict[str, Any]) -> dict[str, bool]:
    """The disk scenario's own targets, over the faults it was asked for (`report["kinds"]`): each
    ran and the load went on after it; damage was found (a damaged segment counted at the
    restart); the node survived a full disk and saved again after it; another dtype's node started
    on the same home and the node came back."""
    faults = {f["kind"]: f for f in report["faults"]}
    kinds = set(report["kinds"])
    found: dict[str, bool] = {"disk_every_fault_ran": sorted(faults) == sorted(kinds)}
    found["disk_load_went_on"] = all(f.get("load_went_on") for f in faults.values())
    if "segment_corrupt" in kinds:
        corrupt = faults.get("segment_corrupt", {})
        damaged = corrupt.get("counters_at_restart", {}).get("symphony_kv_ssd_segments_damaged_total", 0.0)
        found["disk_damage_found"] = bool(corrupt.get("kill", {}).get("recovered")) and damaged > 0
    if "disk_full" in kinds:
        full = faults.get("disk_full", {})
        found["disk_full_survived"] = bool(
            full.get("saves_met_full_disk") and full.get("node_survived") and full.get("saves_resumed")
        )
    if "dtype_change" in kinds:
        change = faults.get("dtype_change", {})
        other = change.get("other_dtype", {})
        # The other dtype's node set the old segments aside as another model's (if it had any).
        dropped = sum(v for k, v in other.get("counters", {}).items() if k.startswith(OTHER_MODEL))
        found["disk_dtype_change_recovered"] = bool(
            other.get("whole")
            and change.get("own_dtype", {}).get("whole")
            and (dropped > 0 or not change.get("segments_before"))
        )
    return found

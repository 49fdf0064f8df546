"""The scenario of `test_small_disk.py`: a real tiered store whose SSD tier lives on a small tmpfs,
saved to far past the filesystem's size. Run as `python -m tests.integration.small_disk WORK OUT`
inside a mount namespace of its own (`unshare --user --map-root-user --mount`, which any user may
enter), so the tmpfs needs no privileges and vanishes with the process. Writes its figures to OUT
as JSON; the test judges them.

Three phases, each on a fresh tmpfs of FS_BYTES:
- `headroom`: the configured headroom (a few segments' worth) and a capacity far above the disk:
  the tier must hold itself under what the disk has room for, evicting oldest first;
- `filled`: the same, with a file from outside taking half the disk once four sessions are in;
- `no_headroom`: headroom 0, so writes do hit ENOSPC: the write-behind must evict and write again,
  or degrade the batch, and never raise.
After each, the store is closed and a new one opened on the same directory (a node restart): every
session it still finds must load byte for byte, and those it finds are the newest.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any
from uuid import uuid4

import torch

from node_manager.kv.store import TieredStore
from node_manager.kv.store_config import StoreConfig
from symphony.kv_geometry import KVGeometry
from tests.helpers import TEST_MODEL
from tests.unit.kv_store_support import TIMEOUT, load_rows, metric, save_session, tokens

GEOMETRY = KVGeometry(num_layers=4, kv_heads=2, head_size=32, block_size=32)  # 8 KiB pages
BLOCKS = 8  # per session: 32 pages, 256 KiB
FS_BYTES = 4 << 20
HEADROOM = 768 << 10  # covers the two writers' segments, as the default 1 GiB does a real disk's
SESSIONS = 48  # 12 MiB saved: three times the disk
SECRET = b"small-disk-test-secret-0123456789"


def _store(directory: Path, headroom: int) -> TieredStore:
    config = StoreConfig(
        hbm_bytes=16 * GEOMETRY.page_bytes,
        dram_bytes=64 * GEOMETRY.page_bytes,  # two sessions: the rest lives on the SSD tier only
        ssd_bytes=1 << 30,  # far above the disk: the disk is what binds
        ssd_dir=directory,
        arena_name=f"symphony-small-disk-{uuid4().hex[:8]}",
        model=TEST_MODEL,
        segment_max_bytes=256 << 10,
        ssd_headroom_bytes=headroom,
        page_secret=SECRET,
    )
    return TieredStore(GEOMETRY, config)


def _mount(directory: Path) -> None:
    directory.mkdir(parents=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},huge=never", "symphony-small-disk", str(directory)], check=True
    )


def _phase(directory: Path, headroom: int, fill_at: int | None) -> dict[str, Any]:
    _mount(directory)
    store = _store(directory, headroom)
    saved: dict[str, list[torch.Tensor]] = {}
    errors: list[str] = []
    degraded_sessions: list[str] = []  # sessions some of whose pages a full disk kept off the SSD
    tier_peak = 0  # the most the tier held, sampled after each flushed save
    filler = 0
    try:
        for n in range(SESSIONS):
            if n == fill_at:  # someone else takes half the disk
                filler = shutil.disk_usage(directory).total // 2
                (directory / "filler").write_bytes(b"\0" * filler)
            before = _degraded(store)
            try:
                saved[f"s{n}"] = save_session(store, f"s{n}", BLOCKS, seed=n + 1)
                if not store.write_behind.flush(TIMEOUT):
                    errors.append(f"s{n}: the write-behind did not drain")
            except Exception:  # what the test is about: any exception out of a save is a failure
                errors.append(f"s{n}: {traceback.format_exc(limit=3)}")
            if _degraded(store) > before:
                degraded_sessions.append(f"s{n}")
            tier_peak = max(tier_peak, store.ssd.used_bytes)
        degraded = {
            reason: metric(store, "symphony_kv_save_degraded_total", reason=reason)
            for reason in ("ssd_full", "ssd_error", "dram_full")
        }
    finally:
        store.close(flush_timeout=TIMEOUT)

    reopened = _store(directory, headroom)  # a restart: everything now comes from the files
    exact, partial, wrong = [], [], []
    try:
        for name, data in saved.items():
            seed = int(name[1:]) + 1
            reopened.sessions.put("acme", name, tokens(BLOCKS, seed * 10_000, block_size=GEOMETRY.block_size))
            rows, results = load_rows(reopened, name, BLOCKS)
            loaded = min(result.loaded for result in results)
            if loaded == BLOCKS and all(not result.failed for result in results):
                if all(torch.equal(rows[layer][:BLOCKS], data[layer]) for layer in range(GEOMETRY.num_layers)):
                    exact.append(name)
                else:
                    wrong.append(name)
            elif loaded or any(result.loaded for result in results):
                partial.append(name)
    finally:
        reopened.close(flush_timeout=TIMEOUT)
    return {
        "errors": errors,
        "fs_bytes": FS_BYTES,
        "headroom_bytes": headroom,
        "filler_bytes": filler,
        "session_bytes": BLOCKS * GEOMETRY.num_layers * GEOMETRY.page_bytes,
        "sessions_saved": len(saved),
        "tier_peak_bytes": tier_peak,
        "degraded_pages": degraded,
        "degraded_sessions": degraded_sessions,
        "exact_after_restart": exact,
        "partial_after_restart": partial,
        "wrong_after_restart": wrong,
    }


def _degraded(store: TieredStore) -> float:
    return sum(metric(store, "symphony_kv_save_degraded_total", reason=r) for r in ("ssd_full", "ssd_error"))


def main(work: Path, out: Path) -> None:
    report = {
        "headroom": _phase(work / "headroom", HEADROOM, None),
        "filled": _phase(work / "filled", HEADROOM, 4),
        "no_headroom": _phase(work / "no_headroom", 0, None),
    }
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

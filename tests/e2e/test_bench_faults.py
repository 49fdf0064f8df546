"""`symphony bench faults`, short: a private two-node cluster with two scheduler replicas over etcd
and mutual TLS has each of its processes killed or frozen once under a greedy chat load, each of
its nodes' links partitioned, blackholed or slowed, a node's small disk filled to ENOSPC, is
attacked on every listener, then loaded past its capacity; the checker's figures must all hold but
the speed targets, and must have had something to check (answers compared with their recompute
reference, sessions on SSD across a node's kill, saves refused by the full disk, attempts on every
listener, requests past capacity). The disk scenario's segment damage and dtype change (three
engine restarts, three to four minutes) are left to the bench's full run: with them, CI's suite
would outlast its 90 minutes. What a restarted store does with damaged segments is tested in
`tests/unit/test_fault_disk.py`; a home served again in another dtype and by another model, with
real engines, in `tests/e2e/test_model_kv_isolation.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from eval.faults import CRASH_KINDS, LINK_KINDS
from symphony.config import default_home
from symphony.models import fetch_default_model

pytestmark = pytest.mark.e2e
# Speed targets are the bench's (its exit status, its JSON, docs/benchmarks.md), not this test's: on
# a 2-core host, probes after a replica kill answered at up to 3.75x the baseline p99 while the
# replica restarted (a 4x bound; the CI run of c236638), a margin too thin to gate CI on.
# Overload's are too: how many requests a short flood gets refused, their latency, the goodput and
# the quiet tenant's ratio (docs/benchmarks.md#overload-scenario-6).
SPEED_TARGETS = {
    "crashes_kill_recovery_ms_p99_le_1000",
    "overload_surplus_refused",
    "overload_accepted_p99_bounded",
    "overload_goodput_ge_0.8_capacity",
    "overload_quiet_p95_within_1.5x",
}
# Engines of 8 requests at once (vLLM CPU's default is 128): the overload's capacity phase fills
# every engine's batch with closed-loop clients, and 128 at once on each of two engines sharing
# two cores take longer than the clients' 120 s bound (docs/benchmarks.md#overload-scenario-6).
ENGINE_CONFIG = "[engine]\nmax_num_seqs = 8\n"
SHORT_DISK_FAULTS = ("disk_full",)  # module docstring


@pytest.mark.timeout(1800)  # two engine restarts, and a recompute reference of every answer
def test_the_cluster_survives_every_crash_refuses_every_attack_and_sheds_overload(
    tmp_path: Path, own_engines: None
) -> None:
    model_dir = fetch_default_model(default_home(), progress=lambda _: None)
    (tmp_path / "symphony.toml").write_text(f'home = "{tmp_path / "home"}"\n{ENGINE_CONFIG}')
    out = tmp_path / "faults.json"
    argv = [sys.executable, "-m", "symphony.cli", "bench", "faults", "--config", str(tmp_path / "symphony.toml")]
    argv += ["--model", str(model_dir), "--out", str(out), "--rounds", "1", "--sessions", "2", "--warmup-turns", "4"]
    argv += ["--overload-s", "16", "--disk-faults", ",".join(SHORT_DISK_FAULTS)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYMPHONY_")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1700, env=env)
    assert out.exists(), done.stderr[-4000:]
    result = json.loads(out.read_text())
    explained = _explain(result, done.stderr)
    missed = {name for name, held in result["targets"].items() if not held}
    assert result["complete"] and not missed - SPEED_TARGETS, explained
    assert done.returncode == (1 if missed else 0), explained

    crashes = result["scenarios"]["crashes"]
    assert sorted(f["kind"] for f in crashes["faults"]) == sorted(CRASH_KINDS)
    assert all(f["recovered"] and "skipped" not in f for f in crashes["faults"])
    assert crashes["checked_outputs"] > 0 and crashes["wrong_outputs"] == 0
    assert crashes["ssd_sessions_checked"] > 0 and crashes["lost_sessions"] == []
    assert crashes["probes"] > 0 and crashes["kill_recovery_ms_p99"] is not None  # measured; judged by the bench

    network = result["scenarios"]["network"]
    assert sorted(f["kind"] for f in network["faults"]) == sorted(LINK_KINDS)
    assert network["checked_outputs"] > 0 and network["wrong_outputs"] == 0 and network["probes"] > 0
    links = network["links"]  # every node's traffic crossed its link, both ways
    assert all(link["bytes_to_node"] > 0 and link["bytes_from_node"] > 0 for link in links.values()), links

    disk = result["scenarios"]["disk"]
    assert sorted(f["kind"] for f in disk["faults"]) == sorted(SHORT_DISK_FAULTS)
    assert disk["checked_outputs"] > 0 and disk["wrong_outputs"] == 0
    (full,) = disk["faults"]
    # Full: a segment write in flight that met ENOSPC may have evicted a few old ones since.
    assert full["saves_met_full_disk"] and full["refused_pages"] > 0 and full["free_bytes_when_full"] < 64 << 20

    attacks = result["scenarios"]["attacks"]
    assert attacks["unauthorized_accepted"] == 0 and attacks["attempts"] >= 50 and not attacks["unreachable"]
    assert attacks["victim_next_turn"] == "ok"
    kinds = {listener.split()[0] for listener in attacks["listeners"]}
    assert kinds == {"node", "page", "engine", "scheduler"}
    assert attacks["checked_outputs"] > 0 and attacks["wrong_outputs"] == 0

    overload = result["scenarios"]["overload"]
    assert overload["capacity_rps"] > 0 and overload["flood_requests"] > overload["quiet_flooded_requests"] > 0
    assert overload["checked_outputs"] > 0 and overload["wrong_outputs"] == 0
    refused = overload["flood_refused_by_kind"]
    assert set(refused) <= {"503:overloaded", "503:queue_timeout", "429:queue_full"}, refused


# What each target is judged on, to print when it fails.
_EVIDENCE = (
    "errors_by_kind",
    "malformed",
    "over_bound",
    "wrong_sessions",
    "unchecked_outputs",
    "leaks",
    "lost_sessions",
    "ssd_sessions_checked",
    "kill_recovery_ms_p99",
    "unauthorized_accepted",
    "accepted",
    "unreachable",
    "victim_next_turn",
    "load_resumed",
    "flood_refused_by_kind",
    "flood_accepted_p99_s",
    "quiet_p95_ratio",
)


def _explain(result: dict[str, Any], stderr: str) -> str:
    """A string, which pytest prints whole (it cuts other objects to 240 characters): the failed
    targets on the first line (the one a short summary shows), then the evidence for them, the
    faults not recovered from, and the bench's last words."""
    failed = [name for name, held in result.get("targets", {}).items() if not held]
    lines = [f"failed targets: {failed}"]
    for name, report in result.get("scenarios", {}).items():
        lines.append(f"{name}: " + json.dumps({k: report[k] for k in _EVIDENCE if k in report}, default=str))
        unrecovered = [f for f in report.get("faults", []) if not f.get("recovered") or "skipped" in f]
        if unrecovered:
            lines.append(f"{name} faults not recovered from: {json.dumps(unrecovered, default=str)[:3000]}")
    return "\n".join([*lines, "stderr: " + stderr[-3000:]])

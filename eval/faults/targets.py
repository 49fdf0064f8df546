"""The issue's targets over a `symphony bench faults` report's scenarios, and what makes each mean
something: outputs checked, SSD sessions looked up, every fault recovered from, every listener
kind tried."""

from __future__ import annotations

from typing import Any

from eval.faults.disk import disk_targets
from eval.faults.overload import overload_targets
from eval.faults.soak import soak_targets


def targets(result: dict[str, Any]) -> dict[str, bool]:
    """The targets over the scenarios that ran (module docstring)."""
    found: dict[str, bool] = {}
    scenarios = result["scenarios"]
    for name, report in scenarios.items():
        found[f"{name}_wrong_outputs_0"] = report["wrong_outputs"] == 0
        found[f"{name}_every_output_checked"] = report["checked_outputs"] > 0 and report["unchecked_outputs"] == 0
        found[f"{name}_malformed_0"] = report["malformed"] == 0
        found[f"{name}_within_bound"] = report["over_bound"] == 0
        found[f"{name}_no_leaks"] = not report["leaks"]
    if "crashes" in scenarios:
        crashes = scenarios["crashes"]
        found["crashes_lost_sessions_0"] = not crashes["lost_sessions"] and crashes["ssd_sessions_checked"] > 0
        found["crashes_every_fault_recovered"] = all(
            f.get("recovered") and "skipped" not in f for f in crashes["faults"]
        )
        p99 = crashes["kill_recovery_ms_p99"]
        found["crashes_kill_recovery_ms_p99_le_1000"] = p99 is not None and p99 <= 1000.0
    if "network" in scenarios:
        network = scenarios["network"]
        found["network_every_fault_recovered"] = bool(network["faults"]) and all(
            f.get("recovered") and "skipped" not in f for f in network["faults"]
        )
    if "disk" in scenarios:
        found.update(disk_targets(scenarios["disk"]))
    if "attacks" in scenarios:
        attacks = scenarios["attacks"]
        found["attacks_unauthorized_accepted_0"] = attacks["unauthorized_accepted"] == 0
        found["attacks_every_listener_reached"] = not attacks["unreachable"] and {
            listener.split()[0] for listener in attacks["listeners"]
        } == {"node", "page", "engine", "scheduler"}
        found["attacks_victim_and_load_go_on"] = attacks["victim_next_turn"] == "ok" and attacks["load_resumed"]
    if "soak" in scenarios:
        found.update(soak_targets(scenarios["soak"]))
    if "overload" in scenarios:
        found.update(overload_targets(scenarios["overload"]))
    return found

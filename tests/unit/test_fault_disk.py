"""The disk scenario's pure parts (`eval.faults.disk`): the damage it does is damage a restarted
store finds, and its targets fail when what they judge did not happen."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from eval.faults import DISK_KINDS
from eval.faults.disk import damage, disk_targets, segment_files
from tests.unit.kv_store_support import MakeStore, load_rows, metric, save_session, tokens


def _saved(make_store: MakeStore) -> dict[str, list[Any]]:
    store = make_store(segment_max_bytes=2048)  # a few blocks a segment: sessions span several
    sessions = {f"s{n}": save_session(store, f"s{n}", 4, seed=n + 1, flush_each=True) for n in range(6)}
    store.close()
    return sessions


def test_a_flipped_header_and_a_file_cut_short_are_set_aside_at_a_restart(make_store: MakeStore, ssd_dir: Path) -> None:
    _saved(make_store)
    files = segment_files(ssd_dir)
    assert len(files) >= 3
    sizes = {path.name: path.stat().st_size for path in files}
    damaged = damage(files, random.Random(0))
    assert sorted(damaged.values()) == ["header_flipped", "pages_flipped", "truncated"]
    truncated = next(name for name, kind in damaged.items() if kind == "truncated")
    assert (ssd_dir / truncated).stat().st_size == sizes[truncated] // 2
    restarted = make_store(segment_max_bytes=2048)
    assert metric(restarted, "symphony_kv_ssd_segments_damaged_total") == 2


def test_flipped_pages_fail_their_check_when_loaded_and_nothing_wrong_is_served(
    make_store: MakeStore, ssd_dir: Path
) -> None:
    sessions = _saved(make_store)
    assert damage(segment_files(ssd_dir)[:1], random.Random(0)) == {segment_files(ssd_dir)[0].name: "pages_flipped"}
    restarted = make_store(segment_max_bytes=2048)
    assert metric(restarted, "symphony_kv_ssd_segments_damaged_total") == 0  # indexed: its header is whole
    failed = 0
    for name, data in sessions.items():
        restarted.sessions.put("acme", name, tokens(4, base=(int(name[1:]) + 1) * 10_000))
        rows, results = load_rows(restarted, name, 4)
        for result in results:  # what a load says it loaded is what was saved
            failed += len(result.failed)
            assert rows[result.layer][: result.loaded].equal(data[result.layer][: result.loaded])
    assert failed > 0
    assert metric(restarted, "symphony_kv_load_errors_total", reason="checksum") > 0


def _report(**overrides: Any) -> dict[str, Any]:
    faults = {
        "segment_corrupt": {
            "kind": "segment_corrupt",
            "load_went_on": True,
            "kill": {"recovered": True},
            "counters_at_restart": {"symphony_kv_ssd_segments_damaged_total": 2.0},
        },
        "disk_full": {
            "kind": "disk_full",
            "load_went_on": True,
            "saves_met_full_disk": 3,
            "node_survived": True,
            "saves_resumed": True,
        },
        "dtype_change": {
            "kind": "dtype_change",
            "load_went_on": True,
            "segments_before": 12,
            "other_dtype": {
                "whole": True,
                "counters": {"symphony_kv_ssd_segments_other_model_total{action=dropped}": 12},
            },
            "own_dtype": {"whole": True},
        },
    }
    for path, value in overrides.items():
        kind, key = path.split(".")
        faults[kind][key] = value
    return {"kinds": list(DISK_KINDS), "faults": list(faults.values())}


def test_the_disk_targets_hold_for_a_run_that_did_everything() -> None:
    found = disk_targets(_report())
    assert found and all(found.values()), found
    assert {f["kind"] for f in _report()["faults"]} == set(DISK_KINDS)


@pytest.mark.parametrize(
    ("override", "missed"),
    [
        ({"segment_corrupt.counters_at_restart": {}}, "disk_damage_found"),
        ({"segment_corrupt.kill": {"recovered": False}}, "disk_damage_found"),
        ({"disk_full.saves_met_full_disk": 0}, "disk_full_survived"),
        ({"disk_full.node_survived": False}, "disk_full_survived"),
        ({"disk_full.saves_resumed": False}, "disk_full_survived"),
        ({"dtype_change.other_dtype": {"whole": False}}, "disk_dtype_change_recovered"),
        ({"dtype_change.other_dtype": {"whole": True, "counters": {}}}, "disk_dtype_change_recovered"),
        ({"dtype_change.load_went_on": False}, "disk_load_went_on"),
    ],
)
def test_a_disk_target_fails_when_its_fault_did_not_do_what_it_judges(override: dict[str, Any], missed: str) -> None:
    found = disk_targets(_report(**override))
    assert [name for name, held in found.items() if not held] == [missed]


def test_a_run_missing_a_fault_misses_its_targets() -> None:
    report = _report()
    report["faults"] = report["faults"][:2]
    found = disk_targets(report)
    assert not found["disk_every_fault_ran"] and not found["disk_dtype_change_recovered"]


def test_only_the_faults_asked_for_are_judged() -> None:
    report = _report()
    report["kinds"] = ["segment_corrupt", "disk_full"]
    report["faults"] = report["faults"][:2]
    found = disk_targets(report)
    assert all(found.values()) and "disk_dtype_change_recovered" not in found

"""Smoke test of `symphony bench tiers` at a tiny scale: every key is written, the SSD and peer paths
really ran (their assertions on byte equality are inside the bench), and bad flags are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

KEYS = (
    "memcpy_gbps",
    "dram_store_gbps",
    "dram_load_gbps",
    "disk_write_bound_gbps",
    "disk_read_bound_gbps",
    "ssd_write_gbps",
    "ssd_read_gbps",
    "loopback_bound_gbps",
    "peer_fetch_gbps",
    "ssd_first_layer_ready_ms",
    "ssd_all_layers_ready_ms",
)


def test_bench_tiers_writes_every_key(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "symphony.cli",
            "bench",
            "tiers",
            "--out",
            str(out),
            "--tokens",
            "256",
            "--trials",
            "1",
            "--work-dir",
            str(tmp_path),
            "--plot",
            str(tmp_path / "t.png"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in KEYS:
        assert result[key] > 0, key
    assert result["session_tokens"] == 256 and result["trials"] == 1
    assert result["ssd_first_layer_ready_ms"] <= result["ssd_all_layers_ready_ms"]
    assert set(result["targets_met"]) == set(result["ratios"])
    assert (tmp_path / "t.png").stat().st_size > 0
    assert "target dram_load_vs_memcpy" in done.stdout


def test_bench_tiers_names_a_bad_flag(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "symphony.cli", "bench", "tiers", "--out", str(tmp_path / "x.json"), "--device", "tpu"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--device" in done.stderr and "Traceback" not in done.stderr

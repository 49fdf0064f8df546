"""`symphony bench report DIR`: every known result file summarised and drawn, others listed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from symphony.cli import main

VALIDATE = {
    "policy": "recompute",
    "live": {"ttft_ms_mean": 100.0, "tpot_ms_mean": 20.0, "output_tokens_per_s": 50.0},
    "simulated": {"ttft_ms_mean": 110.0, "tpot_ms_mean": 19.0, "output_tokens_per_s": 52.0},
    "relative_error": {"ttft_ms_mean": 0.1, "tpot_ms_mean": 0.05, "output_tokens_per_s": 0.04},
    "sim_vs_live_error": 0.1,
    "targets": {"sim_vs_live_error_le_0.2": True},
}


def test_a_directory_of_results_becomes_one_page_with_plots(tmp_path: Path) -> None:
    for scenario in ("imbalance", "missed_advisories"):
        assert (
            main(
                [
                    "bench",
                    "sim",
                    "--scenario",
                    scenario,
                    "--out",
                    str(tmp_path / f"{scenario}.json"),
                    "--nodes",
                    "2",
                    "--users",
                    "4",
                    "--duration",
                    "30",
                    "--time-scale",
                    "0.05",
                ]
            )
            == 0
        )
    (tmp_path / "validate.json").write_text(json.dumps(VALIDATE))
    (tmp_path / "notes.json").write_text('{"hello": 1}')
    (tmp_path / "broken.json").write_text("{")
    assert main(["bench", "report", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "## simulator: load imbalance (figure 18)" in report
    assert "## simulator: missed advisories (figure 17)" in report
    assert "## simulator against the live cluster (bench validate)" in report
    assert "sim_vs_live_error: 0.1" in report and "target `sim_vs_live_error_le_0.2`: met" in report
    assert "- `notes.json`" in report and "- `broken.json`" in report
    for scenario in ("imbalance", "missed_advisories"):
        assert (tmp_path / f"{scenario}.png").stat().st_size > 0 and f"]({scenario}.png)" in report


def test_a_report_of_a_missing_directory_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "report", str(tmp_path / "nope")]) == 2
    assert "DIR" in capsys.readouterr().err

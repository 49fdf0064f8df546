"""Writing a benchmark's result: the JSON file, the table on stdout and, if asked, the plot."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Result = dict[str, Any]


def write_result(
    result: Result,
    out: Path,
    *,
    table: Callable[[Result], None],
    plot: Path | None = None,
    plotter: Callable[[Result, Path], None] | None = None,
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    table(result)
    print(f"wrote {out}")
    if plot is not None and plotter is not None:
        plotter(result, plot)
        print(f"wrote {plot}")

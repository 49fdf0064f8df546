"""Structured logs: fields and an exception's traceback reach both formats."""

from __future__ import annotations

import json
import logging

import pytest

from symphony.logs import JsonFormatter, KeyValueFormatter, get_logger


@pytest.mark.parametrize("formatter", [KeyValueFormatter(), JsonFormatter()], ids=["text", "json"])
def test_exception_logs_fields_and_traceback(formatter: logging.Formatter) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("symphony.test.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        try:
            raise ValueError("boom 42")
        except ValueError:
            get_logger("symphony.test.logs").exception("lane failed", layer=7)
    finally:
        logger.removeHandler(handler)
    assert len(records) == 1 and records[0].levelno == logging.ERROR
    line = formatter.format(records[0])
    if isinstance(formatter, JsonFormatter):
        payload = json.loads(line)
        assert payload["layer"] == 7 and payload["event"] == "lane failed" and "ValueError: boom 42" in payload["exc"]
    else:
        assert "layer=7" in line and "ValueError: boom 42" in line


def test_module_loggers_are_named_from_the_module() -> None:
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    fixed = [
        f"{path.relative_to(root)}: {match.group(0)}"
        for package in ("symphony", "scheduler", "node_manager", "client_sdk", "eval")
        for path in (root / package).rglob("*.py")
        for match in re.finditer(r"get_logger\(\s*[\"'][^\"']*[\"']\s*\)", path.read_text())
    ]
    assert fixed == [], "name loggers get_logger(__name__): " + "; ".join(fixed)

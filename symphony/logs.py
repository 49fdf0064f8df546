"""Structured, quiet-by-default logging shared by every Symphony process.

One line per event: `ts=... level=info component=scheduler event="node ready" node=node-0`, or the
same fields as JSON. Per-request detail goes to DEBUG so a healthy cluster prints only life-cycle
events.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_FIELDS_ATTR = "symphony_fields"


class StructLogger:
    """Thin wrapper so call sites pass fields as keywords; rendering happens only if enabled."""

    def __init__(self, name: str) -> None:
        self._logger = logging.getLogger(name)

    def _log(self, level: int, event: str, fields: dict[str, Any], exc_info: bool = False) -> None:
        if self._logger.isEnabledFor(level):
            self._logger.log(level, event, extra={_FIELDS_ATTR: fields}, stacklevel=3, exc_info=exc_info)

    def debug(self, event: str, **fields: Any) -> None:
        self._log(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._log(logging.ERROR, event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        """An error with the traceback of the exception being handled (call from an `except` block)."""
        self._log(logging.ERROR, event, fields, exc_info=True)


def get_logger(name: str) -> StructLogger:
    return StructLogger(name)


def _format_value(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' "=\n\t'):
        return json.dumps(text)
    return text


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        parts = [
            f"ts={ts}",
            f"level={record.levelname.lower()}",
            f"component={record.name}",
            f"event={_format_value(record.getMessage())}",
        ]
        for key, value in getattr(record, _FIELDS_ATTR, {}).items():
            parts.append(f"{key}={_format_value(value)}")
        if record.exc_info:
            parts.append(f"exc={_format_value(self.formatException(record.exc_info))}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "component": record.name,
            "event": record.getMessage(),
        }
        payload.update(getattr(record, _FIELDS_ATTR, {}))
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Install one stderr handler on the root logger; third-party chatter stays at WARNING."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    our_level = getattr(logging, level.upper())
    for name in ("symphony", "scheduler", "node_manager", "client_sdk", "eval"):
        logging.getLogger(name).setLevel(our_level)
    # uvicorn's access log would print a line per request; errors still surface through uvicorn.error.
    logging.getLogger("uvicorn.access").disabled = True

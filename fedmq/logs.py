"""Structured, quiet-by-default logging: one event per line, `key=value` or JSON.

    log = get_logger("aggregator")
    event(log, "update.applied", agent="car-7", staleness=3, alpha=[0.7, 0.3])
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from fedmq.errors import UsageError


class _EventFormatter(logging.Formatter):
    def __init__(self, as_json: bool) -> None:
        super().__init__()
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "fields", {})
        if self.as_json:
            doc = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                   "logger": record.name, "event": record.getMessage(), **fields}
            return json.dumps(doc, default=str)
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        kv = " ".join(f"{k}={_short(v)}" for k, v in fields.items())
        line = f"{ts} {record.levelname.lower():7s} {record.name}: {record.getMessage()}"
        line = f"{line} {kv}" if kv else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, float) for x in v):
        return "[" + ",".join(f"{x:.3g}" for x in v) + "]"
    text = str(v)
    return json.dumps(text) if " " in text else text


def setup_logging(level: str = "warning", as_json: bool = False) -> None:
    """Configure the `fedmq` logger tree once per process (stderr)."""
    root = logging.getLogger("fedmq")
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_EventFormatter(as_json))
    root.addHandler(handler)
    try:
        root.setLevel(level.upper())
    except ValueError:
        raise UsageError(f"unknown log level {level!r}; use debug, info, warning or error") from None
    root.propagate = False


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"fedmq.{name}")


def event(logger: logging.Logger, name: str, level: int = logging.INFO, **fields: Any) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={"fields": fields})

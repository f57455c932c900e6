"""Structured logging: one event per line, `key=value` or JSON, on stderr.

    log = get_logger("aggregator")
    event(log, "update.applied", agent="car-7", staleness=3, alpha=[0.7, 0.3])
    event(log, "train.done", level=PROGRESS, samples=300, seconds=1.9)

Levels, quietest last: debug, info, progress, warning, error. `progress` (between info and
warning) is what a long-running process says about its work: an agent one line per step of
its update cycle, the aggregator one line per applied upload or a periodic summary. The
default level `auto` is chosen by the process: `fedmq agent` and `fedmq aggregator` resolve it
to progress; the simulator, the demo and the tools, which run many agents in one process,
to warning (they show their own progress), unless `--log-level` asks for more.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from fedmq.errors import UsageError
from fedmq.redact import mask_secrets

PROGRESS = 25
"""A process's own account of its work (cycles, uploads, rounds): shown by default."""
logging.addLevelName(PROGRESS, "PROGRESS")

LEVELS = ("debug", "info", "progress", "warning", "error")
"""What `log.level` accepts, besides `auto`."""

class EventFormatter(logging.Formatter):
    """One event per line: `HH:MM:SS level logger: event key=value ...`, or one JSON object; passwords in URLs masked."""

    def __init__(self, as_json: bool) -> None:
        super().__init__()
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "fields", {})
        fields = {k: mask_secrets(v) if isinstance(v, str) else v for k, v in fields.items()}
        message = mask_secrets(record.getMessage())
        if self.as_json:
            doc = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                   "logger": record.name, "event": message, **fields}
            if record.exc_info:
                doc["exception"] = mask_secrets(self.formatException(record.exc_info))
            return json.dumps(doc, default=str)
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        kv = " ".join(f"{k}={_short(v)}" for k, v in fields.items())
        line = f"{ts} {record.levelname.lower():8s} {record.name}: {message}"
        line = f"{line} {kv}" if kv else line
        if record.exc_info:
            line += "\n" + mask_secrets(self.formatException(record.exc_info))
        return line


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, float) for x in v):
        return "[" + ",".join(f"{x:.3g}" for x in v) + "]"
    text = str(v)
    return json.dumps(text) if " " in text else text


def resolve_level(level: str, auto: str = "warning") -> str:
    """`level` checked and lower-cased, `auto` replaced by the process's choice; ValueError if unknown."""
    name = (level or "auto").strip().lower()
    if name == "auto":
        name = auto
    if name not in LEVELS:
        raise UsageError(f"unknown log level {level!r}; use auto, {', '.join(LEVELS)}")
    return name


LONG_WORK = ("fedmq.aggregator.pretrain", "fedmq.aggregator.start")
"""Loggers of work that runs for minutes before anything else is said (a MobileNetV3's
pre-training: about ten on two cores; a start model's five): at the auto level their progress lines show even where
the rest is held to warnings (`fedmq sim run`, the ablation), so a long start is not silence."""


def setup_logging(level: str = "auto", as_json: bool = False, *, auto: str = "warning") -> None:
    """Configure the `fedmq` logger tree once per process (stderr).

    `auto`: what `level="auto"` (the default) means for this process: `progress` for a single
    agent or aggregator, `warning` (the default here) for anything that runs many in one process.
    """
    name = resolve_level(level, auto)
    shown = (level or "auto").strip().lower() == "auto" and logging.getLevelName(name.upper()) > PROGRESS
    for quiet_work in LONG_WORK:  # at the auto level their progress shows in any process
        logging.getLogger(quiet_work).setLevel(PROGRESS if shown else logging.NOTSET)
    root = logging.getLogger("fedmq")
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EventFormatter(as_json))
    root.addHandler(handler)
    root.setLevel(name.upper())
    root.propagate = False


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"fedmq.{name}")


def event(logger: logging.Logger, name: str, level: int = logging.INFO, **fields: Any) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={"fields": fields})

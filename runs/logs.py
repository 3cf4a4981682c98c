"""Structured logs (docs/operations.md, "Logs").

Every log record passes ``RunContextFilter``, which stamps it with the run it concerns: run
id, incarnation (the lease's fence), trace id, worker id and checkpoint boundary. The engine
binds the first four for the time it drives a run (``bind``), so every line written while
a run is driven carries them — the engine's own, a tool's, httpx's — and passes the
boundary with each checkpoint line. ``JsonFormatter`` writes one JSON object per line for
log shippers (production default); ``HumanFormatter`` writes a readable line (development).

This module imports nothing from Django's models: logging is configured before apps load.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

CONTEXT_FIELDS = ("run_id", "incarnation", "trace_id", "worker", "boundary")

_context: ContextVar[dict[str, Any]] = ContextVar("agentops_log_context", default={})  # noqa: B039

# attributes every LogRecord has: anything else on a record came from ``extra=``
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


@contextmanager
def bind(**fields: Any) -> Iterator[None]:
    """Stamp every record logged in this context (thread or task) with ``fields``."""
    token = _context.set({**_context.get(), **fields})
    try:
        yield
    finally:
        _context.reset(token)


def bound() -> dict[str, Any]:
    return dict(_context.get())


class RunContextFilter(logging.Filter):
    """Adds the bound run context to every record; explicit ``extra=`` values win."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = _context.get()
        for name in CONTEXT_FIELDS:
            if not hasattr(record, name):
                setattr(record, name, context.get(name, ""))
        return True


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {
        key: value
        for key, value in vars(record).items()
        if key not in _RESERVED and key not in CONTEXT_FIELDS and not key.startswith("_")
    }


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, the run
    context (only the fields that are set) and any ``extra=`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, "")
            if value not in ("", None):
                entry[name] = value
        entry.update(_extras(record))
        if record.exc_info:
            entry["exception"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        if record.stack_info:
            entry["stack"] = record.stack_info
        return json.dumps(entry, default=str)


class HumanFormatter(logging.Formatter):
    """``time level logger message [run=… inc=… worker=… boundary=…]``."""

    _SHORT = {
        "run_id": "run",
        "incarnation": "inc",
        "trace_id": "trace",
        "worker": "worker",
        "boundary": "boundary",
    }

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = [
            f"{self._SHORT[name]}={value}"
            for name in CONTEXT_FIELDS
            if name != "trace_id" and (value := getattr(record, name, "")) not in ("", None)
        ]
        if not context:
            return line
        head, newline, rest = line.partition("\n")  # keep a traceback below the first line
        return f"{head} [{' '.join(context)}]{newline}{rest}"

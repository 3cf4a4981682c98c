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
import re
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


# An approval or question link's path ends in its secret token (``/approvals/link/<token>/``,
# ``/questions/link/<token>/``), also percent-encoded inside a query string (``next=``) or a
# Referer. Tokens are 43 URL-safe characters; 16 or more after a ``link/`` or ``links/``
# segment is one, whatever the prefix the link views end up under.
_LINK_TOKEN = re.compile(r"((?:/|%2F)links?(?:/|%2F))[A-Za-z0-9_-]{16,}", re.IGNORECASE)
REDACTED = "[redacted]"


def redact_link_tokens(text: str) -> str:
    return _LINK_TOKEN.sub(r"\1" + REDACTED, text)


class RedactLinkTokens(logging.Filter):
    """Takes link tokens out of a record before any handler writes it: gunicorn's access log
    (the request line, the Referer) and Django's request warnings (``Not Found: /…``). The
    message is rendered here, once, so a formatter sees only the redacted text."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_link_tokens(message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        elif isinstance(record.args, dict):
            # gunicorn's access atoms are read again by formats that name them
            record.args = {
                key: redact_link_tokens(value) if isinstance(value, str) else value
                for key, value in record.args.items()
            }
        for key, value in list(vars(record).items()):
            if key in _RESERVED or key.startswith("_"):
                continue
            # extras such as django.request's ``request`` render as their path
            if isinstance(value, str) or hasattr(value, "path"):
                text = value if isinstance(value, str) else repr(value)
                if (clean := redact_link_tokens(text)) != text:
                    setattr(record, key, clean)
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

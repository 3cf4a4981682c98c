"""Sandbox payments service: the "external system" behind the demo agent's tools.

The durable-agent engine promises that a side effect (a refund, a message) happens
*once* even when workers crash, retry or lose responses.  To test that promise we
need an external system we control completely.  This module is that system: a tiny
payments API that runs as its own process (standard library only, no Django), keeps
its state in its own SQLite file (so it survives restarts of everything else, and
of itself), and records every request it receives *before* any fault is applied.
The crash harness reads that log and the refund table afterwards to count how many
times each effect really happened.

What it models:

* ``POST /refunds`` takes an ``idempotency_key``.  With key deduplication on
  (``--dedupe``, ``--mode dedupe``) the service honours it (a repeated key returns the
  original refund); with it off (``--no-dedupe``, ``--mode nodedupe``) it does not
  (every request applies a new refund), so only the caller's own discipline -- record
  the intent, look it up before retrying -- prevents a double refund.
* Send deadlines (DESIGN §9).  Every logged request records the ``X-Agentops-Fence`` and
  ``X-Agentops-Send-Deadline`` headers it carried and when it was received, by this
  service's clock; one received at or after its send deadline is a **late send**, counted
  (``late``) whether or not it was applied.  With deadline checking on (``--deadline``) a
  late ``POST /refunds`` or ``POST /notifications`` is refused without applying: 409
  ``{"error": "send_deadline_passed"}``, logged as refused.  ``GET /requests?late=1`` lists
  the late ones, ``GET /requests/summary`` counts them.
* The load it sees (issue 26): ``GET /requests/summary`` reports the most writes it was
  applying at once (``max_in_flight``) -- counted from the moment a write passed every
  refusal to its answer, so a request refused as late, a 5xx fault and a lookup are never
  in flight -- and its writes per second.
* Both switches are shown by ``GET /health`` and changed at runtime by ``POST /mode``
  (``{"dedupe": true|false, "deadline": true|false}``, either or both).
* ``GET /refunds?idempotency_key=K`` lets the caller reconcile an uncertain outcome.
* ``POST /notifications`` is a non-idempotent, non-reconcilable action: it always
  applies and cannot be looked up, so the engine must treat it as at-most-once.
* Faults, per request (``X-Sandbox-Fault`` header) or queued globally
  (``POST /faults``): ``latency`` (sleep, then apply), ``drop`` (apply and commit,
  then close the connection without a response -- the "response lost" case),
  ``5xx`` (503 without applying), and for lookups ``lookup_error`` (500) and
  ``lookup_unknown`` (200 with ``found: null``).

Run it with::

    python -m agentops.demo.sandbox --host 127.0.0.1 --port 8765 \\
        --db var/sandbox.sqlite3 --mode dedupe [--deadline]

Tests and the harness use :func:`start_sandbox`, which launches it as a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any
from urllib.parse import parse_qs, urlsplit

MODES = ("dedupe", "nodedupe")
FENCE_HEADER = "X-Agentops-Fence"
SEND_DEADLINE_HEADER = "X-Agentops-Send-Deadline"
# the answer to a late request with deadline checking on (runs.toolhttp.LATE_CODE)
LATE_CODE = "send_deadline_passed"
# the writes a deadline check guards
DEADLINE_PATHS = ("/refunds", "/notifications")
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
DEFAULT_DB = "var/sandbox.sqlite3"
FAULT_HEADER = "X-Sandbox-Fault"
REPO_ROOT = Path(__file__).resolve().parents[2]

SEED_ORDERS: tuple[tuple[str, str, int], ...] = (
    ("ord_1001", "alice@example.com", 1999),
    ("ord_1002", "bob@example.com", 4500),
    ("ord_1003", "carol@example.com", 12000),
    ("ord_1004", "dave@example.com", 250000),
    ("ord_1005", "erin@example.com", 799),
    ("ord_1006", "frank@example.com", 35000),
    ("ord_1007", "grace@example.com", 8950),
    ("ord_1008", "heidi@example.com", 99900),
    ("ord_1009", "ivan@example.com", 15000),
    ("ord_1010", "judy@example.com", 500000),
)

# Global fault queue: counter/value names accepted by POST /faults.
FAULT_COUNTERS = (
    "latency_ms",  # delay applied to POST /refunds while set (see latency_next)
    "latency_next",  # if > 0, the delay only applies to the next N requests
    "drop_next",
    "error_next",
    "lookup_error_next",
    "lookup_unknown_next",
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    order_id TEXT PRIMARY KEY,
    customer TEXT NOT NULL,
    amount_cents INTEGER NOT NULL,
    currency TEXT NOT NULL,
    status TEXT NOT NULL,
    refunded_cents INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS refunds (
    seq INTEGER PRIMARY KEY,
    refund_id TEXT NOT NULL UNIQUE,
    idempotency_key TEXT NOT NULL,
    order_id TEXT NOT NULL REFERENCES orders(order_id),
    amount_cents INTEGER NOT NULL,
    reason TEXT,
    created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS refunds_key ON refunds(idempotency_key);
CREATE TABLE IF NOT EXISTS notifications (
    seq INTEGER PRIMARY KEY,
    notification_id TEXT NOT NULL UNIQUE,
    recipient TEXT NOT NULL,
    subject TEXT NOT NULL,
    body TEXT NOT NULL,
    idempotency_key TEXT,
    created_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    path TEXT NOT NULL,
    method TEXT NOT NULL,
    idempotency_key TEXT,
    received_at TEXT NOT NULL,
    applied INTEGER NOT NULL DEFAULT 0,
    fault TEXT,
    response_status INTEGER,
    fence TEXT,
    send_deadline TEXT,
    late INTEGER NOT NULL DEFAULT 0,
    refused INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS requests_key ON requests(idempotency_key);
CREATE TABLE IF NOT EXISTS faults (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS flight (
    path TEXT PRIMARY KEY,
    max_in_flight INTEGER NOT NULL
);
"""
# columns added after the first release: a sandbox file made by an older version gets them
REQUEST_COLUMNS_ADDED = (
    ("fence", "TEXT"),
    ("send_deadline", "TEXT"),
    ("late", "INTEGER NOT NULL DEFAULT 0"),
    ("refused", "INTEGER NOT NULL DEFAULT 0"),
)


def now_iso() -> str:
    """Current time as an ISO 8601 UTC timestamp."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


class ApiError(Exception):
    """An error answered to the client as ``{"error": code, "detail": detail}``."""

    def __init__(self, status: int, code: str, detail: str = "") -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {"error": self.code}
        if self.detail:
            body["detail"] = self.detail
        return body


@dataclass(frozen=True)
class Fault:
    """The fault chosen for one request (``kind`` None means behave normally)."""

    kind: str | None = None
    latency_ms: int = 0

    @classmethod
    def from_header(cls, value: str | None) -> Fault | None:
        """Parse ``X-Sandbox-Fault``; None if absent, ApiError if malformed."""
        if value is None or not value.strip():
            return None
        value = value.strip().lower()
        if value.startswith("latency"):
            _, sep, ms = value.partition("=")
            if not sep or not ms.strip().isdigit():
                raise ApiError(400, "invalid_fault", "expected latency=<ms>")
            return cls("latency", int(ms))
        if value in ("drop", "5xx", "lookup_error", "lookup_unknown"):
            return cls(value)
        raise ApiError(
            400,
            "invalid_fault",
            "expected latency=<ms>, drop, 5xx, lookup_error or lookup_unknown",
        )


@dataclass(frozen=True)
class Received:
    """When a request arrived (this service's clock) and the deadline headers it carried.
    ``late``: received at or after the send deadline it carried."""

    at: str
    fence: str | None = None
    send_deadline: str | None = None
    late: bool = False


def parse_deadline(value: str) -> datetime:
    """``X-Agentops-Send-Deadline``: an ISO 8601 time with its offset; ApiError if not."""
    try:
        deadline = datetime.fromisoformat(value.strip())
    except ValueError:
        deadline = None
    if deadline is None or deadline.tzinfo is None:
        raise ApiError(
            400, "invalid_send_deadline", f"{SEND_DEADLINE_HEADER} must be an ISO 8601 time"
        )
    return deadline


@dataclass
class Response:
    """What a route produced: a status and JSON payload, plus log bookkeeping."""

    status: int
    payload: dict[str, Any]
    applied: bool = False


# ---------------------------------------------------------------------------
# Storage
# ---------------------------------------------------------------------------


class SandboxStore:
    """All state, in one SQLite file in WAL mode; a new connection per operation."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA busy_timeout = 30000")
        conn.execute("PRAGMA foreign_keys = ON")
        return conn

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction taken with BEGIN IMMEDIATE (serialises writers)."""
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        finally:
            conn.close()

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        conn = self._connect()
        try:
            yield conn
        finally:
            conn.close()

    def initialize(self) -> None:
        """Create the schema and seed the orders that are missing."""
        conn = self._connect()
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.executescript(SCHEMA)
            have = {row["name"] for row in conn.execute("PRAGMA table_info(requests)")}
            for column, definition in REQUEST_COLUMNS_ADDED:
                if column not in have:
                    conn.execute(f"ALTER TABLE requests ADD COLUMN {column} {definition}")
        finally:
            conn.close()
        with self.write() as conn:
            self._seed(conn)

    @staticmethod
    def _seed(conn: sqlite3.Connection) -> None:
        conn.executemany(
            "INSERT OR IGNORE INTO orders"
            " (order_id, customer, amount_cents, currency, status, refunded_cents)"
            " VALUES (?, ?, ?, 'EUR', 'paid', 0)",
            SEED_ORDERS,
        )

    def reset(self) -> None:
        """Wipe refunds, notifications, the request log and faults; re-seed orders."""
        with self.write() as conn:
            for table in ("refunds", "notifications", "requests", "faults", "orders", "flight"):
                conn.execute(f"DELETE FROM {table}")
            self._seed(conn)

    # -- orders ------------------------------------------------------------

    @staticmethod
    def _order(row: sqlite3.Row) -> dict[str, Any]:
        return {
            "order_id": row["order_id"],
            "customer": row["customer"],
            "amount_cents": row["amount_cents"],
            "currency": row["currency"],
            "status": row["status"],
            "refunded_cents": row["refunded_cents"],
        }

    def get_order(self, order_id: str) -> dict[str, Any] | None:
        with self.read() as conn:
            row = conn.execute("SELECT * FROM orders WHERE order_id = ?", (order_id,)).fetchone()
        return self._order(row) if row else None

    def list_orders(self) -> list[dict[str, Any]]:
        with self.read() as conn:
            rows = conn.execute("SELECT * FROM orders ORDER BY order_id").fetchall()
        return [self._order(row) for row in rows]

    # -- refunds -----------------------------------------------------------

    @staticmethod
    def _refund(row: sqlite3.Row) -> dict[str, Any]:
        return {
            "refund_id": row["refund_id"],
            "idempotency_key": row["idempotency_key"],
            "order_id": row["order_id"],
            "amount_cents": row["amount_cents"],
            "reason": row["reason"],
            "status": "applied",
            "created_at": row["created_at"],
        }

    def apply_refund(
        self,
        *,
        idempotency_key: str,
        order_id: str,
        amount_cents: int,
        reason: str | None,
        dedupe: bool,
    ) -> Response:
        """Insert a refund and bump the order's refunded_cents, in one transaction."""
        with self.write() as conn:
            if dedupe:
                existing = conn.execute(
                    "SELECT * FROM refunds WHERE idempotency_key = ? ORDER BY seq LIMIT 1",
                    (idempotency_key,),
                ).fetchone()
                if existing is not None:
                    return Response(200, {**self._refund(existing), "duplicate": True})
            order = conn.execute("SELECT * FROM orders WHERE order_id = ?", (order_id,)).fetchone()
            if order is None:
                raise ApiError(404, "order_not_found", f"no order {order_id!r}")
            remaining = order["amount_cents"] - order["refunded_cents"]
            if amount_cents > remaining:
                raise ApiError(
                    422,
                    "exceeds_refundable",
                    f"amount_cents {amount_cents} exceeds refundable {remaining}",
                )
            refund_id = f"rf_{uuid.uuid4().hex}"
            conn.execute(
                "INSERT INTO refunds"
                " (refund_id, idempotency_key, order_id, amount_cents, reason, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (refund_id, idempotency_key, order_id, amount_cents, reason, now_iso()),
            )
            refunded = order["refunded_cents"] + amount_cents
            status = "refunded" if refunded >= order["amount_cents"] else "partially_refunded"
            conn.execute(
                "UPDATE orders SET refunded_cents = ?, status = ? WHERE order_id = ?",
                (refunded, status, order_id),
            )
            row = conn.execute("SELECT * FROM refunds WHERE refund_id = ?", (refund_id,)).fetchone()
        return Response(201, {**self._refund(row), "duplicate": False}, applied=True)

    def refunds_for_key(self, idempotency_key: str) -> list[dict[str, Any]]:
        with self.read() as conn:
            rows = conn.execute(
                "SELECT * FROM refunds WHERE idempotency_key = ? ORDER BY seq",
                (idempotency_key,),
            ).fetchall()
        return [self._refund(row) for row in rows]

    def all_refunds(self) -> list[dict[str, Any]]:
        with self.read() as conn:
            rows = conn.execute("SELECT * FROM refunds ORDER BY seq").fetchall()
        return [self._refund(row) for row in rows]

    # -- notifications -----------------------------------------------------

    @staticmethod
    def _notification(row: sqlite3.Row) -> dict[str, Any]:
        return {
            "notification_id": row["notification_id"],
            "to": row["recipient"],
            "subject": row["subject"],
            "body": row["body"],
            "idempotency_key": row["idempotency_key"],
            "created_at": row["created_at"],
        }

    def create_notification(
        self, *, to: str, subject: str, body: str, idempotency_key: str | None
    ) -> Response:
        notification_id = f"nt_{uuid.uuid4().hex}"
        with self.write() as conn:
            conn.execute(
                "INSERT INTO notifications"
                " (notification_id, recipient, subject, body, idempotency_key, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (notification_id, to, subject, body, idempotency_key, now_iso()),
            )
        return Response(201, {"notification_id": notification_id}, applied=True)

    def all_notifications(self) -> list[dict[str, Any]]:
        with self.read() as conn:
            rows = conn.execute("SELECT * FROM notifications ORDER BY seq").fetchall()
        return [self._notification(row) for row in rows]

    # -- request log and faults --------------------------------------------

    def log_request(
        self,
        *,
        path: str,
        method: str,
        idempotency_key: str | None,
        header_fault: Fault | None,
        kind: str,
        received: Received | None = None,
        refused: bool = False,
    ) -> tuple[int, Fault]:
        """Record a request and decide its fault, atomically.

        ``kind`` is ``"write"`` (POST /refunds: the global queue applies),
        ``"lookup"`` (GET /refunds?idempotency_key: lookup counters apply) or
        ``"other"`` (only the per-request header applies). A ``refused`` request (late,
        with deadline checking on) takes no fault: it is answered at once.
        """
        received = received or Received(now_iso())
        with self.write() as conn:
            fault = Fault() if refused else header_fault or self._take_global_fault(conn, kind)
            cursor = conn.execute(
                "INSERT INTO requests (path, method, idempotency_key, received_at, fault,"
                " fence, send_deadline, late, refused) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    path,
                    method,
                    idempotency_key,
                    received.at,
                    fault.kind,
                    received.fence,
                    received.send_deadline,
                    int(received.late),
                    int(refused),
                ),
            )
            log_id = cursor.lastrowid
        assert log_id is not None
        return log_id, fault

    def _take_global_fault(self, conn: sqlite3.Connection, kind: str) -> Fault:
        counters = self._read_faults(conn)

        def take(name: str) -> bool:
            if counters[name] <= 0:
                return False
            conn.execute(
                "INSERT OR REPLACE INTO faults (name, value) VALUES (?, ?)",
                (name, counters[name] - 1),
            )
            return True

        if kind == "write":
            if take("error_next"):
                return Fault("5xx")
            if take("drop_next"):
                return Fault("drop")
            latency = counters["latency_ms"]
            if latency > 0:
                if counters["latency_next"] > 0:
                    take("latency_next")
                    if counters["latency_next"] == 1:  # that was the last one
                        conn.execute(
                            "INSERT OR REPLACE INTO faults (name, value) VALUES ('latency_ms', 0)"
                        )
                return Fault("latency", latency)
        elif kind == "lookup":
            if take("lookup_error_next"):
                return Fault("lookup_error")
            if take("lookup_unknown_next"):
                return Fault("lookup_unknown")
        return Fault()

    def finish_request(self, log_id: int, *, applied: bool, response_status: int | None) -> None:
        with self.write() as conn:
            conn.execute(
                "UPDATE requests SET applied = ?, response_status = ? WHERE id = ?",
                (int(applied), response_status, log_id),
            )

    def list_requests(
        self,
        *,
        idempotency_key: str | None = None,
        path: str | None = None,
        method: str | None = None,
        late: bool | None = None,
    ) -> list[dict[str, Any]]:
        clauses: list[str] = []
        params: list[str | int] = []
        for column, value in (("idempotency_key", idempotency_key), ("path", path)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        if method is not None:
            clauses.append("method = ?")
            params.append(method.upper())
        if late is not None:
            clauses.append("late = ?")
            params.append(int(late))
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        with self.read() as conn:
            rows = conn.execute(f"SELECT * FROM requests{where} ORDER BY id", params).fetchall()
        return [
            {
                "id": row["id"],
                "path": row["path"],
                "method": row["method"],
                "idempotency_key": row["idempotency_key"],
                "received_at": row["received_at"],
                "applied": bool(row["applied"]),
                "fault": row["fault"],
                "response_status": row["response_status"],
                "fence": row["fence"],
                "send_deadline": row["send_deadline"],
                "late": bool(row["late"]),
                "refused": bool(row["refused"]),
            }
            for row in rows
        ]

    def request_summary(self) -> dict[str, Any]:
        """How many requests were logged, how many arrived after their send deadline (and
        of those how many were applied anyway), and how many were refused as late; and the
        load the engine put on this downstream as the downstream saw it (issue 26): the most
        writes it was ever applying at once (``max_in_flight``, overall and by path: what a
        concurrency limit must keep; a refused request or a lookup is never in flight, see
        ``SandboxServer.in_flight``), and its writes per second (``peak_requests_per_second``
        in any one second, and the mean over the seconds between the first and the last)."""
        with self.read() as conn:
            row = conn.execute(
                "SELECT count(*) AS requests,"
                " coalesce(sum(late), 0) AS late,"
                " coalesce(sum(late AND applied), 0) AS late_applied,"
                " coalesce(sum(refused), 0) AS refused"
                " FROM requests"
            ).fetchone()
            summary: dict[str, Any] = {
                name: int(row[name]) for name in ("requests", "late", "late_applied", "refused")
            }
            by_path = {
                r["path"]: int(r["max_in_flight"])
                for r in conn.execute("SELECT path, max_in_flight FROM flight")
            }
            rates = {path: self._rates(conn, path) for path in DEADLINE_PATHS}
        summary["max_in_flight"] = by_path.pop("*", 0)
        summary["max_in_flight_by_path"] = by_path
        summary["peak_requests_per_second"] = max((r[0] for r in rates.values()), default=0)
        summary["requests_per_second"] = {path: r[1] for path, r in rates.items() if r[1]}
        return summary

    @staticmethod
    def _rates(conn: sqlite3.Connection, path: str) -> tuple[int, float]:
        """(the most POSTs received in one calendar second, the mean per second)."""
        peak = conn.execute(
            "SELECT count(*) AS n FROM requests WHERE method = 'POST' AND path = ?"
            " GROUP BY substr(received_at, 1, 19) ORDER BY n DESC LIMIT 1",
            (path,),
        ).fetchone()
        span = conn.execute(
            "SELECT count(*) AS n, min(received_at) AS first, max(received_at) AS last"
            " FROM requests WHERE method = 'POST' AND path = ?",
            (path,),
        ).fetchone()
        if not span["n"]:
            return 0, 0.0
        seconds = (
            datetime.fromisoformat(span["last"]) - datetime.fromisoformat(span["first"])
        ).total_seconds()
        return int(peak["n"]), round(span["n"] / max(seconds, 1.0), 3)

    def note_in_flight(self, path: str, count: int) -> None:
        """A new highest number of writes in flight at once (``*``: all paths)."""
        with self.write() as conn:
            conn.execute(
                "INSERT INTO flight (path, max_in_flight) VALUES (?, ?)"
                " ON CONFLICT(path) DO UPDATE SET max_in_flight ="
                " max(max_in_flight, excluded.max_in_flight)",
                (path, count),
            )

    @staticmethod
    def _read_faults(conn: sqlite3.Connection) -> dict[str, int]:
        counters = dict.fromkeys(FAULT_COUNTERS, 0)
        for row in conn.execute("SELECT name, value FROM faults"):
            if row["name"] in counters:
                counters[row["name"]] = row["value"]
        return counters

    def get_faults(self) -> dict[str, int]:
        with self.read() as conn:
            return self._read_faults(conn)

    def set_faults(self, values: dict[str, int]) -> dict[str, int]:
        with self.write() as conn:
            conn.executemany(
                "INSERT OR REPLACE INTO faults (name, value) VALUES (?, ?)", values.items()
            )
            return self._read_faults(conn)

    def clear_faults(self) -> dict[str, int]:
        with self.write() as conn:
            conn.execute("DELETE FROM faults")
            return self._read_faults(conn)


# ---------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------


class SandboxServer(ThreadingHTTPServer):
    """ThreadingHTTPServer carrying the store and the two switches: key deduplication and
    deadline checking (both changeable at runtime: ``POST /mode``)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        *,
        store: SandboxStore,
        mode: str = "dedupe",
        verbose: bool = False,
        dedupe: bool | None = None,
        deadline: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.store = store
        self.dedupe = mode == "dedupe" if dedupe is None else dedupe
        self.deadline = deadline
        self.verbose = verbose
        # writes being handled now, and the most at once (SandboxServer.in_flight)
        self._flight: dict[str, int] = {}
        self._flight_max: dict[str, int] = {}
        self._flight_lock = threading.Lock()
        super().__init__(address, SandboxHandler)

    @property
    def mode(self) -> str:
        """The deduplication switch under its old name (``--mode``)."""
        return "dedupe" if self.dedupe else "nodedupe"

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "dedupe": self.dedupe, "deadline": self.deadline}

    @contextmanager
    def in_flight(self, path: str) -> Iterator[None]:
        """Count a write while this server applies it: from the moment it passed every
        refusal (a late request with deadline checking on, an injected 5xx) to its answer,
        or the dropped connection. A request refused, or a lookup, is never counted: it
        applies nothing, and a sender's concurrency limit bounds what a downstream accepts.
        A new highest count is written down at once, so it survives a restart of this
        process."""
        with self._flight_lock:
            peaks = []
            for name in (path, "*"):
                self._flight[name] = self._flight.get(name, 0) + 1
                if self._flight[name] > self._flight_max.get(name, 0):
                    self._flight_max[name] = self._flight[name]
                    peaks.append((name, self._flight[name]))
            for name, count in peaks:
                self.store.note_in_flight(name, count)
        try:
            yield
        finally:
            with self._flight_lock:
                for name in (path, "*"):
                    self._flight[name] -= 1


class _DropResponse(Exception):
    """Raised to close the connection without writing any response."""


def _require_str(body: dict[str, Any], name: str, *, code: str | None = None) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ApiError(400, code or f"missing_{name}", f"{name} must be a non-empty string")
    return value


class SandboxHandler(BaseHTTPRequestHandler):
    """Routes requests; HTTP/1.0, so every connection carries one request."""

    server: SandboxServer
    server_version = "AgentOpsSandbox/1.0"

    # -- plumbing ----------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _dispatch(self, method: str) -> None:
        # when it arrived, before its body is read: the clock a deadline check compares
        self._received_at = datetime.now(UTC)
        self._raw_body = self._read_body()
        url = urlsplit(self.path)
        self._query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        path = url.path.rstrip("/") or "/"
        try:
            response = self._route(method, path)
        except _DropResponse:
            self._drop_connection()
            return
        except ApiError as exc:
            response = Response(exc.status, exc.payload())
        except Exception as exc:  # pragma: no cover - defensive
            self.log_error("internal error: %r", exc)
            response = Response(500, {"error": "internal", "detail": repr(exc)})
        self._send_json(response.status, response.payload)

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if not length:
            return b""
        try:
            return self.rfile.read(int(length))
        except ValueError:
            return b""

    def _json_body(self) -> dict[str, Any]:
        if not self._raw_body:
            raise ApiError(400, "invalid_json", "request body must be a JSON object")
        try:
            body = json.loads(self._raw_body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, "invalid_json", str(exc)) from exc
        if not isinstance(body, dict):
            raise ApiError(400, "invalid_json", "request body must be a JSON object")
        return body

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _drop_connection(self) -> None:
        """The "response lost" fault: close the socket without writing a byte."""
        self.close_connection = True
        with suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    # -- routing -----------------------------------------------------------

    def _route(self, method: str, path: str) -> Response:
        store = self.server.store
        if path == "/health":
            self._allow(method, "GET")
            return Response(200, {"ok": True, **self.server.describe()})
        if path == "/mode":
            self._allow(method, "POST")
            return Response(200, {"ok": True, **self._set_mode()})
        if path == "/orders":
            self._allow(method, "GET")
            return Response(200, {"orders": store.list_orders()})
        if path.startswith("/orders/"):
            self._allow(method, "GET")
            order = store.get_order(path.removeprefix("/orders/"))
            if order is None:
                raise ApiError(404, "not_found", "no such order")
            return Response(200, order)
        if path == "/refunds":
            self._allow(method, "GET", "POST")
            if method == "POST":
                return self._logged("POST", path, "write", self._post_refund)
            return self._lookup_refunds(path)
        if path == "/refunds/all":
            self._allow(method, "GET")
            return Response(200, {"refunds": store.all_refunds()})
        if path == "/notifications":
            self._allow(method, "GET", "POST")
            if method == "GET":
                return Response(200, {"notifications": store.all_notifications()})
            return self._logged("POST", path, "other", self._post_notification)
        if path == "/requests":
            self._allow(method, "GET")
            late = self._query.get("late")
            if late not in (None, "0", "1"):
                raise ApiError(400, "invalid_query", "late must be 0 or 1")
            requests = store.list_requests(
                idempotency_key=self._query.get("idempotency_key"),
                path=self._query.get("path"),
                method=self._query.get("method"),
                late=None if late is None else late == "1",
            )
            return Response(200, {"requests": requests})
        if path == "/requests/summary":
            self._allow(method, "GET")
            return Response(200, store.request_summary())
        if path == "/faults":
            self._allow(method, "GET", "POST", "DELETE")
            if method == "POST":
                return Response(200, store.set_faults(self._parse_faults()))
            if method == "DELETE":
                return Response(200, store.clear_faults())
            return Response(200, store.get_faults())
        if path == "/reset":
            self._allow(method, "POST")
            store.reset()
            with self.server._flight_lock:
                self.server._flight_max.clear()
            return Response(200, {"ok": True})
        raise ApiError(404, "not_found", f"no route for {path}")

    @staticmethod
    def _allow(method: str, *allowed: str) -> None:
        if method not in allowed:
            raise ApiError(405, "method_not_allowed", f"allowed: {', '.join(allowed)}")

    def _key_hint(self) -> str | None:
        """Best-effort idempotency key for the request log, before validation."""
        if "idempotency_key" in self._query:
            return self._query["idempotency_key"]
        try:
            body = json.loads(self._raw_body) if self._raw_body else None
        except (ValueError, UnicodeDecodeError):
            return None
        if isinstance(body, dict) and isinstance(body.get("idempotency_key"), str):
            return body["idempotency_key"]
        return None

    def _logged(
        self, method: str, path: str, kind: str, handler: Callable[[Fault], Response]
    ) -> Response:
        """Log the request, refuse it if it is late and deadlines are checked, apply its
        fault, run ``handler``, record the outcome. A write counts as in flight only while
        it is being applied (``SandboxServer.in_flight``)."""
        store = self.server.store
        try:
            received = self._received()
            header_fault = Fault.from_header(self.headers.get(FAULT_HEADER))
        except ApiError as exc:
            log_id, _ = store.log_request(
                path=path,
                method=method,
                idempotency_key=self._key_hint(),
                header_fault=Fault(),
                kind=kind,
                received=Received(self._received_at.isoformat(timespec="microseconds")),
            )
            store.finish_request(log_id, applied=False, response_status=exc.status)
            raise
        refuse = (
            received.late and self.server.deadline and method == "POST" and path in DEADLINE_PATHS
        )
        log_id, fault = store.log_request(
            path=path,
            method=method,
            idempotency_key=self._key_hint(),
            header_fault=header_fault,
            kind=kind,
            received=received,
            refused=refuse,
        )
        if refuse:
            store.finish_request(log_id, applied=False, response_status=409)
            return Response(
                409,
                {
                    "error": LATE_CODE,
                    "detail": "received after its send deadline; not applied",
                    "received_at": received.at,
                    "send_deadline": received.send_deadline,
                },
            )
        if fault.kind == "5xx":
            store.finish_request(log_id, applied=False, response_status=503)
            return Response(503, {"error": "unavailable", "detail": "injected fault"})
        # past every refusal: from here the request is applied (its latency, its handler),
        # and a write counts as in flight until its answer or its dropped connection. A
        # lookup or a refused request applies nothing: a concurrency limit does not cover it
        counted = self.server.in_flight(path) if method == "POST" else nullcontext()
        with counted:
            if fault.kind == "latency":
                time.sleep(fault.latency_ms / 1000)
            try:
                response = handler(fault)
            except ApiError as exc:
                response = Response(exc.status, exc.payload())
            except Exception as exc:  # record the outcome even when something breaks
                self.log_error("internal error: %r", exc)
                response = Response(500, {"error": "internal", "detail": repr(exc)})
            if fault.kind == "drop":
                store.finish_request(log_id, applied=response.applied, response_status=None)
                raise _DropResponse
            store.finish_request(log_id, applied=response.applied, response_status=response.status)
        return response

    def _received(self) -> Received:
        """When this request arrived and what its deadline headers say (ApiError for a
        malformed send deadline)."""
        at = self._received_at
        fence = self.headers.get(FENCE_HEADER)
        raw = self.headers.get(SEND_DEADLINE_HEADER)
        if raw is None or not raw.strip():
            return Received(at.isoformat(timespec="microseconds"), fence=fence)
        deadline = parse_deadline(raw)
        return Received(
            at.isoformat(timespec="microseconds"),
            fence=fence,
            send_deadline=deadline.astimezone(UTC).isoformat(timespec="microseconds"),
            late=at >= deadline,
        )

    def _set_mode(self) -> dict[str, Any]:
        body = self._json_body()
        unknown = sorted(set(body) - {"dedupe", "deadline"})
        if unknown:
            raise ApiError(400, "invalid_mode", f"unknown fields: {', '.join(unknown)}")
        for name, value in body.items():
            if not isinstance(value, bool):
                raise ApiError(400, "invalid_mode", f"{name} must be true or false")
        # plain attribute assignments: every request reads the switches once
        if "dedupe" in body:
            self.server.dedupe = body["dedupe"]
        if "deadline" in body:
            self.server.deadline = body["deadline"]
        return self.server.describe()

    # -- endpoints ---------------------------------------------------------

    def _post_refund(self, fault: Fault) -> Response:
        body = self._json_body()
        key = _require_str(body, "idempotency_key")
        order_id = _require_str(body, "order_id")
        amount = body.get("amount_cents")
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise ApiError(400, "invalid_amount", "amount_cents must be an integer")
        if amount <= 0:
            raise ApiError(422, "invalid_amount", "amount_cents must be positive")
        reason = body.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise ApiError(400, "invalid_reason", "reason must be a string")
        return self.server.store.apply_refund(
            idempotency_key=key,
            order_id=order_id,
            amount_cents=amount,
            reason=reason,
            dedupe=self.server.dedupe,
        )

    def _lookup_refunds(self, path: str) -> Response:
        key = self._query.get("idempotency_key")
        if not key:
            raise ApiError(400, "missing_idempotency_key", "pass ?idempotency_key=K")
        return self._logged("GET", path, "lookup", self._answer_lookup)

    def _answer_lookup(self, fault: Fault) -> Response:
        if fault.kind == "lookup_error":
            return Response(500, {"error": "lookup_failed", "detail": "injected fault"})
        if fault.kind == "lookup_unknown":
            return Response(200, {"found": None, "detail": "unknown", "refunds": []})
        refunds = self.server.store.refunds_for_key(self._query["idempotency_key"])
        return Response(200, {"found": bool(refunds), "refunds": refunds})

    def _post_notification(self, fault: Fault) -> Response:
        body = self._json_body()
        to = _require_str(body, "to", code="invalid_notification")
        subject = _require_str(body, "subject", code="invalid_notification")
        text = _require_str(body, "body", code="invalid_notification")
        key = body.get("idempotency_key")
        if key is not None and not isinstance(key, str):
            raise ApiError(400, "invalid_notification", "idempotency_key must be a string")
        return self.server.store.create_notification(
            to=to, subject=subject, body=text, idempotency_key=key
        )

    def _parse_faults(self) -> dict[str, int]:
        body = self._json_body()
        unknown = sorted(set(body) - set(FAULT_COUNTERS))
        if unknown:
            raise ApiError(400, "invalid_faults", f"unknown fields: {', '.join(unknown)}")
        values: dict[str, int] = {}
        for name, value in body.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ApiError(400, "invalid_faults", f"{name} must be a non-negative integer")
            values[name] = value
        return values


# ---------------------------------------------------------------------------
# Process entry point
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m agentops.demo.sandbox",
        description="Sandbox payments service (the external system for crash tests).",
    )
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument("--db", default=DEFAULT_DB, help="SQLite file (parent dir is created)")
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="dedupe",
        help="key deduplication on (dedupe, the default) or off; --dedupe/--no-dedupe win",
    )
    parser.add_argument(
        "--dedupe",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="deduplicate refunds by idempotency key (default: from --mode)",
    )
    parser.add_argument(
        "--deadline",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="refuse a refund or notification received after its X-Agentops-Send-Deadline "
        "(default: off)",
    )
    parser.add_argument("--verbose", action="store_true", help="log each request to stderr")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    db_path = Path(args.db)
    db_path.parent.mkdir(parents=True, exist_ok=True)
    store = SandboxStore(db_path)
    store.initialize()

    server = SandboxServer(
        (args.host, args.port),
        store=store,
        mode=args.mode,
        dedupe=args.dedupe,
        deadline=args.deadline,
        verbose=args.verbose,
    )
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="sandbox-http", daemon=True
    )
    thread.start()
    host, port = server.server_address[:2]
    print(
        f"sandbox listening on http://{host}:{port} mode={server.mode} "
        f"deadline={'on' if server.deadline else 'off'}",
        flush=True,
    )
    try:
        while not stop.wait(0.1):
            pass
    finally:
        server.shutdown()
        server.server_close()
    return 0


# ---------------------------------------------------------------------------
# Helpers for tests and the crash harness
# ---------------------------------------------------------------------------


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class SandboxProcess:
    """A running sandbox subprocess; ``stop()`` it or use it as a context manager."""

    url: str
    port: int
    process: subprocess.Popen[bytes]
    db_path: str
    mode: str
    deadline: bool = False
    _log_dir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) written by the process so far."""
        if self._log_dir is None:
            return "", ""
        base = Path(self._log_dir.name)

        def read(name: str) -> str:
            path = base / name
            return path.read_text(errors="replace") if path.exists() else ""

        return read("stdout.log"), read("stderr.log")

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, wait ``timeout`` seconds, then SIGKILL. Returns the exit code."""
        if self.process.poll() is None:
            with suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    self.process.kill()
                self.process.wait(timeout)
        if self._log_dir is not None:
            self._log_dir.cleanup()
            self._log_dir = None
        return self.process.returncode

    def __enter__(self) -> SandboxProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_sandbox(
    db_path: str | os.PathLike[str],
    mode: str = "nodedupe",
    port: int | None = None,
    *,
    host: str = DEFAULT_HOST,
    timeout: float = 10.0,
    deadline: bool = False,
) -> SandboxProcess:
    """Launch ``python -m agentops.demo.sandbox`` and wait until /health answers.
    ``mode`` is the key deduplication switch, ``deadline`` the deadline check's.

    ``port=None`` lets the server pick a free port itself (``--port 0``) and reads
    it back from the "listening" line, which avoids races between processes.
    Raises RuntimeError (with the process's stderr) if it does not come up.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    log_dir = tempfile.TemporaryDirectory(prefix="sandbox-")
    stdout_path = Path(log_dir.name) / "stdout.log"
    stderr_path = Path(log_dir.name) / "stderr.log"
    cmd = [
        sys.executable,
        "-m",
        "agentops.demo.sandbox",
        "--host",
        host,
        "--port",
        str(port if port is not None else 0),
        "--db",
        str(db_path),
        "--mode",
        mode,
        "--deadline" if deadline else "--no-deadline",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        process = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=env,
            start_new_session=True,
        )
    sandbox = SandboxProcess(
        url="",
        port=0,
        process=process,
        db_path=str(db_path),
        mode=mode,
        deadline=deadline,
        _log_dir=log_dir,
    )

    def fail(reason: str) -> RuntimeError:
        stdout, stderr = sandbox.output()
        sandbox.stop()
        return RuntimeError(
            f"sandbox did not start: {reason}\nstdout:\n{stdout}\nstderr:\n{stderr}"
        )

    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise fail(f"process exited with code {process.returncode}")
        if time.monotonic() > deadline:
            raise fail(f"no answer on /health within {timeout:.0f}s")
        if not sandbox.url:
            for line in stdout_path.read_text(errors="replace").splitlines():
                prefix = "sandbox listening on "
                if line.startswith(prefix):
                    sandbox.url = line.removeprefix(prefix).split()[0]
                    sandbox.port = int(sandbox.url.rsplit(":", 1)[1])
        if sandbox.url:
            try:
                with urllib.request.urlopen(f"{sandbox.url}/health", timeout=1.0) as resp:
                    if resp.status == HTTPStatus.OK:
                        return sandbox
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(main())

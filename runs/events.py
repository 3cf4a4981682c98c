"""The one way to append to a run's record.

``checkpoint()`` opens a transaction, locks the run row (filtered on the caller's fence when
it holds the lease), collects events and run-field updates, and on success writes the events
with gap-free ``seq`` numbers and a per-run hash chain plus ONE conditional UPDATE of the run.
A fenced write that matches no row means the lease was lost: ``LeaseLost`` is raised and the
whole transaction rolls back, so a zombie worker changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import DateTimeField, ExpressionWrapper, F, Value
from django.db.models.expressions import CombinedExpression
from django.db.models.functions import Now
from django.utils import timezone

from runs import fastsql, faults, metrics, tracing
from runs.models import Run, RunEvent


class LeaseLost(Exception):
    """This process no longer holds the run's lease: stop at once, write nothing more."""


class RunNotFound(LookupError):
    pass


def lease_expiry_expression(seconds: float | None = None) -> ExpressionWrapper:
    ttl = settings.AGENTOPS["LEASE_TTL"] if seconds is None else seconds
    expression = ExpressionWrapper(Now() + timedelta(seconds=ttl), output_field=DateTimeField())
    # recognised by the checkpoint's own UPDATE (_update_run), which writes it without the ORM
    expression.lease_ttl = float(ttl)
    return expression


def anchor_hash(run_id: Any) -> str:
    return hashlib.sha256(f"agentops-run:{run_id}".encode()).hexdigest()


def payload_digest(payload: Any) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def event_hash(event: RunEvent) -> str:
    """Hash over the event's fields, its payload digest and the previous event's hash."""
    parts = [
        event.prev_hash,
        str(event.run_id),
        str(event.seq),
        event.created_at.isoformat(),
        event.type,
        event.actor,
        event.channel,
        "" if event.incarnation is None else str(event.incarnation),
        event.payload_digest,
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


@dataclass
class Checkpoint:
    run: Run
    actor: str
    channel: str
    fence: int | None
    events: list[RunEvent] = field(default_factory=list)
    updates: dict[str, Any] = field(default_factory=dict)
    boundaries: list[str] = field(default_factory=list)

    def event(self, type: str, **payload: Any) -> None:
        # Stored as JSON: reduce to JSON values now (a Decimal budget, a UUID, a datetime
        # become strings) so the insert cannot fail and the digest hashed is the digest of
        # what an auditor reads back.
        payload = json.loads(json.dumps(payload, default=str))
        self.events.append(
            RunEvent(
                run_id=self.run.id,
                type=type,
                actor=self.actor,
                channel=self.channel,
                incarnation=self.fence if self.fence is not None else self.run.fence,
                payload=payload,
                trace_id=self.run.trace_id,
                span_id=tracing.current_span_id(self.run.trace_id),
            )
        )

    def update(self, **fields: Any) -> None:
        self.updates.update(fields)

    def boundary(self, name: str) -> None:
        """Mark that this commit contains a checkpoint boundary (for fault injection)."""
        self.boundaries.append(name)


_LOCKED_FIELDS = (
    "id",
    "status",
    "fence",
    "event_seq",
    "last_event_hash",
    "requested_action",
    "requested_by",
    "requested_reason",
    "trace_id",
    "root_run_id",
    "agent_name",
    "agent_version",
    "principal_id",
    # budget limits: an operator may raise them under a live lease (run_topup_budget)
    "max_steps",
    "max_cost",
    "max_tokens",
    "deadline",
)


# The hot path (docs/benchmarks.md): every step takes two checkpoints, and on PostgreSQL
# building these two statements through the ORM cost more CPU than the database spent
# executing them. Their SQL is built once from the models' metadata (so a new column is
# picked up) and run through the connection's cursor (so query logging and execute
# wrappers still see them). SQLite keeps the ORM: its values need the ORM's converters.
_sql_cache: dict[str, Any] = {}


def _raw_sql_ok() -> bool:
    return connection.vendor == "postgresql"


def _lock(run_id: Any, fence: int | None) -> Run | None:
    """The run row, locked for this transaction (filtered on ``fence`` when given)."""
    if not _raw_sql_ok():
        query = Run.objects.select_for_update().only(*_LOCKED_FIELDS).filter(id=run_id)
        if fence is not None:
            query = query.filter(fence=fence)
        return query.first()
    key = "lock_fenced" if fence is not None else "lock"
    if key not in _sql_cache:
        # in the model's field order: Model.from_db() maps a partial row by that order
        wanted = {Run._meta.get_field(name).attname for name in _LOCKED_FIELDS}
        fields = [f for f in Run._meta.concrete_fields if f.attname in wanted]
        columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
        where = f"{connection.ops.quote_name('id')} = %s"
        if fence is not None:
            where += f" AND {connection.ops.quote_name('fence')} = %s"
        _sql_cache[key] = (
            f"SELECT {columns} FROM {connection.ops.quote_name(Run._meta.db_table)} "
            f"WHERE {where} FOR UPDATE",
            [f.attname for f in fields],
        )
    sql, attnames = _sql_cache[key]
    with connection.cursor() as cursor:
        cursor.execute(sql, [run_id] if fence is None else [run_id, fence])
        row = cursor.fetchone()
    return None if row is None else Run.from_db(connection.alias, attnames, row)


def _insert_events(events: list[RunEvent]) -> None:
    if not _raw_sql_ok():
        RunEvent.objects.bulk_create(events)
        return
    if "events" not in _sql_cache:
        fields = [f for f in RunEvent._meta.concrete_fields if not f.primary_key]
        columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
        _sql_cache["events"] = (
            f"INSERT INTO {connection.ops.quote_name(RunEvent._meta.db_table)} ({columns}) VALUES ",
            "(" + ", ".join(["%s"] * len(fields)) + ")",
            fastsql.plan(fields),
        )
    head, row, fields = _sql_cache["events"]
    params: list[Any] = []
    for event in events:
        # created_at is set by _write (an auto_now_add field stamped here would differ from
        # the time the hash covers): insert as an update would, not stamping it again
        params += fastsql.row_values(event, fields, False)
    pk = connection.ops.quote_name(RunEvent._meta.pk.column)
    with connection.cursor() as cursor:
        cursor.execute(f"{head}{', '.join([row] * len(events))} RETURNING {pk}", params)
        ids = [r[0] for r in cursor.fetchall()]
    # the ids come back in VALUES order (a single-statement INSERT ... RETURNING)
    for event, pk_value in zip(events, ids, strict=True):
        event.pk = pk_value
        event._state.adding = False
        event._state.db = connection.alias


def _update_run(run_id: Any, fence: int | None, updates: dict[str, Any]) -> int | None:
    """The checkpoint's one UPDATE of the run, as SQL written here for the values a
    checkpoint carries (plain values, ``Now()``, ``F(field) +/- value``, the lease expiry);
    None for anything else, which then goes through the ORM. The SQL is cached per shape
    (which fields, and how each is set): a run's checkpoints come in a handful of shapes."""
    if not _raw_sql_ok():
        return None
    shape, params = [], []
    for name, value in updates.items():
        if isinstance(value, ExpressionWrapper) and getattr(value, "lease_ttl", None) is not None:
            shape.append((name, "lease", None))
            params.append(value.lease_ttl)
        elif isinstance(value, Now):
            shape.append((name, "now", None))
        elif (
            isinstance(value, CombinedExpression)
            and value.connector in ("+", "-")
            and isinstance(value.lhs, F)
            and isinstance(value.rhs, Value)
            and isinstance(value.rhs.value, int)
        ):
            shape.append((name, value.connector, value.lhs.name))
            params.append(value.rhs.value)
        elif hasattr(value, "resolve_expression"):
            return None
        else:
            shape.append((name, "value", None))
            params.append(value)
    key = ("update", fence is not None, tuple(shape))
    if key not in _sql_cache:
        quote = connection.ops.quote_name
        assignments, fields = [], []
        for name, kind, source in shape:
            field = Run._meta.get_field(name)
            column = quote(field.column)
            if kind == "lease":
                assignments.append(f"{column} = STATEMENT_TIMESTAMP() + make_interval(secs => %s)")
            elif kind == "now":
                assignments.append(f"{column} = STATEMENT_TIMESTAMP()")
            elif kind in ("+", "-"):
                assignments.append(
                    f"{column} = {quote(Run._meta.get_field(source).column)} {kind} %s"
                )
            else:
                assignments.append(f"{column} = %s")
            if kind == "value":
                fields.append(field)
        where = f"{quote('id')} = %s"
        if fence is not None:
            where += f" AND {quote('fence')} = %s"
        _sql_cache[key] = (
            f"UPDATE {quote(Run._meta.db_table)} SET {', '.join(assignments)} WHERE {where}",
            fields,
        )
    sql, fields = _sql_cache[key]
    # plain values through their fields (JSON, decimals), in the order they were collected
    prepared = iter(fields)
    params = [
        next(prepared).get_db_prep_save(value, connection) if kind == "value" else value
        for (_name, kind, _source), value in zip(
            [item for item in shape if item[1] != "now"], params, strict=True
        )
    ]
    params.append(run_id)
    if fence is not None:
        params.append(fence)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


@contextmanager
def checkpoint(
    run_id: Any,
    *,
    actor: str,
    channel: str,
    fence: int | None = None,
    renew_lease: bool = True,
    locked: Run | None = None,
) -> Iterator[Checkpoint]:
    """Lock the run and append events atomically. With ``fence`` the caller must hold the
    lease: any mismatch raises ``LeaseLost`` and nothing is written. ``locked``: the run
    as the caller read it after locking its row in the transaction this joins (the claim's
    UPDATE): it is not locked and read again."""
    started = time.perf_counter()
    with transaction.atomic(savepoint=False):
        run = locked if locked is not None else _lock(run_id, fence)
        if run is None:
            if fence is not None and Run.objects.filter(id=run_id).exists():
                raise LeaseLost(f"run {run_id}: fence {fence} is stale")
            raise RunNotFound(f"run {run_id} does not exist")
        cp = Checkpoint(run=run, actor=actor, channel=channel, fence=fence)
        yield cp
        _write(cp, renew_lease=renew_lease)
        for name in cp.boundaries:
            # fires right after the commit that contains the boundary (also when nested)
            transaction.on_commit(partial(faults.crash_point, name))
    # in-process latency histogram (runs/metrics.py): lock, append, update, commit
    metrics.CHECKPOINT_SECONDS.observe(time.perf_counter() - started)


# Called as ``listener(cp)`` inside the checkpoint's transaction, after its events are
# inserted: whatever a listener writes (webhook deliveries, runs.webhooks) commits or rolls
# back with the events themselves. Listeners must do no I/O.
_event_listeners: list[Callable[[Checkpoint], None]] = []


def register_event_listener(listener: Callable[[Checkpoint], None]) -> None:
    if listener not in _event_listeners:
        _event_listeners.append(listener)


def _write(cp: Checkpoint, *, renew_lease: bool) -> None:
    run = cp.run
    prev_hash = run.last_event_hash or anchor_hash(run.id)
    seq = run.event_seq
    now = timezone.now()
    for event in cp.events:
        seq += 1
        event.seq = seq
        event.created_at = now
        event.payload_digest = payload_digest(event.payload)
        event.prev_hash = prev_hash
        event.hash = event_hash(event)
        prev_hash = event.hash
    if cp.events:
        _insert_events(cp.events)
        for listener in _event_listeners:
            listener(cp)
    updates = dict(cp.updates)
    if cp.events:
        updates["event_seq"] = seq
        updates["last_event_hash"] = prev_hash
    if cp.fence is not None and renew_lease and "lease_expires_at" not in updates:
        updates["lease_expires_at"] = lease_expiry_expression()
    if not updates:
        return
    updates["updated_at"] = now
    updated = _update_run(run.id, cp.fence, updates)
    if updated is None:
        query = Run.objects.filter(id=run.id)
        if cp.fence is not None:
            query = query.filter(fence=cp.fence)
        updated = query.update(**updates)
    if updated != 1:
        # cannot happen while the row lock is held; on SQLite the IMMEDIATE transaction
        # serialises writers the same way
        raise LeaseLost(f"run {run.id}: lost the lease while writing")
    for key, value in updates.items():
        if not hasattr(value, "resolve_expression"):
            setattr(run, key, value)

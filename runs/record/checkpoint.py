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
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection, models, transaction
from django.db.models import DateTimeField, ExpressionWrapper, F, Value
from django.db.models.expressions import CombinedExpression
from django.db.models.functions import Now
from django.utils import timezone

from runs import dbtime, faults, metrics, tracing
from runs.models import Run, RunEvent
from runs.record import rows


class LeaseLost(Exception):
    """This process no longer holds the run's lease: stop at once, write nothing more."""


class RunNotFound(LookupError):
    pass


def lease_expiry_expression(seconds: float | None = None) -> ExpressionWrapper:
    ttl = settings.AGENTOPS["LEASE_TTL"] if seconds is None else seconds
    expression = ExpressionWrapper(Now() + timedelta(seconds=ttl), output_field=DateTimeField())
    # recognised by the checkpoint's own UPDATE (_update_sql), which writes it without the ORM
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


class Event:
    """An event on its way into the record: a ``RunEvent`` row once written, a plain object
    until then (building a model instance per event cost more than the rest of its write).
    ``seq``, ``created_at``, ``prev_hash`` and ``hash`` are set by the write."""

    __slots__ = tuple(f.attname for f in RunEvent._meta.concrete_fields if not f.primary_key)

    def __init__(self, **values: Any) -> None:
        for name in self.__slots__:
            setattr(self, name, values.get(name))

    def as_model(self) -> RunEvent:
        return RunEvent(**{name: getattr(self, name) for name in self.__slots__})


@dataclass
class Checkpoint:
    run: Run
    actor: str
    channel: str
    fence: int | None
    events: list[Event] = field(default_factory=list)
    updates: dict[str, Any] = field(default_factory=dict)
    boundaries: list[str] = field(default_factory=list)
    inserts: list[models.Model] = field(default_factory=list)
    row_updates: list[tuple[type[models.Model], Any, dict[str, Any]]] = field(default_factory=list)

    def event(self, type: str, **payload: Any) -> None:
        # Stored as JSON: reduce to JSON values now (a Decimal budget, a UUID, a datetime
        # become strings) so the insert cannot fail and the digest hashed (at the write: the
        # payload may still be amended in the checkpoint's body) is the digest of what an
        # auditor reads back.
        payload = json.loads(json.dumps(payload, default=str))
        self.events.append(
            Event(
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

    def insert(self, obj: models.Model) -> None:
        """Insert ``obj`` in this commit, after the objects given before it. A foreign key
        to one of those (assigned while it was unsaved) is filled in from it. On PostgreSQL
        these rows, the events and the run's update go to the database as ONE statement."""
        self.inserts.append(obj)

    def update_row(self, model: type[models.Model], pk: Any, **values: Any) -> None:
        """``UPDATE`` one row (plain values) in this commit, with the events: on PostgreSQL
        in the commit's one statement. The row must exist; nothing reads it back before the
        commit."""
        self.row_updates.append((model, pk, values))

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


# What others may change while a worker holds the lease (an operator's request, budget limits
# an operator may raise): every checkpoint reads them back — from the locked row, or from the
# RETURNING of the write that does not lock (``checkpoint(expect=...)``).
LIVE_FIELDS = (
    "requested_action",
    "requested_by",
    "requested_reason",
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
_sql_cache: dict[Any, Any] = {}


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


def _insert_events(events: list[Event]) -> None:
    """The events alone (a checkpoint that is not one statement: SQLite, an unusual update)."""
    RunEvent.objects.bulk_create([event.as_model() for event in events])


def _update_sql(
    run_id: Any, fence: int | None, updates: dict[str, Any]
) -> tuple[str, list[Any]] | None:
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
            # through the field (JSON, decimals)
            params.append(rows.prepare(Run._meta.get_field(name), value))
    key = ("update", fence is not None, tuple(shape))
    if key not in _sql_cache:
        quote = connection.ops.quote_name
        assignments = []
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
        where = f"{quote('id')} = %s"
        if fence is not None:
            where += f" AND {quote('fence')} = %s"
        _sql_cache[key] = (
            f"UPDATE {quote(Run._meta.db_table)} SET {', '.join(assignments)} WHERE {where}"
        )
    sql = _sql_cache[key]
    params.append(run_id)
    if fence is not None:
        params.append(fence)
    return sql, params


def _links(obj: models.Model, earlier: list[models.Model]) -> list[tuple[models.Field, int]]:
    """Foreign keys of ``obj`` that point at an object inserted before it in the same
    checkpoint: (the field, that object's index)."""
    found = []
    for model_field in obj._meta.concrete_fields:
        if model_field.is_relation and model_field.is_cached(obj):
            target = model_field.get_cached_value(obj)
            for index, other in enumerate(earlier):
                if other is target:
                    found.append((model_field, index))
    return found


def _link(obj: models.Model, inserts: list[models.Model]) -> None:
    for model_field, index in _links(obj, inserts[: inserts.index(obj)]):
        setattr(obj, model_field.attname, inserts[index].pk)
        # setting the key drops the cached object: keep it (no query to read it back)
        model_field.set_cached_value(obj, inserts[index])


def _write_in_one_statement(cp: Checkpoint, update: tuple[str, list[Any]], expect_seq: int) -> int:
    """PostgreSQL: the checkpoint's rows, its events and the run's UPDATE as one statement of
    data-modifying CTEs — one round trip instead of one per row (docs/benchmarks.md). The
    run's UPDATE comes first and holds only while the run's record still ends at
    ``expect_seq`` (and, fenced, while the lease is ours); every other row is written FROM
    it, so when it matches nothing, nothing at all is written. A row that references an
    earlier one (a tool call its step, a receipt its call) takes the key from that row's CTE.
    Returns the rows the run's UPDATE changed (0: nothing was written)."""
    links = [dict(_links(obj, cp.inserts[:index])) for index, obj in enumerate(cp.inserts)]
    # fields whose value is the statement's database time (runs.dbtime.DbNow)
    db_now = [dbtime.db_now_fields(obj) for obj in cp.inserts]
    update_sql, update_params = update
    key = (
        "one",
        tuple(
            (type(obj), tuple(sorted((f.attname, i) for f, i in link.items())), now_fields)
            for obj, link, now_fields in zip(cp.inserts, links, db_now, strict=True)
        ),
        tuple((model, tuple(values)) for model, _pk, values in cp.row_updates),
        update_sql,
    )
    if key not in _sql_cache:
        _sql_cache[key] = _one_statement_sql(cp, links, update_sql, db_now)
    sql, plans, live = _sql_cache[key]
    # each row as ONE parameter, a JSON object PostgreSQL maps onto the table's columns
    # (json_populate_record): adapting a parameter per column cost more CPU than the rest
    params: list[Any] = [*update_params, expect_seq]
    for obj, plan, now_fields in zip(cp.inserts, plans, db_now, strict=True):
        params += [getattr(obj, attname).offset for attname in now_fields]
        params.append(_json({column: field.pre_save(obj, True) for column, field in plan}))
    for model, pk, values in cp.row_updates:
        params += [rows.prepare(model._meta.get_field(name), v) for name, v in values.items()]
        params.append(model._meta.pk.get_db_prep_value(pk, connection))
    params.append(
        _json(
            [{column: getattr(e, attname) for column, attname in _EVENT_COLUMNS} for e in cp.events]
        )
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    updated, rows_updated, *pks = row[: -len(live)]
    if not updated:
        return 0
    if rows_updated != len(cp.row_updates):
        # what save(update_fields=...) says; rolls the whole checkpoint back
        raise DatabaseError("a row the checkpoint updates is gone")
    for obj, pk_value, now_fields in zip(cp.inserts, pks, db_now, strict=True):
        _link(obj, cp.inserts)
        dbtime.clear(obj, now_fields)
        obj.pk = pk_value
        obj._state.adding = False
        obj._state.db = connection.alias
    # what others may have changed under the lease, as the UPDATE found the row
    for (attname, converters, model_field), value in zip(live, row[-len(live) :], strict=True):
        for converter in converters:
            value = converter(value, model_field, connection)
        setattr(cp.run, attname, value)
    return updated


# (column, attname) of an event row, as json_populate_recordset fills it
_EVENT_COLUMNS = [
    (f.column, f.attname) for f in RunEvent._meta.concrete_fields if not f.primary_key
]


def _json(value: Any) -> str:
    # datetimes, UUIDs and decimals as their text, which PostgreSQL reads back into the
    # column's type; JSON columns' values nest as they are
    return json.dumps(value, default=str, separators=(",", ":"))


def _one_statement_sql(
    cp: Checkpoint,
    links: list[dict[models.Field, int]],
    update_sql: str,
    db_now: list[tuple[str, ...]],
) -> tuple[str, list[Any], list[Any]]:
    quote = connection.ops.quote_name
    live = [Run._meta.get_field(name) for name in LIVE_FIELDS]
    ctes = [
        f"up AS ({update_sql} AND {quote(Run._meta.get_field('event_seq').column)} = %s "
        f"RETURNING {', '.join(quote(f.column) for f in live)})"
    ]
    plans, selected = [], []
    for index, (obj, link, now_fields) in enumerate(zip(cp.inserts, links, db_now, strict=True)):
        meta = obj._meta
        fields = [f for f in meta.concrete_fields if not f.primary_key]
        # pre_save: the attribute's value, or the stamp of an auto_now(_add) field
        plans.append(
            [(f.column, f) for f in fields if f not in link and f.attname not in now_fields]
        )
        table, pk = quote(meta.db_table), quote(meta.pk.column)
        exprs = [
            f"i{link[f]}.{quote(cp.inserts[link[f]]._meta.pk.column)}"
            if f in link
            else dbtime.DbNow.SQL
            if f.attname in now_fields
            else f"v.{quote(f.column)}"
            for f in fields
        ]
        sources = ", ".join(["up", *sorted({f"i{i}" for i in link.values()})])
        ctes.append(
            f"i{index} AS (INSERT INTO {table} ({', '.join(quote(f.column) for f in fields)}) "
            f"SELECT {', '.join(exprs)} FROM {sources}, "
            f"json_populate_record(NULL::{table}, %s::json) AS v RETURNING {pk})"
        )
        selected.append(f"(SELECT {pk} FROM i{index})")
    for index, (model, _pk, values) in enumerate(cp.row_updates):
        meta = model._meta
        table = quote(meta.db_table)
        assignments = ", ".join(f"{quote(meta.get_field(name).column)} = %s" for name in values)
        ctes.append(
            f"u{index} AS (UPDATE {table} SET {assignments} FROM up "
            f"WHERE {table}.{quote(meta.pk.column)} = %s RETURNING 1)"
        )
    counted = " + ".join(f"(SELECT count(*) FROM u{i})" for i in range(len(cp.row_updates)))
    events = quote(RunEvent._meta.db_table)
    columns = [quote(column) for column, _attname in _EVENT_COLUMNS]
    ctes.append(
        f"ev AS (INSERT INTO {events} ({', '.join(columns)}) "
        f"SELECT {', '.join('v.' + c for c in columns)} "
        f"FROM up, json_populate_recordset(NULL::{events}, %s::json) AS v)"
    )
    sql = (
        f"WITH {', '.join(ctes)} SELECT (SELECT count(*) FROM up), {counted or '0'}"
        f"{''.join(', ' + c for c in selected)}"
        f"{''.join(f', (SELECT {quote(f.column)} FROM up)' for f in live)}"
    )
    return sql, plans, [(f.attname, f.get_db_converters(connection), f) for f in live]


@contextmanager
def checkpoint(
    run_id: Any,
    *,
    actor: str,
    channel: str,
    fence: int | None = None,
    renew_lease: bool = True,
    locked: Run | None = None,
    expect: Run | None = None,
) -> Iterator[Checkpoint]:
    """Lock the run and append events atomically. With ``fence`` the caller must hold the
    lease: any mismatch raises ``LeaseLost`` and nothing is written. ``locked``: the run
    as the caller read it after locking its row in the transaction this joins (the claim's
    UPDATE): it is not locked and read again.

    ``expect`` (a lease holder's hot path): the run as this process last wrote it. On
    PostgreSQL the row is then not locked first: the body runs against ``expect`` and the
    commit is ONE statement (outside a transaction: its own) that holds only while the run's
    record still ends where ``expect`` says (``event_seq``) and the fence is ours. When
    someone wrote in between (an operator's request, a signal), it wrote nothing, and the
    checkpoint is written the ordinary way: lock, number the events after the record's new
    end, write. So the body must decide nothing from the run row that others may change but
    the ``LIVE_FIELDS`` (read back after the write either way), and may not touch the
    database itself: only ``cp.event/update/insert/update_row`` (a query in it raises; an
    ``on_commit`` callback would run at once, before the write: none either)."""
    started = time.perf_counter()
    if expect is not None and fence is not None and _raw_sql_ok():
        cp = Checkpoint(run=expect, actor=actor, channel=channel, fence=fence)
        with connection.execute_wrapper(_no_queries):
            yield cp
        if _write(cp, renew_lease=renew_lease, unlocked=True):
            # outside a transaction the statement committed: they fire at once
            _crash_points_on_commit(cp)
        else:
            with transaction.atomic(savepoint=False):
                cp.run = _lock_or_raise(run_id, fence)
                _write(cp, renew_lease=renew_lease)
                _crash_points_on_commit(cp)
    else:
        with transaction.atomic(savepoint=False):
            run = locked if locked is not None else _lock_or_raise(run_id, fence)
            cp = Checkpoint(run=run, actor=actor, channel=channel, fence=fence)
            # registered before the body, read after it: the fault points fire right after
            # the commit, before whatever the body asked to run after it (an outbox email's
            # send, runs.outbox): a kill at a boundary is a kill at the commit
            transaction.on_commit(partial(_crash_points_now, cp))
            yield cp
            _write(cp, renew_lease=renew_lease)
    # in-process latency histogram (runs/metrics.py): lock, append, update, commit
    metrics.CHECKPOINT_SECONDS.observe(time.perf_counter() - started)


def _crash_points_now(cp: Checkpoint) -> None:
    for name in cp.boundaries:
        faults.crash_point(name)


def _crash_points_on_commit(cp: Checkpoint) -> None:
    for name in cp.boundaries:
        # fires right after the commit that contains the boundary (also when nested)
        transaction.on_commit(partial(faults.crash_point, name))


def _lock_or_raise(run_id: Any, fence: int | None) -> Run:
    run = _lock(run_id, fence)
    if run is None:
        if fence is not None and Run.objects.filter(id=run_id).exists():
            raise LeaseLost(f"run {run_id}: fence {fence} is stale")
        raise RunNotFound(f"run {run_id} does not exist")
    if fence is not None and run.status != Run.Status.RUNNING:
        # an operator terminated or paused the run after its lease expired (services apply
        # that at once, without moving the fence): the holder, if it still lives, is done
        raise LeaseLost(f"run {run_id} is {run.status}: this incarnation's lease has ended")
    return run


def _no_queries(execute, sql, params, many, context):
    raise RuntimeError(
        "a checkpoint(expect=...) body may not query the database (it holds no lock and "
        "no transaction): write through the checkpoint, or use a locking checkpoint"
    )


# Called as ``listener(cp)`` inside the checkpoint's transaction, after its events are
# inserted, when one of them is of a type the listener asked for: whatever a listener writes
# (webhook deliveries, runs.webhooks) commits or rolls back with the events themselves.
# Listeners must do no I/O.
_event_listeners: list[tuple[Callable[[Checkpoint], None], frozenset[str]]] = []


def register_event_listener(listener: Callable[[Checkpoint], None], types: Iterable[str]) -> None:
    if all(known is not listener for known, _types in _event_listeners):
        _event_listeners.append((listener, frozenset(types)))


def _listeners(cp: Checkpoint) -> list[Callable[[Checkpoint], None]]:
    return [
        listener
        for listener, types in _event_listeners
        if any(event.type in types for event in cp.events)
    ]


def _write(cp: Checkpoint, *, renew_lease: bool, unlocked: bool = False) -> bool:
    """Number the events after the run's record, write everything. ``unlocked``: only as
    the one conditional statement (``checkpoint(expect=...)``); False when it wrote nothing
    (someone wrote in between, or the commit is not of that shape) — the caller then writes
    it the locked way."""
    run = cp.run
    prev_hash = run.last_event_hash or anchor_hash(run.id)
    expect_seq = seq = run.event_seq
    now = timezone.now()
    for event in cp.events:
        seq += 1
        event.seq = seq
        event.created_at = now
        event.payload_digest = payload_digest(event.payload)
        event.prev_hash = prev_hash
        event.hash = event_hash(event)
        prev_hash = event.hash
    updates = dict(cp.updates)
    if cp.events:
        updates["event_seq"] = seq
        updates["last_event_hash"] = prev_hash
    if cp.fence is not None and renew_lease and "lease_expires_at" not in updates:
        updates["lease_expires_at"] = lease_expiry_expression()
    if updates:
        updates["updated_at"] = now
    update = _update_sql(run.id, cp.fence, updates) if updates else None
    listeners = _listeners(cp) if cp.events else []
    if cp.events and update is not None:
        # without a lock and outside a transaction, a listener's rows need one with the events
        joined = unlocked and listeners and not connection.in_atomic_block
        with transaction.atomic(savepoint=False) if joined else nullcontext():
            updated = _write_in_one_statement(cp, update, expect_seq)
            if updated == 1:
                for listener in listeners:
                    listener(cp)
        if unlocked and updated != 1:
            return False
    elif unlocked:
        return False
    else:
        for obj in cp.inserts:
            _link(obj, cp.inserts)
            rows.insert(obj)
        for model, pk, values in cp.row_updates:
            if rows.update(model, pk, **values) != 1:
                raise DatabaseError(f"{model.__name__} {pk} is gone: not updated")
        if cp.events:
            _insert_events(cp.events)
            for listener in listeners:
                listener(cp)
        if not updates:
            return True
        if update is not None:
            with connection.cursor() as cursor:
                cursor.execute(*update)
                updated = cursor.rowcount
        else:
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
    return True

"""The record's PostgreSQL backend: every statement the write path sends, as literal SQL
built once per shape from the models' metadata (docs/benchmarks.md).

Why not the ORM: every step inserts a step, a tool call and a receipt and updates two of
them, and takes two checkpoints; through the ORM, building those statements cost more CPU
than PostgreSQL spent running them (profiled: about 1 ms per statement on a 2-vCPU machine).
Here their SQL is built once per model (a new column is picked up), values are prepared by
the model's own fields (``pre_save`` for ``auto_now``, ``get_db_prep_save`` for JSON,
decimals, UUIDs), and it runs through the connection's cursor, so query logging and execute
wrappers still see it. Same semantics as ``save(force_insert=True)`` and
``QuerySet.update()`` — no signals are sent (this project has none by convention).

Only ``runs.record`` calls this module; ``runs.record.orm`` is the same interface through
the ORM (SQLite).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar, cast

from django.db import DatabaseError, connection, models, transaction
from django.db.models import F, Value
from django.db.models.expressions import CombinedExpression
from django.db.models.fields import AutoFieldMixin
from django.db.models.functions import Now

from runs import dbtime
from runs.models import AgentManifest, Run, RunEvent, ToolCall
from runs.record import configcache
from runs.record.common import LIVE_FIELDS, link, links, write_rows

if TYPE_CHECKING:
    from collections.abc import Callable

    from runs.record.checkpoint import Checkpoint

M = TypeVar("M", bound=models.Model)

# a lease holder may commit without locking the run first (checkpoint(expect=...))
UNLOCKED_COMMITS = True

# every statement's SQL, by its shape (which model, which fields, how each is set)
_sql: dict[Any, Any] = {}


def _quote(name: str) -> str:
    return connection.ops.quote_name(name)


# --- one row ----------------------------------------------------------------------------------

# How a field's value reaches psycopg. Preparing every value through the field costs more
# than the rest of an insert (profiled): for the types below, PostgreSQL's backend passes the
# Python value through unchanged (strings, numbers, booleans, aware datetimes), so only
# ``auto_now`` stamps and the other types (JSON, UUID, decimals) go through the field.
_AS_IS, _STAMP, _PREPARE = 0, 1, 2
_AS_IS_TYPES = {
    models.AutoField,
    models.BigAutoField,
    models.BigIntegerField,
    models.BooleanField,
    models.CharField,
    models.IntegerField,
    models.PositiveIntegerField,
    models.PositiveSmallIntegerField,
    models.SmallIntegerField,
    models.TextField,
    models.DateTimeField,
}


def _field(model: type[models.Model], name: str) -> models.Field[Any, Any]:
    """A concrete field by name: the write path names only columns (``get_field`` also
    answers reverse relations and generic keys, which have none)."""
    return cast("models.Field[Any, Any]", model._meta.get_field(name))


# (model, field name) -> (the field, its mode): looked up at every update of every step
_fields: dict[tuple[type[models.Model], str], tuple[models.Field[Any, Any], int]] = {}


def _prepared(model: type[models.Model], name: str, value: Any) -> Any:
    """One plain value of the field ready for the cursor (as ``QuerySet.update()`` sends
    it); the field and its mode are found once."""
    try:
        field, mode = _fields[model, name]
    except KeyError:
        field = _field(model, name)
        mode = _fields.setdefault((model, name), (field, _mode(field)))[1]
    if mode == _AS_IS:
        return value
    return field.get_db_prep_save(value, connection)


def _converters(field: models.Field[Any, Any]) -> list[Any]:
    """What ``from_db`` applies to the column's raw value (``Field.get_db_converters``)."""
    return field.get_db_converters(connection)  # type: ignore[attr-defined]  # not in django-stubs 5.2


def _mode(field: models.Field) -> int:
    target = field.target_field if isinstance(field, models.ForeignObject) else field
    if type(target) not in _AS_IS_TYPES:
        return _PREPARE
    if getattr(field, "auto_now", False) or getattr(field, "auto_now_add", False):
        return _STAMP
    return _AS_IS


def _row_values(
    obj: models.Model, fields: list[tuple[str, int, models.Field]], db_now: tuple[str, ...]
) -> list:
    """The fields' values of ``obj`` ready for the cursor, as an insert by ``save()`` sends
    them (``auto_now_add`` stamped); for a ``db_now`` field, the offset of its ``DbNow``
    (the SQL adds it to the statement's time)."""
    out = []
    for attname, mode, field in fields:
        if attname in db_now:
            out.append(getattr(obj, attname).offset)
        elif mode == _AS_IS:
            out.append(getattr(obj, attname))
        elif mode == _STAMP:
            out.append(field.pre_save(obj, True))
        else:
            out.append(field.get_db_prep_save(field.pre_save(obj, True), connection))
    return out


def insert(obj: M) -> M:
    """``obj.save(force_insert=True)``; a ``DbNow`` value is the statement's database time
    (None on the object afterwards)."""
    db_now = dbtime.db_now_fields(obj)
    model = type(obj)
    key = ("insert", model, db_now)
    if key not in _sql:
        meta = model._meta
        # an auto-incremented key is left to the database and read back
        auto_pk = isinstance(meta.pk, AutoFieldMixin)
        fields = [f for f in meta.concrete_fields if not (auto_pk and f.primary_key)]
        values = ", ".join(dbtime.DbNow.SQL if f.attname in db_now else "%s" for f in fields)
        sql = (
            f"INSERT INTO {_quote(meta.db_table)} ({', '.join(_quote(f.column) for f in fields)}) "
            f"VALUES ({values})"
        )
        if auto_pk:
            sql += f" RETURNING {_quote(meta.pk.column)}"
        _sql[key] = (sql, [(f.attname, _mode(f), f) for f in fields], auto_pk)
    sql, fields, auto_pk = _sql[key]
    with connection.cursor() as cursor:
        cursor.execute(sql, _row_values(obj, fields, db_now))
        if auto_pk:
            obj.pk = cursor.fetchone()[0]
    dbtime.clear(obj, db_now)
    obj._state.adding = False
    obj._state.db = connection.alias
    return obj


def update(model: type[models.Model], pk: Any, **values: Any) -> int:
    """``model.objects.filter(pk=pk).update(**values)`` for plain values; rows changed."""
    meta = model._meta
    items = [(_field(model, name), value) for name, value in values.items()]
    sql = (
        f"UPDATE {_quote(meta.db_table)} SET "
        + ", ".join(f"{_quote(f.column)} = %s" for f, _value in items)
        + f" WHERE {_quote(meta.pk.column)} = %s"
    )
    params = [f.get_db_prep_save(value, connection) for f, value in items]
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, meta.pk.get_db_prep_value(pk, connection)])
        return cursor.rowcount


def save_fields(obj: models.Model, fields: list[str]) -> None:
    """``obj.save(update_fields=fields)`` (``auto_now`` fields among them are stamped)."""
    values = {name: _field(type(obj), name).pre_save(obj, False) for name in fields}
    if update(type(obj), obj.pk, **values) != 1:
        # what save(update_fields=...) raises when the row is gone
        raise DatabaseError("Save with update_fields did not affect any rows.")


# --- the run's row ----------------------------------------------------------------------------


def lock(run_id: Any, fence: int | None, fields: tuple[str, ...]) -> Run | None:
    """``SELECT <fields> … FOR UPDATE`` of the run (on ``fence`` when given)."""
    key = ("lock", fence is not None, fields)
    if key not in _sql:
        # in the model's field order: Model.from_db() maps a partial row by that order
        wanted = {_field(Run, name).attname for name in fields}
        selected = [f for f in Run._meta.concrete_fields if f.attname in wanted]
        where = f"{_quote('id')} = %s"
        if fence is not None:
            where += f" AND {_quote('fence')} = %s"
        _sql[key] = (
            f"SELECT {', '.join(_quote(f.column) for f in selected)} "
            f"FROM {_quote(Run._meta.db_table)} WHERE {where} FOR UPDATE",
            [f.attname for f in selected],
        )
    sql, attnames = _sql[key]
    with connection.cursor() as cursor:
        cursor.execute(sql, [run_id] if fence is None else [run_id, fence])
        row = cursor.fetchone()
    return None if row is None else Run.from_db(connection.alias, attnames, row)


def presend_row(
    call_id: Any, fence: int, attempt: int, holder: tuple[str, Any] | None
) -> tuple[Any, ...] | None:
    """``runs.record.rows.presend_row`` as literal SQL: it runs before every request a
    worker sends, and building it through the ORM cost more CPU than the rest of an
    idempotent step's reads (profiled)."""
    key = ("presend", holder is not None)
    if key not in _sql:
        call, run = ToolCall._meta, Run._meta

        def c(name: str) -> str:
            return "c." + _quote(_field(ToolCall, name).column)

        def r(name: str) -> str:
            return "r." + _quote(_field(Run, name).column)

        sql = (
            f"SELECT {c('dispatched_at')}, {c('send_deadline')}, {c('landing_deadline')},"
            f" STATEMENT_TIMESTAMP() FROM {_quote(call.db_table)} c"
            f" JOIN {_quote(run.db_table)} r ON r.{_quote(run.pk.column)} = {c('run')}"
            f" WHERE c.{_quote(call.pk.column)} = %(call)s AND {c('status')} = %(dispatching)s"
            f" AND {c('dispatch_incarnation')} = %(fence)s AND {c('attempt_count')} = %(attempt)s"
            f" AND {r('fence')} = %(fence)s AND {r('status')} = %(running)s"
            f" AND {c('send_deadline')} > STATEMENT_TIMESTAMP()"
        )
        if holder is not None:
            manifest = AgentManifest._meta
            owner = _quote(_field(AgentManifest, "owner").column)
            sql += (
                f" AND {r('lease_token_hash')} = %(token_hash)s"
                f" AND {r('lease_holder')} IS NOT DISTINCT FROM %(user)s"
                f" AND {r('agent_name')} IN (SELECT {_quote(manifest.pk.column)}"
                f" FROM {_quote(manifest.db_table)} WHERE {owner} IS NOT DISTINCT FROM %(user)s)"
            )
        _sql[key] = sql
    params: dict[str, Any] = {
        "call": call_id,
        "dispatching": ToolCall.Status.DISPATCHING.value,
        "running": Run.Status.RUNNING.value,
        "fence": fence,
        "attempt": attempt,
    }
    if holder is not None:
        params["token_hash"], params["user"] = holder
    with connection.cursor() as cursor:
        cursor.execute(_sql[key], params)
        return cursor.fetchone()


# a run field's plain value: neither a database expression nor database time
_PLAIN = frozenset({str, int, float, bool, type(None), datetime, dict, list})


def _run_update(run_id: Any, fence: int | None, updates: dict[str, Any]) -> tuple[str, list]:
    """The checkpoint's one UPDATE of the run, for the values a checkpoint carries: plain
    values, ``DbNow`` (the lease's expiry, in database time), ``Now()`` and
    ``F(field) ± number``. The SQL is cached per shape (which fields, and how each is set):
    a run's checkpoints come in a handful of shapes."""
    shape: list[tuple[str, str, str | None]] = []
    params: list[Any] = []
    for name, value in updates.items():
        kind = value.__class__
        if kind in _PLAIN:  # most values: no isinstance chain
            shape.append((name, "value", None))
            params.append(_prepared(Run, name, value))
        elif kind is dbtime.DbNow:
            shape.append((name, "db_now", None))
            params.append(value.offset)
        elif isinstance(value, Now):
            shape.append((name, "now", None))
        elif (
            isinstance(value, CombinedExpression)
            and value.connector in ("+", "-")
            and isinstance(value.lhs, F)
            and isinstance(value.rhs, Value)
        ):
            shape.append((name, value.connector, value.lhs.name))
            params.append(_prepared(Run, value.lhs.name, value.rhs.value))
        elif hasattr(value, "resolve_expression"):
            raise TypeError(f"a checkpoint cannot write {name} = {value!r}")
        else:
            shape.append((name, "value", None))
            params.append(_prepared(Run, name, value))  # JSON, decimals
    key = ("update", fence is not None, tuple(shape))
    if key not in _sql:
        assignments = []
        for name, kind, source in shape:
            column = _quote(_field(Run, name).column)
            if kind == "db_now":
                assignments.append(f"{column} = {dbtime.DbNow.SQL}")
            elif kind == "now":
                assignments.append(f"{column} = STATEMENT_TIMESTAMP()")
            elif kind in ("+", "-"):
                source_column = _quote(_field(Run, cast(str, source)).column)
                assignments.append(f"{column} = {source_column} {kind} %s")
            else:
                assignments.append(f"{column} = %s")
        where = f"{_quote('id')} = %s"
        if fence is not None:
            where += f" AND {_quote('fence')} = %s"
        _sql[key] = (
            f"UPDATE {_quote(Run._meta.db_table)} SET {', '.join(assignments)} WHERE {where}"
        )
    params.append(run_id)
    if fence is not None:
        params.append(fence)
    return _sql[key], params


# --- a checkpoint's commit ---------------------------------------------------------------------


def flush(
    cp: Checkpoint,
    updates: dict[str, Any],
    expect_seq: int,
    listeners: list[Callable[[Checkpoint], None]],
    *,
    unlocked: bool,
) -> int | None:
    """Write the checkpoint: its rows, its events, the run's update. With events, as ONE
    statement; without, row by row. Returns the run rows updated (1, or 0: the fence or the
    record's end did not match — nothing was written), None with no update of the run.
    ``unlocked``: only the one statement may write (0 when the commit has no events)."""
    if cp.events:
        run_update = _run_update(cp.run_id, cp.fence, updates)
        # without a lock and outside a transaction, a listener's rows need one with the events
        joined = unlocked and listeners and not connection.in_atomic_block
        with transaction.atomic(savepoint=False) if joined else nullcontext():
            updated = _write_in_one_statement(cp, run_update, expect_seq)
            if updated == 1:
                for listener in listeners:
                    listener(cp)
        return updated
    if unlocked:
        return 0
    write_rows(cp, insert, update)
    if not updates:
        return None
    with connection.cursor() as cursor:
        cursor.execute(*_run_update(cp.run_id, cp.fence, updates))
        return cursor.rowcount


def _write_in_one_statement(cp: Checkpoint, update: tuple[str, list[Any]], expect_seq: int) -> int:
    """The checkpoint's rows, its events and the run's UPDATE as one statement of
    data-modifying CTEs — one round trip instead of one per row (docs/benchmarks.md). The
    run's UPDATE comes first and holds only while the run's record still ends at
    ``expect_seq`` (and, fenced, while the lease is ours); every other row is written FROM
    it, so when it matches nothing, nothing at all is written. A row that references an
    earlier one (a tool call its step, a receipt its call) takes the key from that row's CTE.
    Returns the rows the run's UPDATE changed (0: nothing was written)."""
    found = [dict(links(obj, cp.inserts[:index])) for index, obj in enumerate(cp.inserts)]
    # fields whose value is the statement's database time (runs.dbtime.DbNow)
    db_now = [dbtime.db_now_fields(obj) for obj in cp.inserts]
    update_sql, update_params = update
    key = (
        "one",
        tuple(
            (type(obj), tuple(sorted((f.attname, i) for f, i in link_.items())), now_fields)
            for obj, link_, now_fields in zip(cp.inserts, found, db_now, strict=True)
        ),
        tuple((model, tuple(values)) for model, _pk, values in cp.row_updates),
        update_sql,
    )
    if key not in _sql:
        _sql[key] = _one_statement_sql(cp, found, update_sql, db_now, LIVE_FIELDS)
    sql, plans, live = _sql[key]
    # each row as ONE parameter, a JSON object PostgreSQL maps onto the table's columns
    # (json_populate_record): adapting a parameter per column cost more CPU than the rest
    params: list[Any] = [*update_params, expect_seq]
    for obj, plan, now_fields in zip(cp.inserts, plans, db_now, strict=True):
        params += [getattr(obj, attname).offset for attname in now_fields]
        params.append(_json({column: field.pre_save(obj, True) for column, field in plan}))
    for model, pk, values in cp.row_updates:
        params += [_prepared(model, name, v) for name, v in values.items()]
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
        link(obj, cp.inserts)
        dbtime.clear(obj, now_fields)
        obj.pk = pk_value
        obj._state.adding = False
        obj._state.db = connection.alias
    # what others may have changed under the lease, as the UPDATE found the row
    for (attname, converters, model_field), value in zip(live, row[-len(live) :], strict=True):
        for converter in converters:
            value = converter(value, model_field, connection)
        setattr(cp.known, attname, value)
    return updated


# (column, attname) of an event row, as json_populate_recordset fills it; the run's creation
# time (the events' partition key) comes from the run row the statement updates instead
_EVENT_COLUMNS = [
    (f.column, f.attname)
    for f in RunEvent._meta.concrete_fields
    if not f.primary_key and f.attname != "run_created_at"
]
_RUN_CREATED_AT = (
    _field(RunEvent, "run_created_at").column,
    _field(Run, "created_at").column,
)


def _json(value: Any) -> str:
    # datetimes, UUIDs and decimals as their text, which PostgreSQL reads back into the
    # column's type; JSON columns' values nest as they are
    return json.dumps(value, default=str, separators=(",", ":"))


def _one_statement_sql(
    cp: Checkpoint,
    found: list[dict[models.Field, int]],
    update_sql: str,
    db_now: list[tuple[str, ...]],
    live_fields: tuple[str, ...],
) -> tuple[str, list[Any], list[Any]]:
    live = [_field(Run, name) for name in live_fields]
    event_key, run_created = (_quote(column) for column in _RUN_CREATED_AT)
    ctes = [
        f"up AS ({update_sql} AND {_quote(_field(Run, 'event_seq').column)} = %s "
        f"RETURNING {', '.join(_quote(f.column) for f in live)}, "
        f"{run_created} AS run_created_for_events)"
    ]
    plans, selected = [], []
    for index, (obj, link_, now_fields) in enumerate(zip(cp.inserts, found, db_now, strict=True)):
        meta = obj._meta
        fields = [f for f in meta.concrete_fields if not f.primary_key]
        # pre_save: the attribute's value, or the stamp of an auto_now(_add) field
        plans.append(
            [(f.column, f) for f in fields if f not in link_ and f.attname not in now_fields]
        )
        table, pk = _quote(meta.db_table), _quote(meta.pk.column)
        exprs = [
            f"i{link_[f]}.{_quote(cp.inserts[link_[f]]._meta.pk.column)}"
            if f in link_
            else dbtime.DbNow.SQL
            if f.attname in now_fields
            else f"v.{_quote(f.column)}"
            for f in fields
        ]
        sources = ", ".join(["up", *sorted({f"i{i}" for i in link_.values()})])
        ctes.append(
            f"i{index} AS (INSERT INTO {table} ({', '.join(_quote(f.column) for f in fields)}) "
            f"SELECT {', '.join(exprs)} FROM {sources}, "
            f"json_populate_record(NULL::{table}, %s::json) AS v RETURNING {pk})"
        )
        selected.append(f"(SELECT {pk} FROM i{index})")
    for index, (model, _pk, values) in enumerate(cp.row_updates):
        meta = model._meta
        table = _quote(meta.db_table)
        assignments = ", ".join(f"{_quote(_field(model, name).column)} = %s" for name in values)
        ctes.append(
            f"u{index} AS (UPDATE {table} SET {assignments} FROM up "
            f"WHERE {table}.{_quote(meta.pk.column)} = %s RETURNING 1)"
        )
    counted = " + ".join(f"(SELECT count(*) FROM u{i})" for i in range(len(cp.row_updates)))
    events = _quote(RunEvent._meta.db_table)
    columns = [_quote(column) for column, _attname in _EVENT_COLUMNS]
    ctes.append(
        f"ev AS (INSERT INTO {events} ({', '.join(columns)}, {event_key}) "
        f"SELECT {', '.join('v.' + c for c in columns)}, up.run_created_for_events "
        f"FROM up, json_populate_recordset(NULL::{events}, %s::json) AS v)"
    )
    sql = (
        f"WITH {', '.join(ctes)} SELECT (SELECT count(*) FROM up), {counted or '0'}"
        f"{''.join(', ' + c for c in selected)}"
        f"{''.join(f', (SELECT {_quote(f.column)} FROM up)' for f in live)}"
    )
    return sql, plans, [(f.attname, _converters(f), f) for f in live]


# --- the claim (runs.engine.claim) ---------------------------------------------------------------

# by kind (remote or hosted) and the generations' SQL (runs.record.configcache)
_claim_sql: dict[tuple[bool, str], tuple[str, list[Any]]] = {}


def take_lease(
    run_id: Any, *, worker: str, remote: bool, ttl: float
) -> tuple[Run, bool, datetime] | None:
    """The same compare-and-set on PostgreSQL as ONE statement (docs/benchmarks.md: built
    through the ORM, the claim's three queries cost more CPU than a whole step). The
    subquery locks the row and reads the status it had — ``running`` means its last holder
    never released it (recovered) — and the UPDATE applies the ORM path's conditions to that
    same, locked row; RETURNING gives the row as updated and the database's time."""
    generations = configcache.generation_sql("postgresql")
    if (remote, generations) not in _claim_sql:
        quote = connection.ops.quote_name
        meta = Run._meta

        def col(name: str) -> str:
            return quote(_field(Run, name).column)

        fields = meta.concrete_fields
        table, manifests = quote(meta.db_table), quote(AgentManifest._meta.db_table)
        runnable = ", ".join(["%s"] * len(Run.RUNNABLE))
        now = "STATEMENT_TIMESTAMP()"
        sql = (
            f"UPDATE {table} AS r SET {col('fence')} = r.{col('fence')} + 1, "
            f"{col('lease_owner')} = %s, "
            f"{col('lease_expires_at')} = {now} + make_interval(secs => %s), "
            f"{col('status')} = %s, "
            f"{col('recovery_count')} = r.{col('recovery_count')} "
            f"+ CASE WHEN old.{col('status')} = %s THEN 1 ELSE 0 END, "
            f"{col('wake_at')} = NULL, {col('enqueued_at')} = NULL "
            f"FROM (SELECT {col('id')}, {col('status')} FROM {table} "
            f"WHERE {col('id')} = %s FOR UPDATE) AS old "
            f"WHERE r.{col('id')} = old.{col('id')} "
            f"AND (r.{col('status')} IN ({runnable}) OR (r.{col('status')} = %s "
            f"AND r.{col('wake_at')} IS NOT NULL AND r.{col('wake_at')} <= {now})) "
            f"AND {'' if remote else 'NOT '}(r.{col('agent_name')} IN "
            f"(SELECT {quote(_field(AgentManifest, 'name').column)} FROM {manifests})) "
            f"AND (r.{col('lease_expires_at')} IS NULL OR r.{col('lease_expires_at')} < {now}) "
            f"AND (r.{col('wake_at')} IS NULL OR r.{col('wake_at')} <= {now}) "
            # the configuration's generations: what changed is read again, only that
            f"RETURNING old.{col('status')}, {now}, {generations}, "
            + ", ".join(f"r.{quote(f.column)}" for f in fields)
        )
        _claim_sql[remote, generations] = (
            sql,
            [(f.attname, _converters(f), f) for f in fields],
        )
    sql, columns = _claim_sql[remote, generations]
    params = [
        worker,
        ttl,
        Run.Status.RUNNING.value,
        Run.Status.RUNNING.value,
        run_id,
        *[status.value for status in Run.RUNNABLE],
        Run.Status.WAITING_EVENT.value,
    ]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None:
        return None
    old_status, db_time, generation, *values = row
    configcache.note(generation)
    for index, (_attname, converters, model_field) in enumerate(columns):
        for converter in converters:
            values[index] = converter(values[index], model_field, connection)
    run = Run.from_db(connection.alias, [attname for attname, _c, _f in columns], values)
    return run, old_status == Run.Status.RUNNING, db_time

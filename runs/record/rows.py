"""The engine's per-step writes without the ORM's query building (docs/benchmarks.md).

Every step inserts a step, a tool call and a receipt and updates two of them. Through the
ORM, building those statements cost more CPU than PostgreSQL spent running them (profiled:
about 1 ms per statement on a 2-vCPU machine). Here their SQL is built once per model from
its metadata (a new column is picked up), values are prepared by the model's own fields
(``pre_save`` for ``auto_now``, ``get_db_prep_save`` for JSON, decimals, UUIDs), and it runs
through the connection's cursor, so query logging and execute wrappers still see it.

Same semantics as ``obj.save(force_insert=True)`` and ``QuerySet.update()`` — no signals are
sent (this project has none by convention). On anything but PostgreSQL these simply call
the ORM.
"""

from __future__ import annotations

from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections, models
from django.db.models.fields import AutoFieldMixin

from runs import dbtime

M = TypeVar("M", bound=models.Model)

_insert_sql: dict[
    tuple[type, tuple[str, ...]], tuple[str, list[tuple[str, int, models.Field]], bool]
] = {}

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


def _mode(field: models.Field) -> int:
    target = field.target_field if field.is_relation else field
    if type(target) not in _AS_IS_TYPES:
        return _PREPARE
    if getattr(field, "auto_now", False) or getattr(field, "auto_now_add", False):
        return _STAMP
    return _AS_IS


def plan(fields: list[models.Field]) -> list[tuple[str, int, models.Field]]:
    """Per field: its attribute name, how its value is prepared, the field."""
    return [(f.attname, _mode(f), f) for f in fields]


def prepare(field: models.Field, value: Any) -> Any:
    """One plain value of ``field`` ready for the cursor (as ``QuerySet.update()`` sends it)."""
    if _mode(field) == _AS_IS:
        return value
    return field.get_db_prep_save(value, connections[DEFAULT_DB_ALIAS])


def row_values(
    obj: models.Model,
    fields: list[tuple[str, int, models.Field]],
    add: bool,
    *,
    db_now: tuple[str, ...] = (),
) -> list:
    """The fields' values of ``obj`` ready for the cursor, as ``save()`` would send them
    (``add``: as for an insert, which ``auto_now_add`` stamps); for a ``db_now`` field, the
    offset of its ``DbNow`` (the SQL adds it to the statement's time)."""
    conn = connections[DEFAULT_DB_ALIAS]
    out = []
    for attname, mode, field in fields:
        if attname in db_now:
            out.append(getattr(obj, attname).offset)
        elif mode == _AS_IS:
            out.append(getattr(obj, attname))
        elif mode == _STAMP:
            out.append(field.pre_save(obj, add))
        else:
            out.append(field.get_db_prep_save(field.pre_save(obj, add), conn))
    return out


def _fast() -> bool:
    return connection.vendor == "postgresql"


def insert(obj: M) -> M:
    """``obj.save(force_insert=True)``; a ``runs.dbtime.DbNow`` value is the statement's
    database time (None on the object afterwards)."""
    db_now = dbtime.db_now_fields(obj)
    if not _fast():
        dbtime.resolve_in_python(obj)
        obj.save(force_insert=True)
        return obj
    model = type(obj)
    key = (model, db_now)
    if key not in _insert_sql:
        meta = model._meta
        # an auto-incremented key is left to the database and read back
        auto_pk = isinstance(meta.pk, AutoFieldMixin)
        fields = [f for f in meta.concrete_fields if not (auto_pk and f.primary_key)]
        quote = connection.ops.quote_name
        sql = (
            f"INSERT INTO {quote(meta.db_table)} ({', '.join(quote(f.column) for f in fields)}) "
            f"VALUES ({', '.join(dbtime.DbNow.SQL if f.attname in db_now else '%s' for f in fields)})"
        )
        if auto_pk:
            sql += f" RETURNING {quote(meta.pk.column)}"
        _insert_sql[key] = (sql, plan(fields), auto_pk)
    sql, fields, auto_pk = _insert_sql[key]
    params = row_values(obj, fields, True, db_now=db_now)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        if auto_pk:
            obj.pk = cursor.fetchone()[0]
    dbtime.clear(obj, db_now)
    obj._state.adding = False
    obj._state.db = connection.alias
    return obj


def create(model: type[M], **values: Any) -> M:
    """``model.objects.create(**values)``."""
    return insert(model(**values))


def update(model: type[models.Model], pk: Any, **values: Any) -> int:
    """``model.objects.filter(pk=pk).update(**values)`` for plain values; rows changed."""
    if not _fast() or any(hasattr(value, "resolve_expression") for value in values.values()):
        return model.objects.filter(pk=pk).update(**values)
    meta = model._meta
    quote = connection.ops.quote_name
    items = [(meta.get_field(name), value) for name, value in values.items()]
    sql = (
        f"UPDATE {quote(meta.db_table)} SET "
        + ", ".join(f"{quote(f.column)} = %s" for f, _value in items)
        + f" WHERE {quote(meta.pk.column)} = %s"
    )
    params = [f.get_db_prep_save(value, connection) for f, value in items]
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, meta.pk.get_db_prep_value(pk, connection)])
        return cursor.rowcount


def save_fields(obj: models.Model, fields: list[str]) -> None:
    """``obj.save(update_fields=fields)`` (``auto_now`` fields among them are stamped)."""
    if not _fast():
        obj.save(update_fields=fields)
        return
    meta = obj._meta
    values = {}
    for name in fields:
        field = meta.get_field(name)
        values[name] = field.pre_save(obj, False)
    if update(type(obj), obj.pk, **values) != 1:
        # what save(update_fields=...) raises when the row is gone
        raise DatabaseError("Save with update_fields did not affect any rows.")

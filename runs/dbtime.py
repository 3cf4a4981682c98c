"""Database time: leases and expiry compare against the database's clock, never a host's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

from django.db import connection


def db_now() -> datetime:
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            # the same clock and format Django's Now() uses on SQLite
            cursor.execute("SELECT STRFTIME('%Y-%m-%d %H:%M:%f', 'NOW')")
            (value,) = cursor.fetchone()
            return datetime.fromisoformat(value).replace(tzinfo=UTC)
        cursor.execute("SELECT STATEMENT_TIMESTAMP()")
        (value,) = cursor.fetchone()
        return value


class DbNow:
    """A datetime field's value in a row the engine writes: the writing statement's own
    database time (``STATEMENT_TIMESTAMP()``) plus ``offset`` seconds — for times that must
    not depend on a worker's estimate of the clock (a dispatch's deadlines, DESIGN §9). The
    checkpoint's statement (``runs.record.checkpoint``) and ``runs.record.rows.insert`` compute it in the
    database; SQLite has no server, its database time is this host's clock. After the write
    the attribute is None: read the value back when it is needed."""

    __slots__ = ("offset",)

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = float(offset)

    def __repr__(self) -> str:
        return f"DbNow({self.offset})"

    SQL = "STATEMENT_TIMESTAMP() + make_interval(secs => %s)"


@cache
def _attnames(model: type) -> frozenset[str]:
    return frozenset(f.attname for f in model._meta.concrete_fields)


def db_now_fields(obj: Any) -> tuple[str, ...]:
    """The attribute names of ``obj``'s concrete fields whose value is a ``DbNow``, in the
    fields' order (asked at every insert of every step: the instance's own values, read
    without a call per field)."""
    names = _attnames(type(obj))
    return tuple(
        name for name, value in obj.__dict__.items() if value.__class__ is DbNow and name in names
    )


def resolve_in_python(obj: Any) -> None:
    """SQLite (no server, one host): ``DbNow`` values become this host's time."""
    now = datetime.now(UTC)
    for attname in db_now_fields(obj):
        setattr(obj, attname, now + timedelta(seconds=getattr(obj, attname).offset))


def clear(obj: Any, attnames: tuple[str, ...]) -> None:
    for attname in attnames:
        setattr(obj, attname, None)


def db_now_expression(value: Any) -> Any:
    """A ``DbNow`` as an ORM expression (for ``QuerySet.update``); anything else as it is."""
    if not isinstance(value, DbNow):
        return value
    from django.db.models import DateTimeField, ExpressionWrapper
    from django.db.models.functions import Now

    return ExpressionWrapper(Now() + timedelta(seconds=value.offset), output_field=DateTimeField())

"""A row's insert or update outside a checkpoint's collected writes, through the record's
backend for this database (``runs.record.postgres``: SQL built once per model;
``runs.record.orm``: the ORM, for SQLite). Same semantics as ``save(force_insert=True)``,
``QuerySet.update()`` and ``save(update_fields=...)``; a ``runs.dbtime.DbNow`` value is the
statement's database time."""

from __future__ import annotations

from types import ModuleType
from typing import Any, TypeVar

from django.db import connection, models

from runs.record import orm, postgres

M = TypeVar("M", bound=models.Model)


def backend() -> ModuleType:
    """The module that writes the record on this database."""
    return postgres if connection.vendor == "postgresql" else orm


def insert(obj: M) -> M:
    return backend().insert(obj)


def create(model: type[M], **values: Any) -> M:
    return insert(model(**values))


def update(model: type[models.Model], pk: Any, **values: Any) -> int:
    """Plain values (and ``DbNow``) only; the rows changed."""
    return backend().update(model, pk, **values)


def save_fields(obj: models.Model, fields: list[str]) -> None:
    backend().save_fields(obj, fields)


def presend_row(
    call_id: Any, *, fence: int, attempt: int, holder: tuple[str, Any] | None = None
) -> tuple[Any, ...] | None:
    """The pre-send check's ONE query (DESIGN §9; hosted workers and remote agents'
    ``send-check``): (dispatched_at, send_deadline, landing_deadline, the database's time)
    while the run is running under ``fence`` and the call is still that fence's dispatch
    ``attempt`` before its send deadline; None otherwise. ``holder``: a remote lease's
    (token hash, principal's user id) — the run's lease must be that token's and that
    principal's, and the run's agent one the principal owns, in that same query."""
    return backend().presend_row(call_id, fence, attempt, holder)

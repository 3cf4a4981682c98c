"""The record's ORM backend (SQLite): the interface of ``runs.record.postgres`` through the
ORM, whose converters SQLite's values need. There is no unlocked commit here: a SQLite
transaction is IMMEDIATE (one writer at a time), so every checkpoint locks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from django.db import DatabaseError, models

from runs import dbtime
from runs.models import Run, RunEvent
from runs.record.common import link

if TYPE_CHECKING:
    from collections.abc import Callable

    from runs.record.checkpoint import Checkpoint

M = TypeVar("M", bound=models.Model)

# every checkpoint locks (an IMMEDIATE transaction: one writer at a time)
UNLOCKED_COMMITS = False


def insert(obj: M) -> M:
    """``obj.save(force_insert=True)``; a ``DbNow`` value is this host's time (SQLite has no
    server: its database time is this host's clock)."""
    dbtime.resolve_in_python(obj)
    obj.save(force_insert=True)
    return obj


def update(model: type[models.Model], pk: Any, **values: Any) -> int:
    return model.objects.filter(pk=pk).update(
        **{name: dbtime.db_now_expression(value) for name, value in values.items()}
    )


def save_fields(obj: models.Model, fields: list[str]) -> None:
    obj.save(update_fields=fields)


def lock(run_id: Any, fence: int | None, fields: tuple[str, ...]) -> Run | None:
    query = Run.objects.select_for_update().only(*fields).filter(id=run_id)
    if fence is not None:
        query = query.filter(fence=fence)
    return query.first()


def flush(
    cp: Checkpoint,
    updates: dict[str, Any],
    expect_seq: int,
    listeners: list[Callable[[Checkpoint], None]],
    *,
    unlocked: bool,
) -> int | None:
    """Write the checkpoint row by row (see ``runs.record.postgres.flush``)."""
    if unlocked:
        return 0
    for obj in cp.inserts:
        link(obj, cp.inserts)
        insert(obj)
    for model, pk, values in cp.row_updates:
        if update(model, pk, **values) != 1:
            raise DatabaseError(f"{model.__name__} {pk} is gone: not updated")
    if cp.events:
        RunEvent.objects.bulk_create([event.as_model() for event in cp.events])
        for listener in listeners:
            listener(cp)
    if not updates:
        return None
    query = Run.objects.filter(id=cp.run.id)
    if cp.fence is not None:
        query = query.filter(fence=cp.fence)
    return query.update(
        **{name: dbtime.db_now_expression(value) for name, value in updates.items()}
    )

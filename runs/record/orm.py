"""The record's ORM backend (SQLite): the interface of ``runs.record.postgres`` through the
ORM, whose converters SQLite's values need. There is no unlocked commit here: a SQLite
transaction is IMMEDIATE (one writer at a time), so every checkpoint locks."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import connection, models
from django.db.models import F, Q
from django.db.models.expressions import RawSQL
from django.db.models.functions import Now

from runs import dbtime
from runs.models import AgentManifest, Run, RunEvent, ToolCall
from runs.record import configcache
from runs.record.common import claimable, kind_filter, write_rows

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
    return model._default_manager.filter(pk=pk).update(
        **{name: dbtime.db_now_expression(value) for name, value in values.items()}
    )


def save_fields(obj: models.Model, fields: list[str]) -> None:
    obj.save(update_fields=fields)


def lock(run_id: Any, fence: int | None, fields: tuple[str, ...]) -> Run | None:
    query = Run.objects.select_for_update().only(*fields).filter(id=run_id)
    if fence is not None:
        query = query.filter(fence=fence)
    return query.first()


def presend_row(
    call_id: Any, fence: int, attempt: int, holder: tuple[str, Any] | None
) -> tuple[Any, ...] | None:
    """``runs.record.rows.presend_row`` through the ORM."""
    conditions: dict[str, Any] = {}
    if holder is not None:
        token_hash, user_id = holder
        conditions = {
            "run__lease_token_hash": token_hash,
            "run__lease_holder": user_id,
            "run__agent_name__in": AgentManifest.objects.filter(owner_id=user_id).values("name"),
        }
    return (
        ToolCall.objects.filter(
            id=call_id,
            status=ToolCall.Status.DISPATCHING,
            dispatch_incarnation=fence,
            attempt_count=attempt,
            run__fence=fence,
            run__status=Run.Status.RUNNING,
            send_deadline__gt=Now(),
            **conditions,
        )
        .annotate(checked_at=Now())
        .values_list("dispatched_at", "send_deadline", "landing_deadline", "checked_at")
        .first()
    )


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
    write_rows(cp, insert, update)
    if cp.events:
        RunEvent.objects.bulk_create([event.as_model() for event in cp.events])
        for listener in listeners:
            listener(cp)
    if not updates:
        return None
    query = Run.objects.filter(id=cp.run_id)
    if cp.fence is not None:
        query = query.filter(fence=cp.fence)
    return query.update(
        **{name: dbtime.db_now_expression(value) for name, value in updates.items()}
    )


def take_lease(
    run_id: Any, *, worker: str, remote: bool, ttl: float
) -> tuple[Run, bool, datetime] | None:
    """The claim's compare-and-set through the ORM (SQLite): read the fence, then UPDATE
    on it. Returns the run as updated, whether it was recovered, and the database's time."""
    # runnable, or waiting with its timer or timeout due (docs/waits.md)
    observed = (
        Run.objects.filter(claimable(), kind_filter(remote), id=run_id)
        .values_list("fence", "status")
        .first()
    )
    if observed is None:
        return None
    fence, status = observed
    recovered = status == Run.Status.RUNNING  # its last holder never released it
    taken = (
        Run.objects.filter(claimable(), kind_filter(remote), id=run_id, fence=fence)
        .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=Now()))
        .filter(Q(wake_at__isnull=True) | Q(wake_at__lte=Now()))
        .update(
            fence=F("fence") + 1,
            lease_owner=worker,
            lease_expires_at=dbtime.db_now_expression(dbtime.DbNow(ttl)),
            status=Run.Status.RUNNING,
            recovery_count=F("recovery_count") + (1 if recovered else 0),
            wake_at=None,
            enqueued_at=None,
        )
    )
    if taken != 1:
        return None
    # the row the UPDATE above locked, and the database's clock, in one query
    # ... and the configuration's generations: what changed is read again, only that
    run = Run.objects.annotate(
        db_time_at_claim=Now(),
        config_generation=RawSQL(configcache.generation_sql(connection.vendor), ()),
    ).get(id=run_id)
    configcache.note(run.config_generation)
    return run, recovered, run.db_time_at_claim

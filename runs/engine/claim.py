"""Taking a run's lease: one compare-and-set UPDATE in database time (DESIGN §3), through
the ORM on SQLite and as one statement on PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import F, Q
from django.db.models.functions import Now

from runs import waits
from runs.dbtime import db_now_expression
from runs.engine.lease import Lease, _conf
from runs.models import AgentManifest, Run, Step
from runs.record.checkpoint import lease_expiry
from runs.registry import UnknownAgent, registry


def _kind_filter(remote: bool) -> Q:
    """Remote agents' runs are advanced only by agent processes through the API
    (``runs.remote``), hosted ones only by workers: neither may claim the other's."""
    remote_names = Q(agent_name__in=AgentManifest.objects.values("name"))
    return remote_names if remote else ~remote_names


def claim(
    run_id: Any,
    *,
    worker: str,
    remote: bool = False,
    lease_type: type[Lease] = Lease,
    on_claimed: Callable[[Run, bool], None] | None = None,
) -> Lease | None:
    """Take the lease with one compare-and-set UPDATE in database time. Returns None when the
    run is not runnable or someone else holds a live lease (a duplicate wake-up)."""
    with transaction.atomic():
        taken = (_take_lease_sql if connection.vendor == "postgresql" else _take_lease_orm)(
            run_id, worker=worker, remote=remote
        )
        if taken is None:
            return None
        run, recovered, claimed_db_time = taken
        if on_claimed is not None:
            on_claimed(run, recovered)
        try:
            agent = registry.agent(run.agent_name)
        except UnknownAgent:
            agent = None
        lease = lease_type(
            run=run,
            fence=run.fence,
            worker=worker,
            recovered=recovered,
            agent=agent,  # type: ignore[arg-type]
            steps=list(Step.objects.filter(run_id=run_id).order_by("seq")),
            claimed_db_time=claimed_db_time,
        )
        with lease.checkpoint(locked=run) as cp:
            cp.event(
                "run.claimed",
                worker=worker,
                fence=run.fence,
                recovered=recovered,
                recovery_count=run.recovery_count,
            )
            cp.boundary("claimed")
    return lease


def _take_lease_orm(run_id: Any, *, worker: str, remote: bool) -> tuple[Run, bool, datetime] | None:
    """The claim's compare-and-set through the ORM (SQLite): read the fence, then UPDATE
    on it. Returns the run as updated, whether it was recovered, and the database's time."""
    # runnable, or waiting with its timer or timeout due (docs/waits.md)
    observed = (
        Run.objects.filter(waits.claimable(), _kind_filter(remote), id=run_id)
        .values_list("fence", "status")
        .first()
    )
    if observed is None:
        return None
    fence, status = observed
    recovered = status == Run.Status.RUNNING  # its last holder never released it
    taken = (
        Run.objects.filter(waits.claimable(), _kind_filter(remote), id=run_id, fence=fence)
        .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=Now()))
        .filter(Q(wake_at__isnull=True) | Q(wake_at__lte=Now()))
        .update(
            fence=F("fence") + 1,
            lease_owner=worker,
            lease_expires_at=db_now_expression(lease_expiry()),
            status=Run.Status.RUNNING,
            recovery_count=F("recovery_count") + (1 if recovered else 0),
            wake_at=None,
            enqueued_at=None,
        )
    )
    if taken != 1:
        return None
    # the row the UPDATE above locked, and the database's clock, in one query
    run = Run.objects.annotate(db_time_at_claim=Now()).get(id=run_id)
    return run, recovered, run.db_time_at_claim


_claim_sql: dict[bool, tuple[str, list[Any]]] = {}


def _take_lease_sql(run_id: Any, *, worker: str, remote: bool) -> tuple[Run, bool, datetime] | None:
    """The same compare-and-set on PostgreSQL as ONE statement (docs/benchmarks.md: built
    through the ORM, the claim's three queries cost more CPU than a whole step). The
    subquery locks the row and reads the status it had — ``running`` means its last holder
    never released it (recovered) — and the UPDATE applies the ORM path's conditions to that
    same, locked row; RETURNING gives the row as updated and the database's time."""
    if remote not in _claim_sql:
        quote = connection.ops.quote_name
        meta = Run._meta

        def col(name: str) -> str:
            return quote(meta.get_field(name).column)

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
            f"(SELECT {quote(AgentManifest._meta.get_field('name').column)} FROM {manifests})) "
            f"AND (r.{col('lease_expires_at')} IS NULL OR r.{col('lease_expires_at')} < {now}) "
            f"AND (r.{col('wake_at')} IS NULL OR r.{col('wake_at')} <= {now}) "
            f"RETURNING old.{col('status')}, {now}, "
            + ", ".join(f"r.{quote(f.column)}" for f in fields)
        )
        _claim_sql[remote] = (
            sql,
            [(f.attname, f.get_db_converters(connection), f) for f in fields],
        )
    sql, columns = _claim_sql[remote]
    params = [
        worker,
        float(_conf("LEASE_TTL")),
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
    old_status, db_time, *values = row
    for index, (_attname, converters, model_field) in enumerate(columns):
        for converter in converters:
            values[index] = converter(values[index], model_field, connection)
    run = Run.from_db(connection.alias, [attname for attname, _c, _f in columns], values)
    return run, old_status == Run.Status.RUNNING, db_time

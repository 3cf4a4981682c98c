"""Taking a run's lease: one compare-and-set UPDATE in database time (DESIGN §3), written by
the record's backend (``runs.record.postgres.take_lease``: one statement;
``runs.record.orm.take_lease``: the ORM, SQLite)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import transaction

from runs.engine.lease import Lease, _conf
from runs.models import Run, Step
from runs.record import rows
from runs.record.eventtypes import EventType
from runs.registry import UnknownAgent, registry


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
        taken = rows.backend().take_lease(
            run_id, worker=worker, remote=remote, ttl=float(_conf("LEASE_TTL"))
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
                EventType.RUN_CLAIMED,
                worker=worker,
                fence=run.fence,
                recovered=recovered,
                recovery_count=run.recovery_count,
            )
            cp.boundary("claimed")
    return lease

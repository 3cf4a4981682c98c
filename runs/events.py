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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import DateTimeField, ExpressionWrapper
from django.db.models.functions import Now
from django.utils import timezone

from runs import faults
from runs.models import Run, RunEvent


class LeaseLost(Exception):
    """This process no longer holds the run's lease: stop at once, write nothing more."""


class RunNotFound(LookupError):
    pass


def lease_expiry_expression(seconds: float | None = None) -> ExpressionWrapper:
    ttl = settings.AGENTOPS["LEASE_TTL"] if seconds is None else seconds
    return ExpressionWrapper(Now() + timedelta(seconds=ttl), output_field=DateTimeField())


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


@contextmanager
def checkpoint(
    run_id: Any,
    *,
    actor: str,
    channel: str,
    fence: int | None = None,
    renew_lease: bool = True,
) -> Iterator[Checkpoint]:
    """Lock the run and append events atomically. With ``fence`` the caller must hold the
    lease: any mismatch raises ``LeaseLost`` and nothing is written."""
    with transaction.atomic(savepoint=False):
        query = Run.objects.select_for_update().only(*_LOCKED_FIELDS).filter(id=run_id)
        if fence is not None:
            query = query.filter(fence=fence)
        run = query.first()
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
        RunEvent.objects.bulk_create(cp.events)
    updates = dict(cp.updates)
    if cp.events:
        updates["event_seq"] = seq
        updates["last_event_hash"] = prev_hash
    query = Run.objects.filter(id=run.id)
    if cp.fence is not None:
        query = query.filter(fence=cp.fence)
        if renew_lease and "lease_expires_at" not in updates:
            updates["lease_expires_at"] = lease_expiry_expression()
    if not updates:
        return
    updates["updated_at"] = now
    if query.update(**updates) != 1:
        # cannot happen while the row lock is held; on SQLite the IMMEDIATE transaction
        # serialises writers the same way
        raise LeaseLost(f"run {run.id}: lost the lease while writing")
    for key, value in updates.items():
        if not hasattr(value, "resolve_expression"):
            setattr(run, key, value)

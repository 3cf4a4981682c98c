"""The one way to append to a run's record.

``checkpoint()`` opens a transaction, locks the run row (filtered on the caller's fence when
it holds the lease), collects events and run-field updates, and on success writes the events
with gap-free ``seq`` numbers and a per-run hash chain plus ONE conditional UPDATE of the run.
A fenced write that matches no row means the lease was lost: ``LeaseLost`` is raised and the
whole transaction rolls back, so a zombie worker changes nothing.

How the commit reaches the database is the backend's business alone (``rows.backend()``):
``runs.record.postgres`` (literal SQL, the commit as one statement) or ``runs.record.orm``
(SQLite). Callers only collect: ``cp.event``, ``cp.update``, ``cp.insert``, ``cp.update_row``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any

from django.conf import settings
from django.db import connection, models, transaction
from django.utils import timezone

from runs import faults, metrics, tracing
from runs.dbtime import DbNow
from runs.errors import DomainError, NotFound
from runs.models import Run, RunEvent
from runs.record import machine, rows
from runs.record.chain import anchor_hash, event_hash, payload_digest
from runs.record.common import LOCKED_FIELDS, link_saved, write_rows
from runs.record.eventtypes import KNOWN as KNOWN_EVENT_TYPES


class LeaseLost(DomainError):
    """This process no longer holds the run's lease: stop at once, write nothing more."""

    code = "lease_lost"
    status = 409


class RunNotFound(NotFound):
    pass


def lease_expiry(seconds: float | None = None) -> DbNow:
    """The lease's expiry, in the database's time: now + the lease's TTL. A value for
    ``cp.update`` (``runs.dbtime.db_now_expression`` makes it an ORM expression)."""
    return DbNow(settings.AGENTOPS["LEASE_TTL"] if seconds is None else seconds)


class Event:
    """An event on its way into the record: a ``RunEvent`` row once written, a plain object
    until then (building a model instance per event cost more than the rest of its write).
    ``seq``, ``created_at``, ``run_created_at``, ``prev_hash`` and ``hash`` are set by the
    write."""

    __slots__ = tuple(f.attname for f in RunEvent._meta.concrete_fields if not f.primary_key)
    # what the write path reads of the slots (every RunEvent column has one)
    type: str
    payload: dict[str, Any]
    seq: int
    created_at: datetime
    run_created_at: datetime | None
    payload_digest: str
    prev_hash: str
    hash: str

    def __init__(self, **values: Any) -> None:
        for name in self.__slots__:
            setattr(self, name, values.get(name))

    def as_model(self) -> RunEvent:
        return RunEvent(**{name: getattr(self, name) for name in self.__slots__})


@dataclass
class Checkpoint:
    known: Run  # the run as this commit knows it: its locked row, or the lease holder's copy
    actor: str
    channel: str
    fence: int | None
    events: list[Event] = field(default_factory=list)
    updates: dict[str, Any] = field(default_factory=dict)
    boundaries: list[str] = field(default_factory=list)
    inserts: list[models.Model] = field(default_factory=list)
    row_updates: list[tuple[type[models.Model], Any, dict[str, Any]]] = field(default_factory=list)
    # set while the body has only collected (a lease holder's commit that has not locked):
    # called at the body's first read — of the database or of ``cp.run``
    lock_first: Callable[[], None] | None = None
    # what runs once the commit landed (``cp.on_commit``), while nothing is locked yet
    after: list[Callable[[], None]] = field(default_factory=list)
    flushing: bool = False
    flushed_early: bool = False

    @property
    def run_id(self) -> Any:
        return self.known.id

    @property
    def run(self) -> Run:
        """The run's row, locked: a body that has only collected so far locks it first."""
        self.lock()
        return self.known

    def lock(self) -> None:
        """Lock the run now, if this commit has not yet: for a body about to call something
        that opens a transaction of its own before it reads (Django's ``update_or_create``,
        ``bulk_create``) — a read locks by itself."""
        if self.lock_first is not None:
            self.lock_first()

    def event(self, type: str, **payload: Any) -> None:
        # Stored as JSON: reduce to JSON values now (a Decimal budget, a UUID, a datetime
        # become strings) so the insert cannot fail and the digest hashed (at the write: the
        # payload may still be amended in the checkpoint's body) is the digest of what an
        # auditor reads back.
        if type not in KNOWN_EVENT_TYPES:
            raise ValueError(f"unknown event type {type!r}: list it in runs.record.eventtypes")
        payload = json.loads(json.dumps(payload, default=str))
        run = self.known
        self.events.append(
            Event(
                run_id=run.id,
                type=str(type),
                actor=self.actor,
                channel=self.channel,
                incarnation=self.fence if self.fence is not None else run.fence,
                payload=payload,
                trace_id=run.trace_id,
                span_id=tracing.current_span_id(run.trace_id),
            )
        )

    def update(self, **fields: Any) -> None:
        self.updates.update(fields)

    def insert(self, obj: models.Model) -> None:
        """Insert ``obj`` in this commit, after the objects given before it. A foreign key
        to one of those (assigned while it was unsaved) is filled in from it. On PostgreSQL
        these rows, the events and the run's update go to the database as ONE statement."""
        if self.flushed_early:
            link_saved(obj)
        self.inserts.append(obj)

    def update_row(self, model: type[models.Model], pk: Any, **values: Any) -> None:
        """``UPDATE`` one row (plain values) in this commit, with the events: on PostgreSQL
        in the commit's one statement. The row must exist."""
        self.row_updates.append((model, pk, values))

    def save_fields(self, obj: models.Model, names: list[str]) -> None:
        """Write ``obj``'s ``names`` in this commit: with its insert when it is still to be
        inserted here, else as an ``update_row``."""
        if not any(pending is obj for pending in self.inserts):
            self.update_row(type(obj), obj.pk, **{name: getattr(obj, name) for name in names})

    def on_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once this commit has landed (never when it rolls back)."""
        if self.lock_first is not None:
            self.after.append(callback)
        else:
            transaction.on_commit(callback)

    def boundary(self, name: str) -> None:
        """Mark that this commit contains a checkpoint boundary (for fault injection)."""
        self.boundaries.append(name)

    def before_query(self, execute, sql, params, many, context):
        """Installed around the body: before the body's first read the run is locked (when
        the commit has not locked yet), and before any read the rows collected so far are
        written, so the body reads what it wrote."""
        if not self.flushing:
            self.flushing = True
            try:
                self.lock()
                if self.inserts or self.row_updates:
                    backend = rows.backend()
                    write_rows(self, backend.insert, backend.update)
                    self.inserts.clear()
                    self.row_updates.clear()
                    self.flushed_early = True
            finally:
                self.flushing = False
        return execute(sql, params, many, context)


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
    PostgreSQL the row is then not locked before the body: a body that only collects
    (``cp.event/update/insert/update_row/save_fields/on_commit``) is written as ONE
    statement (outside a transaction: its own) that holds only while the run's record still
    ends where ``expect`` says (``event_seq``) and the fence is ours. When someone wrote in
    between (an operator's request, a signal), it wrote nothing, and the checkpoint is
    written the ordinary way: lock, number the events after the record's new end, write.
    A body that reads — the database, or ``cp.run`` — locks the run at that first read, as a
    locking checkpoint does before its body, and writes the rows collected so far first.
    The caller chooses nothing: what the body does decides. So the body must decide nothing
    from ``expect`` that others may change but the ``LIVE_FIELDS`` (read back after the
    write either way), and must run code after the commit through ``cp.on_commit``."""
    started = time.perf_counter()
    with ExitStack() as stack:
        unlocked = locked is None and expect is not None and fence is not None
        if unlocked and expect is not None and rows.backend().UNLOCKED_COMMITS:
            cp = Checkpoint(known=expect, actor=actor, channel=channel, fence=fence)
            outer = connection.in_atomic_block
            cp.lock_first = partial(_lock_in, stack, cp, run_id, fence, outer)
        else:
            stack.enter_context(transaction.atomic(savepoint=False))
            run = locked if locked is not None else _lock_or_raise(run_id, fence)
            cp = Checkpoint(known=run, actor=actor, channel=channel, fence=fence)
            # registered before the body, read after it: the fault points fire right after
            # the commit, before whatever the body asked to run after it (an outbox email's
            # send, runs.outbox): a kill at a boundary is a kill at the commit
            transaction.on_commit(partial(_crash_points_now, cp))
        with connection.execute_wrapper(cp.before_query):
            yield cp
        if cp.lock_first is None:
            _write(cp, renew_lease=renew_lease)
        else:
            cp.lock_first = None
            if _write(cp, renew_lease=renew_lease, unlocked=True):
                # outside a transaction the statement committed: they fire at once
                _crash_points_on_commit(cp)
                for callback in cp.after:
                    callback()
            else:
                # someone wrote in between: lock, number the events after theirs, write
                stack.enter_context(transaction.atomic(savepoint=False))
                cp.known = _lock_or_raise(run_id, fence)
                _write(cp, renew_lease=renew_lease)
                _crash_points_on_commit(cp)
                for callback in cp.after:
                    transaction.on_commit(callback)
    # in-process latency histogram (runs/metrics.py): lock, append, update, commit
    metrics.CHECKPOINT_SECONDS.observe(time.perf_counter() - started)


def _lock_in(stack: ExitStack, cp: Checkpoint, run_id: Any, fence: int | None, outer: bool) -> None:
    """The body of a commit that had only collected reads now: open the transaction and
    lock the run (as a locking checkpoint does before its body) — the body decided nothing
    from the database until here."""
    cp.lock_first = None
    if connection.in_atomic_block and not outer:
        raise RuntimeError(
            "a checkpoint's body opened its own transaction before its first read: the run "
            "must be locked first (cp.lock() before atomic(), update_or_create, bulk_create)"
        )
    stack.enter_context(transaction.atomic(savepoint=False))
    cp.known = _lock_or_raise(run_id, fence)
    transaction.on_commit(partial(_crash_points_now, cp))
    for callback in cp.after:
        transaction.on_commit(callback)
    cp.after.clear()


def _crash_points_now(cp: Checkpoint) -> None:
    for name in cp.boundaries:
        faults.crash_point(name)


def _crash_points_on_commit(cp: Checkpoint) -> None:
    for name in cp.boundaries:
        # fires right after the commit that contains the boundary (also when nested)
        transaction.on_commit(partial(faults.crash_point, name))


def _lock_or_raise(run_id: Any, fence: int | None) -> Run:
    run = rows.backend().lock(run_id, fence, LOCKED_FIELDS)
    if run is None:
        if fence is not None and Run.objects.filter(id=run_id).exists():
            raise LeaseLost(f"run {run_id}: fence {fence} is stale")
        raise RunNotFound(f"run {run_id} does not exist")
    if fence is not None and run.status != Run.Status.RUNNING:
        # an operator terminated or paused the run after its lease expired (services apply
        # that at once, without moving the fence): the holder, if it still lives, is done
        raise LeaseLost(f"run {run_id} is {run.status}: this incarnation's lease has ended")
    return run


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
    """Number the events after the run's record, write everything through the database's
    backend. ``unlocked``: only as the one conditional statement (``checkpoint(expect=...)``);
    False when it wrote nothing (someone wrote in between, or the commit is not of that
    shape) — the caller then writes it the locked way."""
    run = cp.known
    prev_hash = run.last_event_hash or anchor_hash(run.id)
    expect_seq = seq = run.event_seq
    now = timezone.now()
    # the run's creation time as the lock (LOCKED_FIELDS) or the claim read it — a deferred
    # field is absent from the instance's dict, so this never queries; PostgreSQL's one
    # statement takes it from the run row it updates instead
    run_created_at = vars(run).get("created_at")
    for event in cp.events:
        seq += 1
        event.seq = seq
        event.created_at = now
        event.run_created_at = run_created_at
        event.payload_digest = payload_digest(event.payload)
        event.prev_hash = prev_hash
        event.hash = event_hash(event)
        prev_hash = event.hash
    updates = dict(cp.updates)
    if "status" in updates:
        machine.check("run", run.status, updates["status"], reason=updates.get("reason_code"))
    if cp.events:
        updates["event_seq"] = seq
        updates["last_event_hash"] = prev_hash
    if cp.fence is not None and renew_lease and "lease_expires_at" not in updates:
        updates["lease_expires_at"] = lease_expiry()
    if updates:
        updates["updated_at"] = now
    listeners = _listeners(cp) if cp.events else []
    updated = rows.backend().flush(cp, updates, expect_seq, listeners, unlocked=unlocked)
    if unlocked and updated != 1:
        return False
    if updated is None:
        return True
    if updated != 1:
        # cannot happen while the row lock is held; on SQLite the IMMEDIATE transaction
        # serialises writers the same way
        raise LeaseLost(f"run {run.id}: lost the lease while writing")
    for key, value in updates.items():
        if not hasattr(value, "resolve_expression") and not isinstance(value, DbNow):
            setattr(run, key, value)
    return True

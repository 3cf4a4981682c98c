"""What an incarnation holds while it advances a run (``Lease``, with its fenced
``checkpoint``), and how it lets go: released to the queue or a timer, yielded at the end of a
slice, parked for a person, paused for its principal, finished. Everything else in the engine
builds on this module."""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any, ClassVar

from django.conf import settings
from django.db.models import F
from django.db.models.functions import Now

from runs.models import Run, Step
from runs.queue import enqueue_run
from runs.record import transitions
from runs.record.checkpoint import Checkpoint, checkpoint
from runs.record.common import LIVE_FIELDS
from runs.record.eventtypes import EventType
from runs.record.runs import run_finish, run_park, run_pause, run_release
from runs.registry import Agent, Tool, Usage
from runs.spend import add_usage

# one logger for the whole engine, named as before the split: log filters and the
# "logger" field of JSON lines say runs.engine (docs/operations.md)
log = logging.getLogger("runs.engine")


def _conf(name: str) -> Any:
    return settings.AGENTOPS[name]


@dataclass
class Lease:
    """What this incarnation knows while it holds a run's lease."""

    run: Run
    fence: int
    worker: str
    recovered: bool
    agent: Agent
    steps: list[Step]
    claimed_db_time: datetime
    claimed_monotonic: float = field(default_factory=time.monotonic)
    # a hosted run's recovery is counted by the claim that takes an expired lease over; a
    # remote run's when its lease expires (runs.record.runs.run_lease_expired)
    RECOVERY_COUNTED_AT_CLAIM: ClassVar[bool] = True
    # what the decision being recorded cost (an LLM agent's tokens): written with it
    decision_usage: Usage | None = None
    # the model request's reservation (runs.spend), settled by the first commit after the
    # model was asked: at the decision's usage, or nothing when no decision came
    decision_reservation: Any = None
    # monotonic clock when the latest ``dispatching`` commit was prepared: the tool's local
    # send budget starts here, before the statement that computes its deadlines (DESIGN §9)
    dispatch_started: float | None = None

    @property
    def actor(self) -> str:
        return f"worker:{self.worker}"

    def now(self) -> datetime:
        """Database time, derived from the clock read at claim (no query per step)."""
        return self.claimed_db_time + timedelta(seconds=time.monotonic() - self.claimed_monotonic)

    @contextmanager
    def checkpoint(self, *, locked: Run | None = None) -> Iterator[Checkpoint]:
        """A commit of this incarnation: a body that only records what it did is written
        without locking the run first, one that reads locks it at that read
        (``runs.record.checkpoint``, ``expect``)."""
        with checkpoint(
            self.run.id,
            actor=self.actor,
            channel="worker",
            fence=self.fence,
            locked=locked,
            expect=self.run,
        ) as cp:
            yield cp
            if self.decision_reservation is not None:
                _settle_decision(cp, self)
            if self.decision_usage is not None and "decided" in cp.boundaries:
                _record_decision_usage(cp, self, self.decision_usage)
        if cp.boundaries:
            log.info(
                "checkpoint %s committed",
                "+".join(cp.boundaries),
                extra={
                    "run_id": str(self.run.id),
                    "incarnation": self.fence,
                    "trace_id": self.run.trace_id,
                    "worker": self.worker,
                    "boundary": "+".join(cp.boundaries),
                },
            )
        if cp.known is not self.run:
            # where the record ends: the next checkpoint expects it
            self.run.event_seq = cp.known.event_seq
            self.run.last_event_hash = cp.known.last_event_hash
        self.take_operator_changes(cp.known)

    def take_operator_changes(self, locked: Run) -> None:
        """What others may change under a live lease, as the checkpoint read it back: an
        operator's request (honoured at the loop's next turn) and budget limits (an
        operator may raise them)."""
        if locked is not self.run:
            for name in LIVE_FIELDS:
                setattr(self.run, name, getattr(locked, name))

    def open_step(self) -> Step | None:
        if self.steps and self.steps[-1].status == Step.Status.PENDING:
            return self.steps[-1]
        return None


class Outcome:
    CONTINUE = "continue"
    PARKED = "parked"  # lease released: waiting, needs attention, finished, yielded


def principal_refusal(lease: Lease, tool: Tool | None) -> str:
    """Why the run's principal may not act now (deactivated, or not in a group ``tool``
    allows); empty when it may. Runs without a principal act as the system."""
    run = lease.run
    if run.principal_id is None:
        return ""
    principal = run.principal  # loaded once per claim: a change is seen at the next claim
    assert principal is not None  # principal_id is set
    if not principal.is_active:
        return f"principal {principal.get_username()} is deactivated"
    if tool is None or not tool.allowed_groups or principal.is_superuser:
        return ""
    if principal.groups.filter(name__in=tool.allowed_groups).exists():
        return ""
    return (
        f"principal {principal.get_username()} is in none of the groups "
        f"{', '.join(tool.allowed_groups)} that may use {tool.name}"
    )


def pause_principal_revoked(lease: Lease, detail: str) -> None:
    with lease.checkpoint() as cp:
        run_pause(cp, by="system", code=Run.Reason.PRINCIPAL_REVOKED, detail=detail)


def _record_decision_usage(cp: Checkpoint, lease: Lease, usage: Usage) -> None:
    """Inside the ``decided`` commit: the step that commit creates carries the decision's
    tokens and cost, the run's persisted usage grows by them, and ``step.decided`` says so."""
    seq = max(
        (
            event.payload.get("seq", 0)
            for event in cp.events
            if event.type == EventType.STEP_DECIDED
        ),
        default=None,
    )
    if seq is None:
        return
    pending = (obj for obj in cp.inserts if isinstance(obj, Step) and obj.seq == seq)
    step = next(pending, None)
    if step is not None:
        step.tokens, step.cost = usage.tokens, usage.cost  # inserted with them
    else:  # written before a read in this commit
        Step.objects.filter(run_id=lease.run.id, seq=seq).update(
            tokens=usage.tokens, cost=usage.cost
        )
    add_usage(cp, tokens=usage.tokens, cost=usage.cost)
    for event in cp.events:
        if event.type == EventType.STEP_DECIDED:
            event.payload["usage"] = json.loads(
                json.dumps(
                    {"tokens": usage.tokens, "cost": usage.cost, **usage.detail}, default=str
                )
            )
            if usage.answers:
                # what the model said, for manage.py replay (masked by the agent)
                event.payload["answers"] = json.loads(json.dumps(usage.answers, default=str))
    lease.run.tokens_used += usage.tokens
    lease.run.cost_used += usage.cost
    lease.decision_usage = None


def _settle_decision(cp: Checkpoint, lease: Lease) -> None:
    """The first commit after the model was asked (the decision's, or a postponement's, a
    park's, a failure's) settles its reservation: at the decision's usage, or nothing."""
    from runs import spend

    reservation, lease.decision_reservation = lease.decision_reservation, None
    usage = lease.decision_usage or Usage()
    spend.settle(cp, reservation, cost=usage.cost, tokens=usage.tokens, by=lease.actor)


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000]


# --- releasing the lease ----------------------------------------------------------------------


def release(
    lease: Lease, *, status: str = Run.Status.QUEUED, wake_at: datetime | None = None
) -> None:
    with lease.checkpoint() as cp:
        run_release(cp, status=status, wake_at=wake_at)


def _yield(lease: Lease) -> None:
    """End of a slice: let other runs have the worker, and ask to be woken again."""
    with lease.checkpoint() as cp:
        run_release(cp)
        cp.update(enqueued_at=Now())
        cp.on_commit(partial(enqueue_run, lease.run.id))


def park_needs_attention(lease: Lease, reason: str, detail: str) -> None:
    with lease.checkpoint() as cp:
        run_park(cp, reason, detail)


def finish(
    lease: Lease,
    status: str,
    *,
    result: Any = None,
    reason: str = "",
    detail: str = "",
    seq: int | None = None,
) -> None:
    with lease.checkpoint() as cp:
        if seq is not None:
            kind = Step.Kind.FINISH if status == Run.Status.SUCCEEDED else Step.Kind.FAIL
            step = transitions.step_ended(
                lease.run.id,
                seq=seq,
                kind=kind,
                incarnation=lease.fence,
                input={"result": result} if kind == Step.Kind.FINISH else {"reason": detail},
            )
            cp.insert(step)
            lease.steps.append(step)
            cp.event(EventType.STEP_DECIDED, seq=seq, kind=kind)
            cp.update(steps_used=F("steps_used") + 1)
            cp.boundary("decided")
        run_finish(cp, status, result=result, reason=reason, detail=detail)

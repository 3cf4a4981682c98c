"""Every move of a run's status, once: ``run_<verb>(cp, …)``.

Each function runs inside an open ``checkpoint`` and writes only through it (``cp.event``,
``cp.update``, ``cp.boundary``); the checkpoint checks the move against the state machine
(``runs.record.machine``) at the write. Who may ask for a move, and when, is the caller's
business (the engine, the remote protocol, ``runs.services``); what the move writes is here.
"""

from __future__ import annotations

from datetime import datetime
from functools import partial
from typing import Any

from django.db.models import F
from django.db.models.functions import Now
from django.utils import timezone

from runs.gate import get_gate
from runs.models import Question, Run, Step, ToolCall
from runs.queue import enqueue_run
from runs.record import machine, transitions
from runs.record.checkpoint import Checkpoint
from runs.record.eventtypes import EventType

# a remote run released to ``queued``: it waits for an agent process, not for a worker
WAITING_FOR_PROCESS = "waiting for an agent process"

_NO_LEASE = {"lease_owner": "", "lease_expires_at": None}


def run_release(
    cp: Checkpoint, *, status: str = Run.Status.QUEUED, wake_at: datetime | None = None
) -> None:
    """The holder lets the lease go: ``queued`` (or a wait), to be claimed again at
    ``wake_at`` or at once."""
    cp.event(
        EventType.RUN_RELEASED, status=status, wake_at=wake_at.isoformat() if wake_at else None
    )
    cp.update(status=status, wake_at=wake_at, **_NO_LEASE)


def run_lease_expired(cp: Checkpoint, *, owner: str, fence: int) -> None:
    """A remote agent's lease ran out: the run waits for an agent process to claim it."""
    cp.event(EventType.RUN_LEASE_EXPIRED, owner=owner, fence=fence)
    cp.update(
        status=Run.Status.QUEUED,
        reason_detail=WAITING_FOR_PROCESS,
        recovery_count=F("recovery_count") + 1,
        **_NO_LEASE,
    )


def run_queue(cp: Checkpoint, *, enqueue: bool = True, **fields: Any) -> None:
    """Runnable again (a settled approval, an ended wait, an operator's resume or
    resolution): ``queued``, and a worker is woken once the commit lands (``enqueue``;
    a remote run waits for its agent process instead)."""
    if enqueue:
        fields.setdefault("enqueued_at", Now())
    cp.update(status=Run.Status.QUEUED, **fields)
    if enqueue:
        cp.on_commit(partial(enqueue_run, cp.run_id))


def run_await_approval(cp: Checkpoint, *, seq: int, tool: str, **why: Any) -> None:
    """``approval_requested``: the run waits for the gate, holding no lease."""
    cp.event(EventType.RUN_WAITING, on="approval", seq=seq, tool=tool, **why)
    cp.update(status=Run.Status.WAITING_APPROVAL, **_NO_LEASE)
    cp.boundary("approval_requested")


def call_await_approval(
    cp: Checkpoint, *, run: Run, call: ToolCall, tool: Any, seq: int, **why: Any
) -> None:
    """ "Wait for approval", the one way: the call awaits its approval (inserted so when it
    is new in this commit, with its decision), the gate is asked, the run waits."""
    machine.check("call", call.status, ToolCall.Status.AWAITING_APPROVAL)
    call.status = ToolCall.Status.AWAITING_APPROVAL
    call.updated_at = timezone.now()
    cp.save_fields(call, ["status", "updated_at"])
    get_gate().request(cp=cp, run=run, call=call, tool=tool)
    run_await_approval(cp, seq=seq, tool=tool.name, **why)


def run_await_event(cp: Checkpoint, *, wake_at: datetime | None) -> None:
    """``waiting_event``: a signal, a timer or an answer ends it (``runs.waits``)."""
    cp.update(status=Run.Status.WAITING_EVENT, wake_at=wake_at, enqueued_at=None, **_NO_LEASE)


def run_park(cp: Checkpoint, reason: str, detail: str) -> None:
    """``needs_attention``: the engine cannot go on alone; ``reason`` says why."""
    cp.event(EventType.RUN_NEEDS_ATTENTION, reason=reason, detail=detail)
    cp.update(
        status=Run.Status.NEEDS_ATTENTION, reason_code=reason, reason_detail=detail, **_NO_LEASE
    )


def run_pause(
    cp: Checkpoint, *, by: str, reason: str = "", code: str = "", detail: str = ""
) -> None:
    """``paused``: by an operator (``reason`` is theirs) or by the system (``code``: the
    principal was revoked); an operator resumes it."""
    if code:
        cp.event(EventType.RUN_PAUSED, by=by, reason=code, detail=detail)
        cp.update(status=Run.Status.PAUSED, reason_code=code, reason_detail=detail, **_NO_LEASE)
    else:
        cp.event(EventType.RUN_PAUSED, by=by, reason=reason)
        cp.update(status=Run.Status.PAUSED, requested_action="", **_NO_LEASE)


def run_resume(cp: Checkpoint, *, by: str) -> None:
    """Runnable again at once: a wake-up time it had before it stopped (a capacity waiter's
    30 s fallback, a backoff) is dropped — what it waited for is checked again at the claim,
    and a capacity waiter waits again, in its turn, if its tool is still full."""
    cp.event(EventType.RUN_RESUMED, by=by)
    run_queue(cp, reason_code="", reason_detail="", wake_at=None)


def run_finish(
    cp: Checkpoint, status: str, *, result: Any = None, reason: str = "", detail: str = ""
) -> None:
    """``succeeded`` or ``failed``: the run's end, as its agent decided (or its code
    crashed)."""
    cp.event(f"run.{status}", result=result, reason=reason, detail=detail)
    cp.update(
        status=status,
        result=result,
        reason_code=reason,
        reason_detail=detail,
        finished_at=Now(),
        **_NO_LEASE,
    )
    cp.boundary("run_finished")


def run_terminate(
    cp: Checkpoint, *, by: str, reason: str, reason_code: str = Run.Reason.OPERATOR_TERMINATED
) -> None:
    """Terminate inside the caller's checkpoint: cancel undispatched calls (and their
    approvals), fail the open step, release the lease. Calls already dispatched keep their
    status (an unknown outcome stays visible)."""
    run_id = cp.run_id
    gate = get_gate()
    undispatched = (
        ToolCall.Status.PROPOSED,
        ToolCall.Status.AWAITING_APPROVAL,
        ToolCall.Status.APPROVED,
    )
    for call in ToolCall.objects.select_related("step").filter(
        run_id=run_id, status__in=undispatched
    ):
        gate.cancel(cp=cp, call=call, reason="run_terminated")
        transitions.call_cancel(cp, call, reason="run_terminated")
    # Terminated with no live lease holder: a call its dead holder left in flight may or may
    # not have acted. It stays visible as an unknown outcome for a person, never "dispatching".
    for call in ToolCall.objects.select_related("step").filter(
        run_id=run_id, status=ToolCall.Status.DISPATCHING
    ):
        transitions.call_unknown(
            cp, call, "left in dispatching when the run was terminated", attempt=False
        )
    # an open question is withdrawn: nobody may answer for a run that will never read it
    for question in Question.objects.filter(run_id=run_id, status=Question.Status.OPEN):
        question.status = Question.Status.CANCELLED
        question.save(update_fields=["status"])
        cp.event(EventType.QUESTION_CANCELLED, question_id=question.id, reason="run_terminated")
    Step.objects.filter(run_id=run_id, status=Step.Status.PENDING).update(
        status=Step.Status.FAILED, error="run terminated", completed_at=timezone.now()
    )
    cp.event(EventType.RUN_TERMINATED, by=by, reason=reason)
    cp.update(
        status=Run.Status.TERMINATED,
        reason_code=reason_code,
        reason_detail=reason,
        finished_at=Now(),
        wake_at=None,
        requested_action="",
        **_NO_LEASE,
    )


def run_await_capacity(
    cp: Checkpoint, *, tool: str, key: str, seq: int, why: str, wake_at: datetime
) -> None:
    """The call the run is about to dispatch would exceed its tool's limit (``runs.flow``):
    the run waits for capacity, ``queued`` with no lease, until it is woken when its turn
    comes (``run_wake_waiting``) or, as a fallback, at ``wake_at``. Its decision is kept:
    the call stays undispatched."""
    cp.event(
        EventType.RUN_WAITING,
        on="capacity",
        seq=seq,
        tool=tool,
        **({"key": key} if key else {}),
        why=why,
    )
    cp.update(
        status=Run.Status.QUEUED,
        wake_at=wake_at,
        enqueued_at=None,
        reason_detail=f"waiting for capacity on {tool}",
        **_NO_LEASE,
    )


def run_wake_waiting(run_id: Any, *, at: datetime | None = None) -> bool:
    """Bring the wake-up of a run waiting for capacity forward (to now, or ``at``): its turn
    has come. Only a run still ``queued`` and waiting moves; nothing else about it."""
    wake_at = Now() if at is None else at
    query = Run.objects.filter(id=run_id, status=Run.Status.QUEUED, capacity_wait__isnull=False)
    if at is not None:
        # never later than it already was
        query = query.filter(wake_at__gt=at)
    return query.update(wake_at=wake_at, enqueued_at=None if at is not None else Now()) == 1

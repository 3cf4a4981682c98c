"""Transitions of a step and its tool call that both the engine and operators' services make.

A receipt recorded by the tool, by reconciliation or by an operator resolving an unknown
outcome is the same transition; it is written here once. Each function runs inside an open
``checkpoint`` (the run row locked) and appends its events through it.
"""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from runs.dbtime import DbNow, db_now_expression
from runs.models import Run, Step, ToolCall, ToolReceipt
from runs.record import machine, rows
from runs.record.checkpoint import Checkpoint
from runs.registry import Agent, StepView


def step_view(step: Step) -> StepView:
    return StepView(
        seq=step.seq,
        kind=step.kind,
        status=step.status,
        input=step.input,
        output=step.output,
        error=step.error,
    )


def record_receipt(
    cp: Checkpoint,
    call: ToolCall,
    *,
    ok: bool,
    result: Any,
    external_ref: str,
    source: str,
    recorded_by: str,
    incarnation: int | None,
    later: bool = False,
    notes: tuple[str, ...] | list[str] = (),
) -> ToolReceipt:
    """``receipt_recorded``: the call's outcome, whoever learned it. ``later``: the receipt
    and the call's new status are written with the commit's events (``cp.insert``,
    ``cp.update_row``: one statement on PostgreSQL); a call itself still waiting in
    ``cp.insert`` is inserted with its final status, so it needs no update. ``notes``: what
    was changed to make the answer storable (``runs.jsonlimits.sanitize``), in the event."""
    receipt = ToolReceipt(
        tool_call=call,
        outcome=ToolReceipt.Outcome.SUCCEEDED if ok else ToolReceipt.Outcome.FAILED,
        result=result,
        external_ref=external_ref or "",
        source=source,
        recorded_by=recorded_by,
        incarnation=incarnation,
    )
    status = ToolCall.Status.SUCCEEDED if ok else ToolCall.Status.FAILED
    machine.check("call", call.status, status)
    call.status = status
    if later:
        cp.insert(receipt)
        if not any(obj is call for obj in cp.inserts):
            cp.update_row(ToolCall, call.id, status=call.status, updated_at=timezone.now())
    else:
        rows.insert(receipt)
        rows.update(ToolCall, call.id, status=call.status, updated_at=timezone.now())
    cp.event(
        "tool.succeeded" if ok else "tool.failed",
        seq=call.step.seq,
        tool=call.tool_name,
        attempt=call.attempt_count,
        source=source,
        external_ref=external_ref or "",
        **({"stored_with_changes": list(notes)} if notes else {}),
    )
    cp.boundary("receipt_recorded")
    return receipt


def apply_to_state(cp: Checkpoint, *, run: Run, agent: Agent, step: Step) -> None:
    """``step_completed``: the agent folds the finished step into the run's state."""
    state = agent.apply(dict(run.state), step_view(step))
    run.state = state
    run.state_version += 1
    cp.update(state=state, state_version=run.state_version)
    cp.boundary("step_completed")


def complete_step(
    cp: Checkpoint,
    *,
    run: Run,
    agent: Agent,
    step: Step,
    ok: bool,
    output: Any,
    error: str,
    later: bool = False,
) -> None:
    """``later``: the step's row is updated with the commit's events (``cp.update_row``)."""
    status = Step.Status.COMPLETED if ok else Step.Status.FAILED
    machine.check("step", step.status, status)
    step.status = status
    step.output = output
    step.error = error
    step.completed_at = timezone.now()
    if later:
        cp.update_row(
            Step,
            step.pk,
            status=step.status,
            output=step.output,
            error=step.error,
            completed_at=step.completed_at,
        )
    else:
        rows.save_fields(step, ["status", "output", "error", "completed_at"])
    apply_to_state(cp, run=run, agent=agent, step=step)


def fail_step(cp: Checkpoint, *, run: Run, agent: Agent, step: Step, error: str) -> None:
    machine.check("step", step.status, Step.Status.FAILED)
    step.status = Step.Status.FAILED
    step.error = error
    step.completed_at = timezone.now()
    rows.save_fields(step, ["status", "error", "completed_at"])
    cp.event("step.failed", seq=step.seq, error=error)
    apply_to_state(cp, run=run, agent=agent, step=step)


# --- a call's moves (runs.record.machine.CALL_MOVES) ---------------------------------------------


def _move_call(call: ToolCall, status: str, **fields: Any) -> None:
    machine.check("call", call.status, status)
    call.status = status
    for name, value in fields.items():
        setattr(call, name, value)
    ToolCall.objects.filter(id=call.id).update(status=status, updated_at=timezone.now(), **fields)


def call_cancel(cp: Checkpoint, call: ToolCall, *, reason: str, **detail: Any) -> None:
    """``cancelled``: a call that never left (its approval, if any, is withdrawn by the
    caller through the gate first)."""
    _move_call(call, ToolCall.Status.CANCELLED)
    cp.event("tool.cancelled", seq=call.step.seq, tool=call.tool_name, reason=reason, **detail)


def call_unknown(cp: Checkpoint, call: ToolCall, error: str, *, attempt: bool = True) -> None:
    """``unknown``: nobody knows whether the call acted; it is reconciled or handed to a
    person, never blindly repeated."""
    _move_call(call, ToolCall.Status.UNKNOWN, last_error=error)
    cp.event(
        "tool.unknown",
        seq=call.step.seq,
        tool=call.tool_name,
        **({"attempt": call.attempt_count} if attempt else {}),
        idempotency_key=call.idempotency_key,
        error=error,
    )


def call_gate_settled(call: ToolCall, *, approved: bool, reason: str = "") -> None:
    """The call's approval was decided: ``approved`` (to be dispatched) or ``rejected``."""
    status = ToolCall.Status.APPROVED if approved else ToolCall.Status.REJECTED
    _move_call(call, status, last_error="" if approved else reason)


def call_dispatching(
    cp: Checkpoint, call: ToolCall, *, fence: int, send: float, landing: float
) -> None:
    """``dispatching``, on the object: the attempt and its deadlines in the database's
    time (``DbNow``: the statement that writes them computes them, DESIGN §9). The caller
    writes the row with its commit (``cp.insert``) or with ``call_write_dispatch``."""
    machine.check("call", call.status, ToolCall.Status.DISPATCHING)
    call.status = ToolCall.Status.DISPATCHING
    call.attempt_count += 1
    call.dispatched_at = DbNow()
    call.send_deadline = DbNow(send)
    call.landing_deadline = DbNow(landing)
    call.dispatch_incarnation = fence
    cp.event(
        "tool.dispatching",
        seq=call.step.seq,
        tool=call.tool_name,
        attempt=call.attempt_count,
        idempotency_key=call.idempotency_key,
    )
    cp.boundary("dispatching")


def call_write_dispatch(call: ToolCall, *, expected: str) -> int:
    """Write a ``call_dispatching`` to an existing row, only while it is still ``expected``
    (1: written; 0: someone moved it first). The deadlines are read back by the pre-send
    check, never trusted from this process."""
    updated = ToolCall.objects.filter(id=call.id, status=expected).update(
        status=call.status,
        attempt_count=call.attempt_count,
        dispatched_at=db_now_expression(call.dispatched_at),
        send_deadline=db_now_expression(call.send_deadline),
        landing_deadline=db_now_expression(call.landing_deadline),
        dispatch_incarnation=call.dispatch_incarnation,
        reconcile_attempts=call.reconcile_attempts,
        # an operator's "dispatch again" is used up by this dispatch
        redispatch_authorized=False,
        updated_at=timezone.now(),
    )
    call.dispatched_at = call.send_deadline = call.landing_deadline = None
    return updated

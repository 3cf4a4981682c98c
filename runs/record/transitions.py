"""Transitions of a step and its tool call that both the engine and operators' services make.

A receipt recorded by the tool, by reconciliation or by an operator resolving an unknown
outcome is the same transition; it is written here once. Each function runs inside an open
``checkpoint`` (the run row locked) and appends its events through it.
"""

from __future__ import annotations

from typing import Any

from django.db.models import F
from django.utils import timezone

from runs import spendrules
from runs.dbtime import DbNow, db_now_expression
from runs.models import Run, Step, ToolCall, ToolReceipt
from runs.record import machine
from runs.record.checkpoint import Checkpoint
from runs.record.eventtypes import EventType
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
    notes: tuple[str, ...] | list[str] = (),
) -> ToolReceipt:
    """``receipt_recorded``: the call's outcome, whoever learned it. The receipt and the
    call's new status are written with the commit's events (one statement on PostgreSQL); a
    call itself still to be inserted in this commit is inserted with its final status.
    ``notes``: what was changed to make the answer storable (``runs.jsonlimits.sanitize``),
    in the event."""
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
    call.updated_at = timezone.now()
    cp.insert(receipt)
    cp.save_fields(call, ["status", "updated_at"])
    cp.event(
        EventType.TOOL_SUCCEEDED if ok else EventType.TOOL_FAILED,
        seq=call.step.seq,
        tool=call.tool_name,
        attempt=call.attempt_count,
        source=source,
        external_ref=external_ref or "",
        **({"stored_with_changes": list(notes)} if notes else {}),
    )
    cp.boundary("receipt_recorded")
    # a reserved call's reservation settles with its receipt (tools that declare a cost)
    spendrules.settle_call(cp, call, ok=ok)
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
) -> None:
    """``step_completed``: the step's outcome, written with the commit's events, folded into
    the run's state."""
    step_outcome(step, ok=ok, output=output, error=error)
    cp.save_fields(step, ["status", "output", "error", "completed_at"])
    apply_to_state(cp, run=run, agent=agent, step=step)


def fail_step(cp: Checkpoint, *, run: Run, agent: Agent, step: Step, error: str) -> None:
    machine.check("step", step.status, Step.Status.FAILED)
    step.status = Step.Status.FAILED
    step.error = error
    step.completed_at = timezone.now()
    cp.save_fields(step, ["status", "error", "completed_at"])
    cp.event(EventType.STEP_FAILED, seq=step.seq, error=error)
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
    cp.event(
        EventType.TOOL_CANCELLED, seq=call.step.seq, tool=call.tool_name, reason=reason, **detail
    )
    spendrules.settle_call(cp, call, ok=False)  # it never left: nothing is charged


def call_unknown(cp: Checkpoint, call: ToolCall, error: str, *, attempt: bool = True) -> None:
    """``unknown``: nobody knows whether the call acted; it is reconciled or handed to a
    person, never blindly repeated."""
    _move_call(call, ToolCall.Status.UNKNOWN, last_error=error)
    cp.event(
        EventType.TOOL_UNKNOWN,
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
    cp: Checkpoint,
    call: ToolCall,
    *,
    fence: int,
    send: float,
    landing: float,
    simulated: bool = False,
) -> None:
    """``dispatching``, on the object: the attempt and its deadlines in the database's
    time (``DbNow``: the statement that writes them computes them, DESIGN §9). The caller
    writes the row with its commit (``cp.insert``) or with ``call_write_dispatch``."""
    machine.check("call", call.status, ToolCall.Status.DISPATCHING)
    call.status = ToolCall.Status.DISPATCHING
    call.attempt_count += 1
    # database time: the statement that writes the row computes them (runs.dbtime.DbNow)
    call.dispatched_at = DbNow()  # type: ignore[assignment]
    call.send_deadline = DbNow(send)  # type: ignore[assignment]
    call.landing_deadline = DbNow(landing)  # type: ignore[assignment]
    call.dispatch_incarnation = fence
    cp.event(
        EventType.TOOL_DISPATCHING,
        seq=call.step.seq,
        tool=call.tool_name,
        attempt=call.attempt_count,
        idempotency_key=call.idempotency_key,
        # a dry run's call (issue 23): its dry_run is called, or the agent process is told
        # not to execute it; only then, so a real dispatch's event is what it always was
        **({"simulated": True} if simulated else {}),
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


def call_rebind(call: ToolCall, tool: Any, *, fingerprint: str, needs_approval: bool) -> None:
    """An undispatched call moves to its tool's new version: ``proposed`` again, or
    ``awaiting_approval`` when the new version's policy asks (the caller cancelled the old
    approval through the gate and asks the new one)."""
    status = ToolCall.Status.AWAITING_APPROVAL if needs_approval else ToolCall.Status.PROPOSED
    machine.check("call", call.status, status)
    call.tool_version = tool.version
    call.effect = str(tool.effect)
    call.arguments_masked = tool.mask(call.arguments)
    call.precondition_fingerprint = fingerprint
    call.status = status
    call.save(
        update_fields=[
            "tool_version",
            "effect",
            "arguments_masked",
            "precondition_fingerprint",
            "status",
            "updated_at",
        ]
    )


def call_absent_accepted(cp: Checkpoint, call: ToolCall, *, lookup: int, **event: Any) -> None:
    """A remote agent's ``absent`` was accepted: the call stays ``unknown`` (its first
    attempt provably never landed) and may be dispatched again under its key."""
    machine.check("call", call.status, ToolCall.Status.UNKNOWN)
    attempt = call.reconcile_attempts + 1
    ToolCall.objects.filter(id=call.id).update(
        status=ToolCall.Status.UNKNOWN,
        reconcile_attempts=attempt,
        absent_lookup=lookup,
        updated_at=timezone.now(),
    )
    cp.event(
        EventType.TOOL_RECONCILE_ATTEMPTED,
        seq=call.step.seq,
        attempt=attempt,
        outcome="absent",
        lookup=lookup,
        **event,
    )


def call_in_doubt(cp: Checkpoint, call: ToolCall, *, sibling: ToolCall, seq: int) -> None:
    """A fork's new call whose key its family dispatched without a receipt: ``unknown``
    (reconciled by key, never blindly repeated), with the family's deadlines (its request
    may still land until the sibling's landing deadline); inserted so by this commit."""
    machine.check("call", call.status, ToolCall.Status.UNKNOWN)
    call.status = ToolCall.Status.UNKNOWN
    call.dispatched_at = sibling.dispatched_at
    call.send_deadline = sibling.send_deadline
    call.landing_deadline = sibling.landing_deadline
    call.last_error = (
        f"key {call.idempotency_key} was dispatched by run {sibling.run_id} "
        f"({sibling.status}) with no receipt"
    )
    cp.event(
        EventType.TOOL_UNKNOWN,
        seq=seq,
        tool=call.tool_name,
        attempt=0,
        idempotency_key=call.idempotency_key,
        error=call.last_error,
    )


# --- a step's moves (runs.record.machine.STEP_MOVES) ---------------------------------------------


def step_outcome(step: Step, *, ok: bool, output: Any, error: str) -> None:
    """The step ends, on the object (its row is written by the caller's commit)."""
    status = Step.Status.COMPLETED if ok else Step.Status.FAILED
    machine.check("step", step.status, status)
    step.status = status
    step.output = output
    step.error = error
    step.completed_at = timezone.now()


def step_ended(
    run_id: Any, *, seq: int, kind: str, incarnation: int, input: Any, error: str = ""
) -> Step:
    """A step that is decided and ended at once (a finish, an agent's own decision:
    completed; a refused call or wait: failed, with ``error``), unsaved."""
    return Step(
        run_id=run_id,
        seq=seq,
        kind=kind,
        status=Step.Status.FAILED if error else Step.Status.COMPLETED,
        input=input,
        error=error,
        incarnation=incarnation,
        completed_at=timezone.now(),
    )


def step_refused(
    cp: Checkpoint,
    *,
    run_id: Any,
    seq: int,
    kind: str,
    incarnation: int,
    input: Any,
    error: str,
    **event: Any,
) -> Step:
    """``decided``, refused: the engine would not make the call or the wait (unknown tool,
    bad arguments, a wait it cannot keep). A failed step the agent sees; nothing happens."""
    step = step_ended(run_id, seq=seq, kind=kind, incarnation=incarnation, input=input, error=error)
    step.save(force_insert=True)
    cp.event(EventType.STEP_DECIDED, seq=seq, kind=kind, **event, refused=error)
    cp.update(steps_used=F("steps_used") + 1)
    cp.boundary("decided")
    return step


def steps_carry(fork: Run, steps: list[Step]) -> None:
    """Copies, not moves: the old run's record stays whole for its audit trail. A carried
    call keeps its idempotency key, so the family's keys name the same effects. Every step
    and call keeps its status: a fork starts where its parent's record ends."""
    for step in steps:
        copy = Step.objects.create(
            run=fork,
            seq=step.seq,
            kind=step.kind,
            status=step.status,
            input=step.input,
            output=step.output,
            error=step.error,
            incarnation=step.incarnation,
            cost=step.cost,
            tokens=step.tokens,
            completed_at=step.completed_at,
        )
        call = getattr(step, "tool_call", None)
        if call is None:
            continue
        carried = ToolCall.objects.create(
            step=copy,
            run=fork,
            tool_name=call.tool_name,
            tool_version=call.tool_version,
            effect=call.effect,
            arguments=call.arguments,
            arguments_masked=call.arguments_masked,
            arguments_digest=call.arguments_digest,
            idempotency_key=call.idempotency_key,
            client_call_id=call.client_call_id,
            status=call.status,
            attempt_count=call.attempt_count,
            dispatched_at=call.dispatched_at,
            dispatch_incarnation=call.dispatch_incarnation,
            precondition_fingerprint=call.precondition_fingerprint,
            reconcile_attempts=call.reconcile_attempts,
            last_error=call.last_error,
        )
        receipt = getattr(call, "receipt", None)
        if receipt is not None:
            ToolReceipt.objects.create(
                tool_call=carried,
                outcome=receipt.outcome,
                result=receipt.result,
                external_ref=receipt.external_ref,
                source=receipt.source,
                recorded_by=receipt.recorded_by,
                incarnation=receipt.incarnation,
            )

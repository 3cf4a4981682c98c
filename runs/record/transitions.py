"""Transitions of a step and its tool call that both the engine and operators' services make.

A receipt recorded by the tool, by reconciliation or by an operator resolving an unknown
outcome is the same transition; it is written here once. Each function runs inside an open
``checkpoint`` (the run row locked) and appends its events through it.
"""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from runs.models import Run, Step, ToolCall, ToolReceipt
from runs.record import rows
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
    call.status = ToolCall.Status.SUCCEEDED if ok else ToolCall.Status.FAILED
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
    step.status = Step.Status.COMPLETED if ok else Step.Status.FAILED
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
    step.status = Step.Status.FAILED
    step.error = error
    step.completed_at = timezone.now()
    rows.save_fields(step, ["status", "error", "completed_at"])
    cp.event("step.failed", seq=step.seq, error=error)
    apply_to_state(cp, run=run, agent=agent, step=step)

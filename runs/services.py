"""Every state change of a run that is not the engine advancing it.

Each function checks permission, runs in one transaction with the run row locked, guards
the status, appends events naming the actor, and enqueues work on commit. HTML views, the
API, admin actions and workers all call these; a transition is never written twice.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models.functions import Now
from django.utils import timezone

from runs.actors import Actor
from runs.events import Checkpoint, checkpoint
from runs.gate import get_gate
from runs.models import Run, Step, ToolCall
from runs.queue import enqueue_on_commit
from runs.registry import registry


class InvalidState(Exception):
    code = "invalid_state"


class InvalidInput(ValueError):
    code = "validation_error"


def _validate_input(agent: Any, input: Any) -> None:
    import jsonschema

    validator = jsonschema.Draft202012Validator(agent.input_schema)
    errors = [
        f"{'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
        for e in validator.iter_errors(input)
    ]
    if errors:
        raise InvalidInput("input does not match the agent's schema: " + "; ".join(errors))


def run_create(
    *,
    agent_name: str,
    goal: str = "",
    input: dict[str, Any] | None = None,
    actor: Actor,
    principal: Any = None,
    max_steps: int | None = None,
    max_cost: Decimal | None = None,
    max_tokens: int | None = None,
    deadline: Any = None,
) -> Run:
    """Create a run and enqueue it. Unknown agents and bad input raise before anything is
    written."""
    actor.require("runs.start_run")
    agent = registry.agent(agent_name)  # raises UnknownAgent
    input = dict(input or {})
    _validate_input(agent, input)
    if principal is None:
        principal = actor.user
    run_id = uuid.uuid4()
    with transaction.atomic():
        run = Run.objects.create(
            id=run_id,
            agent_name=agent.name,
            agent_version=agent.version,
            goal=goal,
            input=input,
            state=agent.initial_state(input),
            principal=principal,
            max_steps=max_steps
            if max_steps is not None
            else settings.AGENTOPS["DEFAULT_MAX_STEPS"],
            max_cost=max_cost,
            max_tokens=max_tokens,
            deadline=deadline,
            trace_id=uuid.uuid4().hex,
            root_run_id=run_id,
            enqueued_at=timezone.now(),
        )
        with checkpoint(run.id, actor=actor.label, channel=actor.channel) as cp:
            cp.event(
                "run.created",
                agent=agent.name,
                agent_version=agent.version,
                goal=goal,
                principal=principal.get_username() if principal is not None else None,
                budget={"max_steps": run.max_steps, "max_cost": max_cost, "max_tokens": max_tokens},
            )
        enqueue_on_commit(run.id)
    return run


def apply_terminate(
    cp: Checkpoint, *, by: str, reason: str, reason_code: str = Run.Reason.OPERATOR_TERMINATED
) -> None:
    """Terminate inside an open checkpoint: cancel every call that was not dispatched,
    fail the open step, release the lease. Calls already dispatched keep their status
    (an unknown outcome stays visible)."""
    run_id = cp.run.id
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
        call.status = ToolCall.Status.CANCELLED
        call.save(update_fields=["status", "updated_at"])
        cp.event("tool.cancelled", seq=call.step.seq, tool=call.tool_name, reason="run_terminated")
    # Terminated with no live lease holder: a call its dead holder left in flight may or may
    # not have acted. It stays visible as an unknown outcome for a person, never "dispatching".
    for call in ToolCall.objects.select_related("step").filter(
        run_id=run_id, status=ToolCall.Status.DISPATCHING
    ):
        call.status = ToolCall.Status.UNKNOWN
        call.last_error = "left in dispatching when the run was terminated"
        call.save(update_fields=["status", "last_error", "updated_at"])
        cp.event(
            "tool.unknown",
            seq=call.step.seq,
            tool=call.tool_name,
            idempotency_key=call.idempotency_key,
            error=call.last_error,
        )
    Step.objects.filter(run_id=run_id, status=Step.Status.PENDING).update(
        status=Step.Status.FAILED, error="run terminated", completed_at=timezone.now()
    )
    cp.event("run.terminated", by=by, reason=reason)
    cp.update(
        status=Run.Status.TERMINATED,
        reason_code=reason_code,
        reason_detail=reason,
        finished_at=Now(),
        lease_owner="",
        lease_expires_at=None,
        wake_at=None,
        requested_action="",
    )


def _lease_is_live(run_id: Any) -> bool:
    return Run.objects.filter(id=run_id, lease_expires_at__gt=Now()).exists()


def run_terminate(*, run_id: Any, actor: Actor, reason: str) -> Run:
    """Terminate now when no process holds the lease; otherwise ask the holder, which
    honours the request at its next boundary (after recording any in-flight receipt)."""
    actor.require("runs.operate_run")
    if not reason.strip():
        raise InvalidInput("a reason is required to terminate a run")
    with checkpoint(run_id, actor=actor.label, channel=actor.channel) as cp:
        if cp.run.status in Run.TERMINAL:
            raise InvalidState(f"run is already {cp.run.status}")
        if cp.run.status == Run.Status.RUNNING and _lease_is_live(run_id):
            cp.event("run.terminate_requested", by=actor.label, reason=reason)
            cp.update(
                requested_action=Run.Request.TERMINATE,
                requested_by=actor.label,
                requested_reason=reason,
            )
        else:
            apply_terminate(cp, by=actor.label, reason=reason)
    return Run.objects.get(id=run_id)


def run_pause(*, run_id: Any, actor: Actor, reason: str = "") -> Run:
    actor.require("runs.operate_run")
    with checkpoint(run_id, actor=actor.label, channel=actor.channel) as cp:
        status = cp.run.status
        if status not in (Run.Status.QUEUED, Run.Status.RUNNING):
            raise InvalidState(f"a {status} run cannot be paused")
        if status == Run.Status.RUNNING and _lease_is_live(run_id):
            cp.event("run.pause_requested", by=actor.label, reason=reason)
            cp.update(
                requested_action=Run.Request.PAUSE,
                requested_by=actor.label,
                requested_reason=reason,
            )
        else:
            apply_pause(cp, by=actor.label, reason=reason)
    return Run.objects.get(id=run_id)


def apply_pause(cp: Checkpoint, *, by: str, reason: str) -> None:
    cp.event("run.paused", by=by, reason=reason)
    cp.update(
        status=Run.Status.PAUSED,
        lease_owner="",
        lease_expires_at=None,
        requested_action="",
    )


def run_resume(*, run_id: Any, actor: Actor) -> Run:
    actor.require("runs.operate_run")
    with checkpoint(run_id, actor=actor.label, channel=actor.channel) as cp:
        if cp.run.status != Run.Status.PAUSED:
            raise InvalidState(f"a {cp.run.status} run cannot be resumed")
        cp.event("run.resumed", by=actor.label)
        cp.update(status=Run.Status.QUEUED, reason_code="", reason_detail="", enqueued_at=Now())
        enqueue_on_commit(run_id)
    return Run.objects.get(id=run_id)


def toolcall_gate_settled(
    *, cp: Checkpoint, call: ToolCall, approved: bool, reason: str = ""
) -> None:
    """Called by the approvals app inside its decision transaction (``cp`` locks the run):
    the call's approval settled. The run becomes runnable again; on rejection the agent sees
    the rejection as the step's outcome."""
    if call.status != ToolCall.Status.AWAITING_APPROVAL:
        raise InvalidState(f"tool call is {call.status}, not awaiting approval")
    call.status = ToolCall.Status.APPROVED if approved else ToolCall.Status.REJECTED
    call.last_error = "" if approved else reason
    call.save(update_fields=["status", "last_error", "updated_at"])
    if cp.run.status == Run.Status.WAITING_APPROVAL:
        cp.update(status=Run.Status.QUEUED, enqueued_at=Now())
        enqueue_on_commit(cp.run.id)

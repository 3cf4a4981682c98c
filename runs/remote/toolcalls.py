"""A remote agent's tool calls: propose (the policy decides), dispatch (the ``dispatching``
checkpoint before the side effect), and the receipt — from the tool or from a
reconciliation lookup by idempotency key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import F
from django.utils import timezone

from runs import engine
from runs.actors import Actor
from runs.events import LeaseLost
from runs.models import Run, Step, ToolCall, ToolReceipt
from runs.registry import CallTool, Effect, UnknownTool, digest, registry
from runs.remote.lease import RemoteLease, _check_budget, _held, _honour_request
from runs.remote.manifest import SEP, _reported_fingerprint
from runs.services import InvalidInput, InvalidState


@dataclass(frozen=True)
class Proposal:
    decision: str  # approved | awaiting_approval | refused | paused | unknown | succeeded
    step: Step
    call: ToolCall | None
    approval_id: int | None
    error: str
    replayed: bool = False  # a retried request: the call its first attempt proposed


def _proposal(run_id: Any, step: Step, call: ToolCall | None, *, replayed: bool) -> Proposal:
    """What the tool's policy decided for this call, read from the record."""
    if call is None:
        return Proposal("refused", step, None, None, step.error, replayed)
    if call.status == ToolCall.Status.AWAITING_APPROVAL:
        approval = call.approvals.filter(status="pending").order_by("-id").first()
        approval_id = approval.id if approval else None
        return Proposal("awaiting_approval", step, call, approval_id, "", replayed)
    if Run.objects.filter(id=run_id, status=Run.Status.PAUSED).exists():
        return Proposal("paused", step, call, None, "the principal may not use this tool", replayed)
    if call.status == ToolCall.Status.UNKNOWN:
        # a fork's family already dispatched this key: reconcile it, never send it blindly
        return Proposal("unknown", step, call, None, call.last_error, replayed)
    if call.status == ToolCall.Status.SUCCEEDED:
        return Proposal("succeeded", step, call, None, "", replayed)
    return Proposal("approved", step, call, None, "", replayed)


# Where a propose itself leaves a run when it releases the lease: waiting for the approval,
# or paused because the principal may not use the tool.
_PARKED_BY_PROPOSE = (Run.Status.WAITING_APPROVAL, Run.Status.PAUSED)


def _replayed_proposal(
    run_id: Any, fence: int, tool: str, arguments: Any, *, statuses: tuple[str, ...]
) -> Proposal | None:
    """A retried propose (same fence, tool and arguments) whose first attempt's answer was
    lost: that attempt's call, still open and never dispatched, is the run's last step."""
    run = (
        Run.objects.filter(id=run_id, fence=fence, status__in=statuses)
        .only("id", "agent_name")
        .first()
    )
    if run is None:
        return None
    step = Step.objects.filter(run_id=run_id).order_by("-seq").first()
    if (
        step is None
        or step.kind != Step.Kind.TOOL_CALL
        or step.status != Step.Status.PENDING
        or step.incarnation != fence
    ):
        return None
    call = ToolCall.objects.select_related("step").filter(step=step).first()
    if (
        call is None
        or call.attempt_count
        or call.tool_name != f"{run.agent_name}{SEP}{tool}"
        or call.arguments_digest != digest(arguments)
    ):
        return None
    return _proposal(run_id, step, call, replayed=True)


def remote_toolcall_propose(
    *,
    run_id: Any,
    fence: int,
    actor: Actor,
    tool: str,
    arguments: Any,
    precondition: str = "",
) -> Proposal:
    """``decided``: the call is recorded as a step with its idempotency key, and the tool's
    policy decides — ``approved`` (dispatch it), ``awaiting_approval`` (the lease is released
    until a person decides; the approval.decided webhook says when), or ``refused`` (not the
    agent's tool, or arguments that break the schema: a failed step the agent sees).

    A retry by the same incarnation of a propose that was recorded (same tool and arguments,
    the call still open and not dispatched) gets the same proposal (``replayed``), also when
    the first attempt released the lease to wait for an approval. Another call while one is
    open is ``InvalidState``."""
    if not isinstance(arguments, dict):
        raise InvalidInput("arguments must be a JSON object")
    try:
        lease = _held(run_id, fence, actor)
    except LeaseLost:
        # the first attempt may have released the lease itself (an approval is needed)
        replayed = _replayed_proposal(run_id, fence, tool, arguments, statuses=_PARKED_BY_PROPOSE)
        if replayed is None:
            raise
        return replayed
    if lease.open_step() is not None:
        replayed = _replayed_proposal(
            run_id, fence, tool, arguments, statuses=(Run.Status.RUNNING,)
        )
        if replayed is not None:
            return replayed
    _honour_request(lease)
    if lease.open_step() is not None:
        raise InvalidState("a tool call is still open: record its receipt before the next one")
    _check_budget(lease)
    seq = (lease.steps[-1].seq + 1) if lease.steps else 1
    token = _reported_fingerprint.set(precondition or "")
    try:
        engine._decide_call(
            lease, CallTool(f"{lease.run.agent_name}{SEP}{tool}", arguments), seq, execute=False
        )
    finally:
        _reported_fingerprint.reset(token)
    step = lease.steps[-1]
    call = ToolCall.objects.select_related("step").filter(step=step).first()
    return _proposal(run_id, step, call, replayed=False)


@dataclass(frozen=True)
class Dispatch:
    go: bool
    call: ToolCall
    reason: str


def _call_for_lease(tool_call_id: Any, fence: int, actor: Actor) -> tuple[RemoteLease, ToolCall]:
    call = ToolCall.objects.select_related("step").filter(id=tool_call_id).first()
    if call is None:
        raise ToolCall.DoesNotExist(f"tool call {tool_call_id} does not exist")
    lease = _held(call.run_id, fence, actor)
    return lease, call


def remote_toolcall_dispatch(
    *, tool_call_id: Any, fence: int, actor: Actor, precondition: str = ""
) -> Dispatch:
    """``dispatching`` through the engine's own ``_dispatch``: attempt incremented, the
    approval consumed, the precondition re-checked, in one commit before the side effect.
    ``go`` is false when the engine refused (approval needed again, precondition changed):
    the call's status says what happened. An unknown outcome is dispatched again only when
    the tool is read or idempotent, or after reconciliation found it absent (or an operator
    chose "dispatch again") and the original request can no longer land."""
    lease, call = _call_for_lease(tool_call_id, fence, actor)
    _honour_request(lease)
    step = lease.open_step()
    if step is None or step.id != call.step_id:
        raise InvalidState(f"the call is {call.status}; it is not the run's open step")
    if call.status == ToolCall.Status.DISPATCHING and call.dispatch_incarnation == fence:
        return Dispatch(True, call, "already dispatching (a retried request)")
    if call.status not in ToolCall.OPEN:
        # settled (a receipt, a rejection): before any compatibility check, which must never
        # fail a call that settled
        raise InvalidState(f"the call is {call.status}; it cannot be dispatched")
    try:
        tool = registry.tool(call.tool_name)
    except UnknownTool:
        tool = None
    if not engine._tool_accepts(lease, step, call, tool):
        engine._tool_changed(lease, step, call, tool)
        call.refresh_from_db()
        return Dispatch(False, call, "the tool changed since the call was proposed")
    if call.status == ToolCall.Status.UNKNOWN:
        if tool.effect not in (Effect.READ, Effect.IDEMPOTENT) and not call.redispatch_authorized:
            raise InvalidState(
                "the outcome is unknown: reconcile it by its idempotency key and record a "
                "receipt (found), or report it absent, before dispatching it again"
            )
        can_land_until = engine._can_land_until(lease, call, tool)
        if tool.effect not in (Effect.READ, Effect.IDEMPOTENT) and lease.now() < can_land_until:
            raise InvalidState(
                "the original request may still land until "
                f"{can_land_until.isoformat()}; dispatch again after that"
            )
    elif call.status not in (ToolCall.Status.PROPOSED, ToolCall.Status.APPROVED):
        raise InvalidState(f"the call is {call.status}; it cannot be dispatched")
    token = _reported_fingerprint.set(precondition or "")
    try:
        engine._dispatch(lease, step, call, tool, execute=False)
    finally:
        _reported_fingerprint.reset(token)
    call.refresh_from_db()
    if call.status == ToolCall.Status.DISPATCHING:
        return Dispatch(True, call, "")
    if call.status == ToolCall.Status.AWAITING_APPROVAL:
        return Dispatch(False, call, "the call needs an approval again; the lease is released")
    if call.status == ToolCall.Status.CANCELLED:
        return Dispatch(False, call, "the precondition changed: the call is cancelled")
    return Dispatch(False, call, f"the call is {call.status}")


RECEIPT_OUTCOMES = ("succeeded", "failed", "unknown", "absent")


def remote_toolcall_receipt(
    *,
    tool_call_id: Any,
    fence: int,
    actor: Actor,
    outcome: str,
    result: Any = None,
    external_ref: str = "",
    source: str = ToolReceipt.Source.AGENT,
    state: Any = None,
) -> ToolCall:
    """``receipt_recorded`` + ``step_completed`` in one commit. ``source`` is ``agent`` (the
    tool answered) or ``reconciliation`` (a lookup by idempotency key answered).
    ``unknown``: the call timed out or failed ambiguously, reconcile it next. ``absent``
    (reconciliation only): the key was looked up and reliably not found; the call may be
    dispatched again with the same key once the original request can no longer land.
    A pause or terminate request is honoured right after the receipt is recorded."""
    if outcome not in RECEIPT_OUTCOMES:
        raise InvalidInput(f"outcome must be one of {', '.join(RECEIPT_OUTCOMES)}")
    if source not in (ToolReceipt.Source.AGENT, ToolReceipt.Source.RECONCILIATION):
        raise InvalidInput("source must be agent or reconciliation")
    lease, call = _call_for_lease(tool_call_id, fence, actor)
    receipt = getattr(call, "receipt", None)
    if receipt is not None:
        if receipt.outcome == outcome and receipt.source == source:
            return call  # a retried request: recorded once
        raise InvalidState(f"the call already has a {receipt.outcome} receipt")
    reconciling = source == ToolReceipt.Source.RECONCILIATION
    if reconciling and call.status not in (ToolCall.Status.UNKNOWN, ToolCall.Status.DISPATCHING):
        raise InvalidState(f"the call is {call.status}: there is nothing to reconcile")
    if not reconciling and call.status != ToolCall.Status.DISPATCHING:
        raise InvalidState(f"the call is {call.status}; only a dispatched call gets a receipt")
    if outcome == "absent" and not reconciling:
        raise InvalidInput("absent is what a reconciliation lookup reports")
    step = call.step
    if outcome == "unknown":
        if reconciling:
            with lease.checkpoint() as cp:
                attempt = call.reconcile_attempts + 1
                ToolCall.objects.filter(id=call.id).update(reconcile_attempts=attempt)
                cp.event(
                    "tool.reconcile_attempted",
                    seq=step.seq,
                    attempt=attempt,
                    outcome="unknown",
                    detail=str(result or "")[:2000],
                )
        else:
            engine._mark_unknown(lease, call, str(result or "outcome unknown")[:2000])
            if call.effect == Effect.UNSAFE:
                engine._park_needs_attention(
                    lease,
                    Run.Reason.UNKNOWN_OUTCOME,
                    f"{call.tool_name} (unsafe) may or may not have acted: {call.last_error}",
                )
        call.refresh_from_db()
        return call
    if outcome == "absent":
        with lease.checkpoint() as cp:
            attempt = call.reconcile_attempts + 1
            ToolCall.objects.filter(id=call.id).update(
                status=ToolCall.Status.UNKNOWN,
                reconcile_attempts=attempt,
                redispatch_authorized=True,
                updated_at=timezone.now(),
            )
            cp.event("tool.reconcile_attempted", seq=step.seq, attempt=attempt, outcome="absent")
        call.refresh_from_db()
        return call
    ok = outcome == "succeeded"
    with lease.checkpoint() as cp:
        if reconciling:
            attempt = call.reconcile_attempts + 1
            ToolCall.objects.filter(id=call.id).update(
                reconcile_attempts=attempt, next_reconcile_at=None
            )
            cp.event(
                "tool.reconcile_attempted",
                seq=step.seq,
                attempt=attempt,
                outcome="found" if ok else "failed",
            )
        engine._record_receipt(
            cp, lease, call, ok=ok, result=result, external_ref=external_ref, source=source
        )
        engine._complete_step(
            cp, lease, step, call, ok, result if ok else None, "" if ok else str(result)[:2000]
        )
        if state is not None:
            cp.update(state=state, state_version=F("state_version") + 1)
    engine._honour_request(lease)
    call.refresh_from_db()
    return call

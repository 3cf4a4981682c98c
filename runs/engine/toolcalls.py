"""A tool call from the ``dispatching`` checkpoint to its receipt: dispatch (approval
consumed, precondition re-checked), the external call with the lease kept alive, the receipt
and the step it completes, and unknown outcomes reconciled by idempotency key (DESIGN §5.3).
These call each other (an unknown outcome may be dispatched again), so they share a module."""

from __future__ import annotations

import threading
from contextlib import nullcontext
from datetime import datetime, timedelta
from typing import Any

from django.db import connection
from django.utils import timezone

from runs import transitions
from runs.engine.lease import (
    Lease,
    Outcome,
    _conf,
    _describe,
    _park_needs_attention,
    _pause_principal_revoked,
    _principal_refusal,
    _release,
    _release_in,
    log,
)
from runs.events import LeaseLost, lease_expiry_expression
from runs.gate import GateRefused, get_gate
from runs.models import Run, Step, ToolCall, ToolReceipt
from runs.registry import (
    Effect,
    LookupResult,
    OutcomeUnknown,
    Tool,
    ToolContext,
    ToolFailed,
    ToolResult,
)

# --- dispatching ------------------------------------------------------------------------------


def _mark_dispatching(cp, call: ToolCall, lease: Lease) -> None:
    call.status = ToolCall.Status.DISPATCHING
    call.attempt_count += 1
    # database time: compared with database time when deciding whether it can still land
    call.dispatched_at = lease.now()
    call.dispatch_incarnation = lease.fence
    cp.event(
        "tool.dispatching",
        seq=call.step.seq,
        tool=call.tool_name,
        attempt=call.attempt_count,
        idempotency_key=call.idempotency_key,
    )
    cp.boundary("dispatching")


def _dispatch(lease: Lease, step: Step, call: ToolCall, tool: Tool, *, execute: bool = True) -> str:
    """The ``dispatching`` boundary for an approved call or a re-dispatch with the same key:
    attempt incremented, approval consumed, precondition re-checked, in one transaction.
    ``execute=False`` (remote agents): stop there; the agent process calls the tool."""
    revoked = _principal_refusal(lease, tool)
    if revoked:
        _pause_principal_revoked(lease, revoked)
        return Outcome.PARKED
    if tool.precondition is not None:
        fingerprint = tool.precondition(call.arguments)  # may do I/O: outside the transaction
        if fingerprint != call.precondition_fingerprint:
            # The approver approved one world, never a different one: the approval is not
            # used, and the agent sees both fingerprints and decides again.
            with lease.checkpoint() as cp:
                get_gate().cancel(cp=cp, call=call, reason="precondition_changed")
                ToolCall.objects.filter(id=call.id).update(
                    status=ToolCall.Status.CANCELLED, updated_at=timezone.now()
                )
                cp.event(
                    "tool.cancelled",
                    seq=step.seq,
                    tool=call.tool_name,
                    reason="precondition_changed",
                    decided_fingerprint=call.precondition_fingerprint,
                    current_fingerprint=fingerprint,
                )
                _fail_step_in(
                    cp,
                    lease,
                    step,
                    "precondition changed since the call was decided: "
                    f"{call.precondition_fingerprint} -> {fingerprint}",
                )
            return Outcome.CONTINUE
    needs_approval = tool.approval.requires_approval(call.arguments)
    try:
        with lease.checkpoint() as cp:
            if call.status == ToolCall.Status.APPROVED:
                # approved calls always use their approval up, even when an edit brought the
                # arguments below the policy's threshold: an approval is never left to reuse
                get_gate().consume(cp=cp, call=call, tool=tool)
            elif needs_approval and call.attempt_count == 0:
                raise GateRefused("the call needs an approval it does not have")
            expected = call.status
            _mark_dispatching(cp, call, lease)
            updated = ToolCall.objects.filter(id=call.id, status=expected).update(
                status=call.status,
                attempt_count=call.attempt_count,
                dispatched_at=call.dispatched_at,
                dispatch_incarnation=call.dispatch_incarnation,
                reconcile_attempts=call.reconcile_attempts,
                # an operator's "dispatch again" is used up by this dispatch
                redispatch_authorized=False,
                updated_at=timezone.now(),
            )
            if updated != 1:
                raise LeaseLost(f"tool call {call.idempotency_key} changed under us")
    except GateRefused as exc:
        return _request_approval_again(lease, step, call, tool, str(exc))
    if not execute:
        return Outcome.CONTINUE
    return _execute(lease, step, call, tool)


def _request_approval_again(lease: Lease, step: Step, call: ToolCall, tool: Tool, why: str) -> str:
    with lease.checkpoint() as cp:
        get_gate().cancel(cp=cp, call=call, reason="superseded")
        ToolCall.objects.filter(id=call.id).update(
            status=ToolCall.Status.AWAITING_APPROVAL, updated_at=timezone.now()
        )
        call.status = ToolCall.Status.AWAITING_APPROVAL
        get_gate().request(cp=cp, run=lease.run, call=call, tool=tool)
        cp.event("run.waiting", on="approval", seq=step.seq, tool=tool.name, why=why)
        cp.update(status=Run.Status.WAITING_APPROVAL, lease_owner="", lease_expires_at=None)
        cp.boundary("approval_requested")
    return Outcome.PARKED


# --- calling the tool -------------------------------------------------------------------------


class _LeaseKeeper:
    """Renews the lease while a tool call is in flight (long calls must not lose it)."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.stop = threading.Event()
        self.lost = False
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"lease-{lease.run.id}")

    def __enter__(self) -> _LeaseKeeper:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        interval = max(_conf("LEASE_TTL") / 3, 0.05)
        try:
            while not self.stop.wait(interval):
                renewed = Run.objects.filter(
                    id=self.lease.run.id, fence=self.lease.fence, status=Run.Status.RUNNING
                ).update(lease_expires_at=lease_expiry_expression())
                if renewed != 1:
                    self.lost = True
                    return
        except Exception:
            log.exception("run %s: lease renewal failed", self.lease.run.id)
        finally:
            connection.close()


def _call_tool(
    lease: Lease, call: ToolCall, tool: Tool, *, attempt: int
) -> tuple[bool | None, ToolResult | None, str]:
    """The external call: (ok, result, error); ok is None when the outcome is unknown."""
    ctx = ToolContext(
        run_id=str(lease.run.id),
        idempotency_key=call.idempotency_key,
        attempt=attempt,
        timeout=tool.timeout,
    )
    from runs import faults

    ok: bool | None
    result: ToolResult | None = None
    error = ""
    # The last commit renewed the lease for a full TTL; only a call that may outlast half
    # of it needs a renewal thread.
    keeper = _LeaseKeeper(lease) if tool.timeout > _conf("LEASE_TTL") / 2 else nullcontext()
    with keeper:
        try:
            result = tool.call(call.arguments, ctx)
            ok = True
        except ToolFailed as exc:
            ok, error = False, _describe(exc)
        except OutcomeUnknown as exc:
            ok, error = None, _describe(exc)
        except Exception as exc:
            # Unexpected: we cannot tell whether the side effect happened.
            ok, error = None, _describe(exc)
    faults.crash_point("tool_call")
    return ok, result, error


def _execute(lease: Lease, step: Step, call: ToolCall, tool: Tool) -> str:
    ok, result, error = _call_tool(lease, call, tool, attempt=call.attempt_count)
    if ok is None:
        _mark_unknown(lease, call, error)
        return _reconcile(lease, step, call, tool)
    with lease.checkpoint(optimistic=True) as cp:
        # the receipt and both rows' new status go with the events (one statement on
        # PostgreSQL)
        _record_receipt(
            cp,
            lease,
            call,
            ok=ok,
            result=result.result if result else {"error": error},
            external_ref=result.external_ref if result else "",
            source=ToolReceipt.Source.TOOL,
            later=True,
        )
        _complete_step(
            cp, lease, step, call, ok, result.result if result else None, error, later=True
        )
    return Outcome.CONTINUE


def _record_receipt(
    cp,
    lease: Lease,
    call: ToolCall,
    *,
    ok: bool,
    result: Any,
    external_ref: str,
    source: str,
    later: bool = False,
) -> None:
    transitions.record_receipt(
        cp,
        call,
        ok=ok,
        result=result,
        external_ref=external_ref,
        source=source,
        recorded_by=lease.actor,
        incarnation=lease.fence,
        later=later,
    )


def _complete_step(
    cp,
    lease: Lease,
    step: Step,
    call: ToolCall,
    ok: bool,
    output: Any,
    error: str,
    *,
    later: bool = False,
) -> None:
    """``step_completed``: the outcome applied to the run's state (shares the receipt's commit)."""
    transitions.complete_step(
        cp,
        run=lease.run,
        agent=lease.agent,
        step=step,
        ok=ok,
        output=output,
        error=error,
        later=later,
    )


def _fail_step_in(cp, lease: Lease, step: Step, error: str) -> None:
    transitions.fail_step(cp, run=lease.run, agent=lease.agent, step=step, error=error)


def _fail_step(lease: Lease, step: Step, error: str) -> None:
    with lease.checkpoint() as cp:
        _fail_step_in(cp, lease, step, error)


# --- unknown outcomes (DESIGN §5.3) -----------------------------------------------------------


def _mark_unknown(lease: Lease, call: ToolCall, error: str) -> None:
    with lease.checkpoint() as cp:
        call.status = ToolCall.Status.UNKNOWN
        call.last_error = error
        ToolCall.objects.filter(id=call.id).update(
            status=call.status, last_error=error, updated_at=timezone.now()
        )
        cp.event(
            "tool.unknown",
            seq=call.step.seq,
            tool=call.tool_name,
            attempt=call.attempt_count,
            idempotency_key=call.idempotency_key,
            error=error,
        )


def _reconcile(
    lease: Lease, step: Step, call: ToolCall, tool: Tool, *, interrupted: bool = False
) -> str:
    """Decide an unknown outcome without ever repeating a side effect that may have happened.
    ``interrupted``: the call was left in dispatching by a process that died."""
    if tool.effect == Effect.READ:
        # No side effect: simply call it again. Only outcomes seen to be unknown count toward
        # READ_MAX_ATTEMPTS: an attempt cut short by a crash says nothing about the tool (a
        # crash loop ends at MAX_RECOVERIES). The count is written with the re-dispatch, so
        # a crash between the two cannot count one failure twice.
        failures = call.reconcile_attempts + (0 if interrupted else 1)
        if failures >= _conf("READ_MAX_ATTEMPTS"):
            _fail_step(lease, step, f"read tool failed {failures} times: {call.last_error}")
            return Outcome.CONTINUE
        call.reconcile_attempts = failures
        return _dispatch(lease, step, call, tool)
    if tool.effect == Effect.UNSAFE:
        _park_needs_attention(
            lease,
            Run.Reason.UNKNOWN_OUTCOME,
            f"{tool.name} (unsafe) may or may not have acted: {call.last_error}",
        )
        return Outcome.PARKED
    if tool.reconcile is None:
        # idempotent without a lookup: the external system deduplicates by key
        return _dispatch(lease, step, call, tool)

    if call.next_reconcile_at is not None and call.next_reconcile_at > lease.now():
        _release(lease, wake_at=call.next_reconcile_at)
        return Outcome.PARKED
    try:
        found = tool.reconcile(call.idempotency_key, call.arguments)
        outcome, detail = found.outcome, found.detail
    except Exception as exc:
        # a lookup that fails is NOT absence
        found, outcome, detail = None, LookupResult.UNKNOWN, _describe(exc)

    attempt = call.reconcile_attempts + 1
    if outcome == LookupResult.FOUND:
        with lease.checkpoint() as cp:
            ToolCall.objects.filter(id=call.id).update(
                reconcile_attempts=attempt, next_reconcile_at=None
            )
            cp.event(
                "tool.reconcile_attempted",
                seq=step.seq,
                attempt=attempt,
                outcome="found",
                detail=detail,
            )
            _record_receipt(
                cp,
                lease,
                call,
                ok=True,
                result=found.result,
                external_ref=found.external_ref,
                source=ToolReceipt.Source.RECONCILIATION,
            )
            _complete_step(cp, lease, step, call, True, found.result, "")
        return Outcome.CONTINUE

    if outcome == LookupResult.ABSENT:
        # Reliably absent. An idempotent system may simply get the same key again; any other
        # waits until the original request can no longer land.
        can_land_until = _can_land_until(lease, call, tool)
        must_wait = tool.effect != Effect.IDEMPOTENT and lease.now() < can_land_until
        with lease.checkpoint() as cp:
            ToolCall.objects.filter(id=call.id).update(
                reconcile_attempts=attempt, next_reconcile_at=can_land_until if must_wait else None
            )
            cp.event(
                "tool.reconcile_attempted",
                seq=step.seq,
                attempt=attempt,
                outcome="absent",
                detail=detail,
                redispatch_after=can_land_until.isoformat() if must_wait else None,
            )
            if must_wait:
                _release_in(cp, wake_at=can_land_until)
        if must_wait:
            return Outcome.PARKED
        call.reconcile_attempts = attempt
        return _dispatch(lease, step, call, tool)

    # the lookup could not decide: retry with backoff, then a person
    if attempt >= _conf("RECONCILE_MAX_ATTEMPTS"):
        with lease.checkpoint() as cp:
            ToolCall.objects.filter(id=call.id).update(
                reconcile_attempts=attempt, next_reconcile_at=None
            )
            cp.event(
                "tool.reconcile_attempted",
                seq=step.seq,
                attempt=attempt,
                outcome="unknown",
                detail=detail,
            )
        _park_needs_attention(
            lease,
            Run.Reason.UNKNOWN_OUTCOME,
            f"{tool.name}: reconciliation could not decide after {attempt} attempts: {detail}",
        )
        return Outcome.PARKED
    backoff = _conf("RECONCILE_BACKOFF") * (2 ** (attempt - 1))
    next_at = lease.now() + timedelta(seconds=backoff)
    with lease.checkpoint() as cp:
        ToolCall.objects.filter(id=call.id).update(
            reconcile_attempts=attempt, next_reconcile_at=next_at
        )
        cp.event(
            "tool.reconcile_attempted",
            seq=step.seq,
            attempt=attempt,
            outcome="unknown",
            detail=detail,
            retry_in_seconds=backoff,
        )
        _release_in(cp, wake_at=next_at)
    return Outcome.PARKED


def _can_land_until(lease: Lease, call: ToolCall, tool: Tool) -> datetime:
    """Until when a request sent at the call's last dispatch may still reach the system."""
    return (call.dispatched_at or lease.now()) + timedelta(
        seconds=tool.timeout + _conf("REDISPATCH_MARGIN")
    )

"""The durable run engine (DESIGN §3–§5).

One call to ``advance(run_id, worker=...)`` claims the run's lease and drives it for a slice
of steps. Everything it does is re-derived from the record: the open step, its tool call's
status, the receipt. Every write goes through ``checkpoint(fence=...)``; a write that matches
no row (the fence moved on) raises ``LeaseLost`` and this process stops at once.

Never is a transaction or row lock held across a tool call, a lookup or an agent decision.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q
from django.db.models.functions import Now
from django.utils import timezone

from runs import services
from runs.dbtime import db_now
from runs.events import Checkpoint, LeaseLost, checkpoint, lease_expiry_expression
from runs.gate import GateRefused, get_gate
from runs.models import Run, Step, ToolCall, ToolReceipt
from runs.queue import enqueue_on_commit
from runs.registry import (
    Agent,
    CallTool,
    DecisionContext,
    Effect,
    Fail,
    Finish,
    LookupResult,
    OutcomeUnknown,
    StepView,
    Tool,
    ToolContext,
    ToolFailed,
    ToolResult,
    UnknownAgent,
    UnknownTool,
    digest,
    registry,
)

log = logging.getLogger(__name__)


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

    @property
    def actor(self) -> str:
        return f"worker:{self.worker}"

    def now(self) -> datetime:
        """Database time, derived from the clock read at claim (no query per step)."""
        return self.claimed_db_time + timedelta(seconds=time.monotonic() - self.claimed_monotonic)

    @contextmanager
    def checkpoint(self) -> Iterator[Checkpoint]:
        with checkpoint(self.run.id, actor=self.actor, channel="worker", fence=self.fence) as cp:
            yield cp
        # operator requests arrive on the locked row; the loop honours them at its next turn
        self.run.requested_action = cp.run.requested_action
        self.run.requested_by = cp.run.requested_by
        self.run.requested_reason = cp.run.requested_reason

    def open_step(self) -> Step | None:
        if self.steps and self.steps[-1].status == Step.Status.PENDING:
            return self.steps[-1]
        return None


class Outcome:
    CONTINUE = "continue"
    PARKED = "parked"  # lease released: waiting, needs attention, finished, yielded


# --- claim -----------------------------------------------------------------------------------


def claim(run_id: Any, *, worker: str) -> Lease | None:
    """Take the lease with one compare-and-set UPDATE in database time. Returns None when the
    run is not runnable or someone else holds a live lease (a duplicate wake-up)."""
    observed = (
        Run.objects.filter(id=run_id, status__in=Run.RUNNABLE)
        .values_list("fence", "status")
        .first()
    )
    if observed is None:
        return None
    fence, status = observed
    recovered = status == Run.Status.RUNNING  # its last holder never released it
    with transaction.atomic():
        taken = (
            Run.objects.filter(id=run_id, fence=fence, status__in=Run.RUNNABLE)
            .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=Now()))
            .filter(Q(wake_at__isnull=True) | Q(wake_at__lte=Now()))
            .update(
                fence=F("fence") + 1,
                lease_owner=worker,
                lease_expires_at=lease_expiry_expression(),
                status=Run.Status.RUNNING,
                recovery_count=F("recovery_count") + (1 if recovered else 0),
                wake_at=None,
                enqueued_at=None,
            )
        )
        if taken != 1:
            return None
        run = Run.objects.get(id=run_id)
        try:
            agent = registry.agent(run.agent_name)
        except UnknownAgent:
            agent = None
        lease = Lease(
            run=run,
            fence=run.fence,
            worker=worker,
            recovered=recovered,
            agent=agent,  # type: ignore[arg-type]
            steps=list(Step.objects.filter(run_id=run_id).order_by("seq")),
            claimed_db_time=db_now(),
        )
        with lease.checkpoint() as cp:
            cp.event(
                "run.claimed",
                worker=worker,
                fence=run.fence,
                recovered=recovered,
                recovery_count=run.recovery_count,
            )
            cp.boundary("claimed")
    return lease


# --- the loop --------------------------------------------------------------------------------


def advance(run_id: Any, *, worker: str) -> str:
    """Claim the run and drive it for one slice. Safe to call any number of times, from any
    number of processes: only the lease holder writes."""
    lease = claim(run_id, worker=worker)
    if lease is None:
        return "not_claimed"
    try:
        return _drive(lease)
    except LeaseLost as exc:
        log.warning("run %s: %s; stopping this incarnation", run_id, exc)
        return "lease_lost"


def _drive(lease: Lease) -> str:
    if lease.agent is None:
        _park_needs_attention(
            lease,
            Run.Reason.INCOMPATIBLE_AGENT_VERSION,
            f"agent {lease.run.agent_name!r} is not registered",
        )
        return "parked"
    if lease.agent.version != lease.run.agent_version:
        # the resume rules for a changed agent (state migrations, fork) build on this check
        _park_needs_attention(
            lease,
            Run.Reason.INCOMPATIBLE_AGENT_VERSION,
            f"run was started on {lease.run.agent_name} version {lease.run.agent_version}; "
            f"the registered version is {lease.agent.version}",
        )
        return "parked"
    if lease.recovered and lease.run.recovery_count > _conf("MAX_RECOVERIES"):
        _park_needs_attention(
            lease,
            Run.Reason.RECOVERY_LIMIT,
            f"recovered {lease.run.recovery_count} times (limit {_conf('MAX_RECOVERIES')})",
        )
        return "parked"
    started = time.monotonic()
    advanced = 0
    while True:
        if _honour_request(lease):
            return "parked"
        outcome = _advance_once(lease)
        if outcome == Outcome.PARKED:
            return "parked"
        advanced += 1
        if advanced >= _conf("SLICE_STEPS") or time.monotonic() - started > _conf("SLICE_SECONDS"):
            _yield(lease)
            return "yielded"


def _honour_request(lease: Lease) -> bool:
    run = lease.run
    if not run.requested_action:
        return False
    with lease.checkpoint() as cp:
        request = cp.run.requested_action
        if request == Run.Request.TERMINATE:
            services.apply_terminate(cp, by=cp.run.requested_by, reason=cp.run.requested_reason)
        elif request == Run.Request.PAUSE:
            services.apply_pause(cp, by=cp.run.requested_by, reason=cp.run.requested_reason)
        else:
            return False
    return True


def _advance_once(lease: Lease) -> str:
    step = lease.open_step()
    if step is not None:
        return _continue_step(lease, step)
    exhausted = _budget_exhausted(lease)
    if exhausted:
        _park_needs_attention(lease, Run.Reason.BUDGET_EXHAUSTED, exhausted)
        return Outcome.PARKED
    try:
        action = lease.agent.decide(_context(lease))
    except Exception as exc:
        # The agent's own code failed: a clear, recorded failure, never a crash loop.
        _finish(lease, Run.Status.FAILED, reason=Run.Reason.AGENT_FAILED, detail=_describe(exc))
        return Outcome.PARKED
    return _decide(lease, action)


def _context(lease: Lease) -> DecisionContext:
    run = lease.run
    return DecisionContext(
        run_id=str(run.id),
        goal=run.goal,
        input=run.input,
        state=run.state,
        steps=tuple(_view(step) for step in lease.steps),
    )


def _view(step: Step) -> StepView:
    return StepView(
        seq=step.seq,
        kind=step.kind,
        status=step.status,
        input=step.input,
        output=step.output,
        error=step.error,
    )


def _budget_exhausted(lease: Lease) -> str:
    """Checked from persisted usage before every decision: a restart never resets it."""
    run = lease.run
    if run.max_steps is not None and run.steps_used >= run.max_steps:
        return f"step budget exhausted: {run.steps_used} of {run.max_steps} steps used"
    if run.max_cost is not None and run.cost_used >= run.max_cost:
        return f"cost budget exhausted: {run.cost_used} of {run.max_cost}"
    if run.max_tokens is not None and run.tokens_used >= run.max_tokens:
        return f"token budget exhausted: {run.tokens_used} of {run.max_tokens}"
    if run.deadline is not None and lease.now() >= run.deadline:
        return f"deadline {run.deadline.isoformat()} has passed"
    return ""


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000]


# --- deciding --------------------------------------------------------------------------------


def _decide(lease: Lease, action: Any) -> str:
    seq = (lease.steps[-1].seq + 1) if lease.steps else 1
    if isinstance(action, Finish):
        _finish(lease, Run.Status.SUCCEEDED, result=action.result, seq=seq)
        return Outcome.PARKED
    if isinstance(action, Fail):
        _finish(
            lease, Run.Status.FAILED, reason=Run.Reason.AGENT_FAILED, detail=action.reason, seq=seq
        )
        return Outcome.PARKED
    if isinstance(action, CallTool):
        return _decide_call(lease, action, seq)
    _finish(
        lease,
        Run.Status.FAILED,
        reason=Run.Reason.AGENT_FAILED,
        detail=f"decide() returned {type(action).__name__}, not an action",
    )
    return Outcome.PARKED


def _rejected_call(lease: Lease, action: CallTool, seq: int, error: str) -> str:
    """A call the engine refuses before anything happens (unknown tool, bad arguments):
    recorded as a failed step the agent sees, never dispatched."""
    with lease.checkpoint() as cp:
        step = Step.objects.create(
            run_id=lease.run.id,
            seq=seq,
            kind=Step.Kind.TOOL_CALL,
            status=Step.Status.FAILED,
            input={"tool": action.tool, "arguments": "(not recorded: invalid call)"},
            error=error,
            incarnation=lease.fence,
            completed_at=timezone.now(),
        )
        cp.event("step.decided", seq=seq, kind=step.kind, tool=action.tool, refused=error)
        cp.update(steps_used=F("steps_used") + 1)
        cp.boundary("decided")
    lease.run.steps_used += 1
    lease.steps.append(step)
    return Outcome.CONTINUE


def _decide_call(lease: Lease, action: CallTool, seq: int) -> str:
    run = lease.run
    if action.tool not in lease.agent.tools:
        return _rejected_call(
            lease, action, seq, f"agent {run.agent_name} may not use tool {action.tool!r}"
        )
    try:
        tool = registry.tool(action.tool)
    except UnknownTool as exc:
        return _rejected_call(lease, action, seq, str(exc))
    arguments = dict(action.arguments)
    errors = tool.validate(arguments)
    if errors:
        return _rejected_call(
            lease, action, seq, "arguments do not match the schema: " + "; ".join(errors)
        )
    fingerprint = tool.precondition(arguments) if tool.precondition else ""
    needs_approval = tool.approval.requires_approval(arguments)
    masked = tool.mask(arguments)

    with lease.checkpoint() as cp:
        step = Step.objects.create(
            run_id=run.id,
            seq=seq,
            kind=Step.Kind.TOOL_CALL,
            input={"tool": tool.name, "arguments": masked},
            incarnation=lease.fence,
        )
        call = ToolCall(
            step=step,
            run_id=run.id,
            tool_name=tool.name,
            tool_version=tool.version,
            effect=str(tool.effect),
            arguments=arguments,
            arguments_masked=masked,
            arguments_digest=digest(arguments),
            idempotency_key=f"{cp.run.root_run_id or run.id}:{seq}",
            precondition_fingerprint=fingerprint,
        )
        cp.event(
            "step.decided",
            seq=seq,
            kind=step.kind,
            tool=tool.name,
            tool_version=tool.version,
            arguments=masked,
            idempotency_key=call.idempotency_key,
        )
        cp.update(steps_used=F("steps_used") + 1)
        cp.boundary("decided")
        if needs_approval:
            # decided + approval_requested share this commit: no external call between them
            call.status = ToolCall.Status.AWAITING_APPROVAL
            call.save(force_insert=True)
            get_gate().request(cp=cp, run=run, call=call, tool=tool)
            cp.event("run.waiting", on="approval", seq=seq, tool=tool.name)
            cp.update(status=Run.Status.WAITING_APPROVAL, lease_owner="", lease_expires_at=None)
            cp.boundary("approval_requested")
        else:
            # decided + dispatching share this commit: both come before the side effect
            _mark_dispatching(cp, call, lease)
            call.save(force_insert=True)
    run.steps_used += 1
    lease.steps.append(step)
    if needs_approval:
        return Outcome.PARKED
    return _execute(lease, step, call, tool)


def _mark_dispatching(cp, call: ToolCall, lease: Lease) -> None:
    call.status = ToolCall.Status.DISPATCHING
    call.attempt_count += 1
    call.dispatched_at = timezone.now()
    call.dispatch_incarnation = lease.fence
    cp.event(
        "tool.dispatching",
        seq=call.step.seq,
        tool=call.tool_name,
        attempt=call.attempt_count,
        idempotency_key=call.idempotency_key,
    )
    cp.boundary("dispatching")


# --- continuing an open step ----------------------------------------------------------------


def _continue_step(lease: Lease, step: Step) -> str:
    if step.kind != Step.Kind.TOOL_CALL:
        _fail_step(lease, step, f"cannot continue a {step.kind} step")
        return Outcome.CONTINUE
    call = ToolCall.objects.select_related("step").get(step=step)
    try:
        tool = registry.tool(call.tool_name)
    except UnknownTool:
        tool = None
    if tool is None or tool.version != call.tool_version:
        return _tool_changed(lease, step, call, tool)

    status = call.status
    if status in (ToolCall.Status.PROPOSED, ToolCall.Status.APPROVED):
        return _dispatch(lease, step, call, tool)
    if status == ToolCall.Status.AWAITING_APPROVAL:
        _release(lease, status=Run.Status.WAITING_APPROVAL)
        return Outcome.PARKED
    if status == ToolCall.Status.REJECTED:
        _fail_step(lease, step, f"approval rejected: {call.last_error}".rstrip(": "))
        return Outcome.CONTINUE
    if status == ToolCall.Status.CANCELLED:
        _fail_step(lease, step, "tool call cancelled")
        return Outcome.CONTINUE
    if status == ToolCall.Status.DISPATCHING:
        # Left in flight by an earlier incarnation: nobody knows whether it took effect.
        _mark_unknown(
            lease, call, f"left in dispatching by incarnation {call.dispatch_incarnation}"
        )
        return _reconcile(lease, step, call, tool, interrupted=True)
    if status == ToolCall.Status.UNKNOWN:
        return _reconcile(lease, step, call, tool)
    # succeeded / failed with a receipt but the step still open
    receipt = ToolReceipt.objects.get(tool_call=call)
    with lease.checkpoint() as cp:
        _complete_step(
            cp,
            lease,
            step,
            call,
            receipt.outcome == ToolReceipt.Outcome.SUCCEEDED,
            receipt.result,
            "",
        )
    return Outcome.CONTINUE


def _tool_changed(lease: Lease, step: Step, call: ToolCall, tool: Tool | None) -> str:
    """The call's tool is gone or changed since it was decided (DESIGN §5.2). A call that
    was never dispatched is cancelled; one in flight keeps its unknown outcome for a person."""
    detail = (
        f"tool {call.tool_name!r} is no longer registered"
        if tool is None
        else f"tool {call.tool_name!r} changed from version {call.tool_version} to {tool.version}"
    )
    if call.status in (ToolCall.Status.DISPATCHING, ToolCall.Status.UNKNOWN):
        if call.status == ToolCall.Status.DISPATCHING:
            _mark_unknown(lease, call, "left in dispatching; " + detail)
        _park_needs_attention(lease, Run.Reason.TOOL_RETIRED, detail + "; its outcome is unknown")
        return Outcome.PARKED
    with lease.checkpoint() as cp:
        if call.status in ToolCall.OPEN:
            get_gate().cancel(cp=cp, call=call, reason="tool_retired")
            ToolCall.objects.filter(id=call.id).update(
                status=ToolCall.Status.CANCELLED, updated_at=timezone.now()
            )
            cp.event(
                "tool.cancelled",
                seq=step.seq,
                tool=call.tool_name,
                reason="tool_retired",
                detail=detail,
            )
        _fail_step_in(cp, lease, step, f"tool_retired: {detail}")
    return Outcome.CONTINUE


def _dispatch(lease: Lease, step: Step, call: ToolCall, tool: Tool) -> str:
    """The ``dispatching`` boundary for an approved call or a re-dispatch with the same key:
    attempt incremented, approval consumed, precondition re-checked, in one transaction."""
    if tool.precondition is not None:
        fingerprint = tool.precondition(call.arguments)  # may do I/O: outside the transaction
        if fingerprint != call.precondition_fingerprint:
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
                )
                _fail_step_in(cp, lease, step, "precondition changed since the call was decided")
            return Outcome.CONTINUE
    needs_approval = tool.approval.requires_approval(call.arguments)
    try:
        with lease.checkpoint() as cp:
            if needs_approval and call.status == ToolCall.Status.APPROVED:
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
                updated_at=timezone.now(),
            )
            if updated != 1:
                raise LeaseLost(f"tool call {call.idempotency_key} changed under us")
    except GateRefused as exc:
        return _request_approval_again(lease, step, call, tool, str(exc))
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
                renewed = Run.objects.filter(id=self.lease.run.id, fence=self.lease.fence).update(
                    lease_expires_at=lease_expiry_expression()
                )
                if renewed != 1:
                    self.lost = True
                    return
        except Exception:
            log.exception("run %s: lease renewal failed", self.lease.run.id)
        finally:
            connection.close()


def _execute(lease: Lease, step: Step, call: ToolCall, tool: Tool) -> str:
    ctx = ToolContext(
        run_id=str(lease.run.id),
        idempotency_key=call.idempotency_key,
        attempt=call.attempt_count,
        timeout=tool.timeout,
    )
    from runs import faults

    ok: bool | None
    result: ToolResult | None = None
    error = ""
    # The dispatching commit just renewed the lease for a full TTL; only a call that may
    # outlast half of it needs a renewal thread.
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

    if ok is None:
        _mark_unknown(lease, call, error)
        return _reconcile(lease, step, call, tool)
    with lease.checkpoint() as cp:
        _record_receipt(
            cp,
            lease,
            call,
            ok=ok,
            result=result.result if result else {"error": error},
            external_ref=result.external_ref if result else "",
            source=ToolReceipt.Source.TOOL,
        )
        _complete_step(cp, lease, step, call, ok, result.result if result else None, error)
    return Outcome.CONTINUE


def _record_receipt(
    cp, lease: Lease, call: ToolCall, *, ok: bool, result: Any, external_ref: str, source: str
) -> None:
    ToolReceipt.objects.create(
        tool_call=call,
        outcome=ToolReceipt.Outcome.SUCCEEDED if ok else ToolReceipt.Outcome.FAILED,
        result=result,
        external_ref=external_ref or "",
        source=source,
        recorded_by=lease.actor,
        incarnation=lease.fence,
    )
    call.status = ToolCall.Status.SUCCEEDED if ok else ToolCall.Status.FAILED
    ToolCall.objects.filter(id=call.id).update(status=call.status, updated_at=timezone.now())
    cp.event(
        "tool.succeeded" if ok else "tool.failed",
        seq=call.step.seq,
        tool=call.tool_name,
        attempt=call.attempt_count,
        source=source,
        external_ref=external_ref or "",
    )
    cp.boundary("receipt_recorded")


def _complete_step(
    cp, lease: Lease, step: Step, call: ToolCall, ok: bool, output: Any, error: str
) -> None:
    """``step_completed``: the outcome applied to the run's state (shares the receipt's commit)."""
    step.status = Step.Status.COMPLETED if ok else Step.Status.FAILED
    step.output = output
    step.error = error
    step.completed_at = timezone.now()
    step.save(update_fields=["status", "output", "error", "completed_at"])
    _apply_to_state(cp, lease, step)


def _apply_to_state(cp, lease: Lease, step: Step) -> None:
    run = lease.run
    state = lease.agent.apply(dict(run.state), _view(step))
    run.state = state
    run.state_version += 1
    cp.update(state=state, state_version=run.state_version)
    cp.boundary("step_completed")


def _fail_step_in(cp, lease: Lease, step: Step, error: str) -> None:
    step.status = Step.Status.FAILED
    step.error = error
    step.completed_at = timezone.now()
    step.save(update_fields=["status", "error", "completed_at"])
    cp.event("step.failed", seq=step.seq, error=error)
    _apply_to_state(cp, lease, step)


def _fail_step(lease: Lease, step: Step, error: str) -> None:
    with lease.checkpoint() as cp:
        _fail_step_in(cp, lease, step, error)


# --- unknown outcomes (DESIGN §5.3) ------------------------------------------------------------


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
        can_land_until = (call.dispatched_at or lease.now()) + timedelta(
            seconds=tool.timeout + _conf("REDISPATCH_MARGIN")
        )
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


# --- releasing the lease ---------------------------------------------------------------------


def _release_in(cp, *, status: str = Run.Status.QUEUED, wake_at: datetime | None = None) -> None:
    cp.event("run.released", status=status, wake_at=wake_at.isoformat() if wake_at else None)
    cp.update(status=status, lease_owner="", lease_expires_at=None, wake_at=wake_at)


def _release(
    lease: Lease, *, status: str = Run.Status.QUEUED, wake_at: datetime | None = None
) -> None:
    with lease.checkpoint() as cp:
        _release_in(cp, status=status, wake_at=wake_at)


def _yield(lease: Lease) -> None:
    """End of a slice: let other runs have the worker, and ask to be woken again."""
    with lease.checkpoint() as cp:
        _release_in(cp)
        cp.update(enqueued_at=Now())
        enqueue_on_commit(lease.run.id)


def _park_needs_attention(lease: Lease, reason: str, detail: str) -> None:
    with lease.checkpoint() as cp:
        cp.event("run.needs_attention", reason=reason, detail=detail)
        cp.update(
            status=Run.Status.NEEDS_ATTENTION,
            reason_code=reason,
            reason_detail=detail,
            lease_owner="",
            lease_expires_at=None,
        )


def _finish(
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
            step = Step.objects.create(
                run_id=lease.run.id,
                seq=seq,
                kind=kind,
                status=Step.Status.COMPLETED,
                input={"result": result} if kind == Step.Kind.FINISH else {"reason": detail},
                incarnation=lease.fence,
                completed_at=timezone.now(),
            )
            lease.steps.append(step)
            cp.event("step.decided", seq=seq, kind=kind)
            cp.update(steps_used=F("steps_used") + 1)
            cp.boundary("decided")
        cp.event(f"run.{status}", result=result, reason=reason, detail=detail)
        cp.update(
            status=status,
            result=result,
            reason_code=reason,
            reason_detail=detail,
            finished_at=Now(),
            lease_owner="",
            lease_expires_at=None,
        )
        cp.boundary("run_finished")

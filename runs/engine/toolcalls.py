"""A tool call from the ``dispatching`` checkpoint to its receipt: dispatch (approval
consumed, precondition re-checked), the external call with the lease kept alive, the receipt
and the step it completes, and unknown outcomes reconciled by idempotency key (DESIGN §5.3).
These call each other (an unknown outcome may be dispatched again), so they share a module."""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from datetime import datetime, timedelta
from typing import Any

from django.db import connection
from django.db.models import F

from runs import flow, jsonlimits, spend
from runs.dbtime import db_now, db_now_expression
from runs.engine.lease import (
    Lease,
    Outcome,
    _conf,
    _describe,
    log,
    park_needs_attention,
    pause_principal_revoked,
    principal_refusal,
    release,
)
from runs.gate import GateRefused, Verdict, assess, get_gate, recorded_facts
from runs.models import Run, Step, ToolCall, ToolReceipt
from runs.record import rows, transitions
from runs.record.checkpoint import LeaseLost, lease_expiry
from runs.record.eventtypes import EventType
from runs.record.runs import call_await_approval, run_release
from runs.registry import (
    Effect,
    LookupResult,
    OutcomeUnknown,
    Reconciliation,
    Resend,
    Tool,
    ToolContext,
    ToolFailed,
    ToolResult,
)

# --- dispatching ------------------------------------------------------------------------------


def _mark_dispatching(cp, call: ToolCall, lease: Lease, tool: Tool) -> None:
    # DESIGN §9: the deadlines in the database's time, computed by the statement that writes
    # the dispatch (never this worker's estimate); the local budget starts before that
    # statement runs, so it can only end earlier than the database's deadlines
    lease.dispatch_started = time.monotonic()
    send, landing = _deadline_offsets(tool)
    transitions.call_dispatching(
        cp, call, fence=lease.fence, send=send, landing=landing, simulated=simulates(lease, tool)
    )


def _deadline_offsets(tool: Tool) -> tuple[float, float]:
    """Seconds after the dispatch until its send deadline — never later than the lease the
    dispatching commit renews — and until its landing deadline."""
    send = min(_conf("SEND_WINDOW"), _conf("LEASE_TTL"))
    return send, send + tool.timeout + _conf("REDISPATCH_MARGIN")


def _precondition(lease: Lease, tool: Tool, call: ToolCall) -> str | None:
    """The tool's precondition fingerprint for an existing call ("" with none), or None when
    the precondition raised: the run is then parked ``precondition_failed`` with the error.
    It is the tool's own code doing I/O (a resource deleted, a service down); raising again
    in every incarnation would only crash the run up to its recovery limit, and the
    approver's world can no longer be confirmed, so a person decides (retry, fork or
    terminate)."""
    if tool.precondition is None:
        return ""
    try:
        return tool.precondition(call.arguments)  # may do I/O: outside any transaction
    except Exception as exc:
        park_needs_attention(
            lease,
            Run.Reason.PRECONDITION_FAILED,
            f"the precondition of {tool.name} (call {call.idempotency_key}) raised: "
            f"{_describe(exc)}",
        )
        return None


def dispatch(lease: Lease, step: Step, call: ToolCall, tool: Tool, *, execute: bool = True) -> str:
    """The ``dispatching`` boundary for an approved call or a re-dispatch with the same key:
    attempt incremented, approval consumed, precondition re-checked, in one transaction.
    ``execute=False`` (remote agents): stop there; the agent process calls the tool."""
    revoked = principal_refusal(lease, tool)
    if revoked:
        pause_principal_revoked(lease, revoked)
        return Outcome.PARKED
    if tool.precondition is not None:
        fingerprint = _precondition(lease, tool, call)
        if fingerprint is None:
            return Outcome.PARKED
        if fingerprint != call.precondition_fingerprint:
            # The approver approved one world, never a different one: the approval is not
            # used, and the agent sees both fingerprints and decides again.
            with lease.checkpoint() as cp:
                get_gate().cancel(cp=cp, call=call, reason="precondition_changed")
                transitions.call_cancel(
                    cp,
                    call,
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
    limits = flow.limit_for(tool)
    capped = spend.applies(lease.run)
    try:
        with lease.checkpoint() as cp:
            # the CURRENT policy, re-evaluated in the dispatch transaction on the facts the
            # call was decided with: a policy tightened since then withdraws an approval
            # that no longer satisfies it; a loosened one never approves a call by itself.
            # A re-dispatch under the same key (attempt > 0) is reconciliation of an effect
            # that may already have happened, not a new action: no policy stops it.
            verdict = assess(
                run=lease.run,
                tool=tool,
                arguments=call.arguments,
                facts=recorded_facts(lease.run, call),
            )
            if verdict.denied and call.attempt_count == 0:
                raise PolicyDenied(verdict)
            if limits is not None:
                # the tool's limit, in this transaction, before anything is consumed: over
                # it, everything here rolls back and the run waits for capacity
                flow.acquire(cp, run=lease.run, call=call, tool_name=tool.name, limits=limits)
            if capped:
                # the spend caps that cover the run, in this transaction too: a scope with no
                # room left rolls everything back and stops the run; else the tool's declared
                # maximum is reserved until its receipt
                spend.reserve_tool(cp, run=lease.run, call=call, tool=tool, fence=lease.fence)
            if call.status == ToolCall.Status.APPROVED:
                # approved calls always use their approval up, even when an edit brought the
                # arguments below the policy's threshold: an approval is never left to reuse
                get_gate().consume(cp=cp, call=call, tool=tool, verdict=verdict)
            elif verdict.needs_approval and call.attempt_count == 0:
                raise GateRefused("the call needs an approval it does not have")
            expected = call.status
            _mark_dispatching(cp, call, lease, tool)
            if transitions.call_write_dispatch(call, expected=expected) != 1:
                raise LeaseLost(f"tool call {call.idempotency_key} changed under us")
    except GateRefused as exc:
        return _request_approval_again(lease, step, call, tool, str(exc), reason=exc.reason)
    except PolicyDenied as denied:
        return _deny_at_dispatch(lease, step, call, denied.verdict)
    except flow.AtCapacity as full:
        if not execute:
            raise  # a remote agent is told to retry later (runs.remote)
        with lease.checkpoint() as cp:
            flow.wait_commit(cp, run=lease.run, call=call, seq=step.seq, full=full)
        return Outcome.PARKED
    except spend.CapReached as full:
        if not execute:
            raise  # a remote dispatch stops the run after its transaction (runs.remote)
        # the decision is kept (the call stays undispatched): a top-up of the scope resumes
        # the run, and the call is dispatched then
        with lease.checkpoint() as cp:
            spend.stop_run(cp, run=lease.run, full=full)
        return Outcome.PARKED
    if not execute:
        return Outcome.CONTINUE
    return _execute(lease, step, call, tool)


def denial_text(verdict: Verdict) -> str:
    """What the agent sees of a policy's ``deny`` (its step's error)."""
    return f"denied by policy: {verdict.reason or 'this call is not allowed'}"


class PolicyDenied(Exception):
    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.reason)
        self.verdict = verdict


def _deny_at_dispatch(lease: Lease, step: Step, call: ToolCall, verdict: Verdict) -> str:
    """The current policy denies a call decided (and perhaps approved) under another: its
    approval is withdrawn, the call cancelled, and the agent sees the policy's reason."""
    with lease.checkpoint() as cp:
        get_gate().cancel(cp=cp, call=call, reason="policy_denied")
        transitions.call_cancel(
            cp, call, reason="policy_denied", policy_version=verdict.policy_version
        )
        _fail_step_in(cp, lease, step, denial_text(verdict))
    return Outcome.CONTINUE


def _request_approval_again(
    lease: Lease, step: Step, call: ToolCall, tool: Tool, why: str, *, reason: str = "superseded"
) -> str:
    with lease.checkpoint() as cp:
        get_gate().cancel(cp=cp, call=call, reason=reason)
        call_await_approval(cp, run=lease.run, call=call, tool=tool, seq=step.seq, why=why)
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
                ).update(lease_expires_at=db_now_expression(lease_expiry()))
                if renewed != 1:
                    self.lost = True
                    return
        except Exception:
            log.exception("run %s: lease renewal failed", self.lease.run.id)
        finally:
            connection.close()


class _NotSent(Exception):
    """The pre-send check refused: the request did not leave."""


def presend_row(
    call_id: Any, *, fence: int, attempt: int, holder: tuple[str, Any] | None = None
) -> tuple[Any, ...] | None:
    """The pre-send check's ONE query (hosted workers and remote agents' ``send-check``):
    ``runs.record.rows.presend_row``."""
    return rows.presend_row(call_id, fence=fence, attempt=attempt, holder=holder)


def _presend_check(lease: Lease, call: ToolCall, tool: Tool) -> ToolContext:
    """DESIGN §9: just before the request leaves, ONE query checks that this incarnation
    still holds the lease and the call is still its dispatch, and that the database's clock
    is before the send deadline; it reads the deadlines back. ``_NotSent`` otherwise: a
    paused worker that woke up after its lease was taken over, or after its send deadline,
    never sends."""
    checked_at = time.monotonic()
    row = presend_row(call.id, fence=lease.fence, attempt=call.attempt_count)
    if row is None:
        raise _NotSent(
            "not sent: the send deadline passed or the lease was lost before the request "
            "could leave"
        )
    call.dispatched_at, call.send_deadline, call.landing_deadline, _now = row
    started = lease.dispatch_started or checked_at
    return ToolContext(
        run_id=str(lease.run.id),
        idempotency_key=call.idempotency_key,
        attempt=call.attempt_count,
        timeout=tool.timeout,
        fence=lease.fence,
        send_deadline=call.send_deadline,
        send_by=started + _deadline_offsets(tool)[0],
        finish_by=checked_at + tool.timeout,
    )


def _call_tool(
    lease: Lease, call: ToolCall, tool: Tool, *, attempt: int
) -> tuple[bool | None, ToolResult | None, str]:
    """The external call: (ok, result, error); ok is None when the outcome is unknown."""
    from runs import faults

    ok: bool | None
    result: ToolResult | None = None
    error = ""
    simulated = simulates(lease, tool)
    if tool.effect == Effect.READ or simulated:
        # no side effect to guard: a late read harms nobody, and a dry run's simulation
        # sends nothing (issue 23: the side effect is never called, so no pre-send check)
        ctx = ToolContext(
            run_id=str(lease.run.id),
            idempotency_key=call.idempotency_key,
            attempt=attempt,
            timeout=tool.timeout,
            fence=lease.fence,
            finish_by=time.monotonic() + tool.timeout,
        )
    else:
        try:
            ctx = _presend_check(lease, call, tool)
        except _NotSent as exc:
            return None, None, str(exc)
        # contract (DESIGN §9): after the pre-send check, before the request
        faults.crash_point("before_send")
    # The last commit renewed the lease for a full TTL; only a call that may outlast half
    # of it needs a renewal thread.
    keeper = _LeaseKeeper(lease) if tool.timeout > _conf("LEASE_TTL") / 2 else nullcontext()
    body = tool.call
    if simulated:
        body = tool.dry_run or _no_dry_run
    with keeper:
        try:
            result = body(call.arguments, ctx)
            ok = True
        except ToolFailed as exc:
            ok, error = False, _describe(exc)
        except OutcomeUnknown as exc:
            ok, error = None, _describe(exc)
        except Exception as exc:
            # Unexpected: we cannot tell whether the side effect happened.
            ok, error = None, _describe(exc)
    if result is not None:
        _make_storable(lease, call, result)
    faults.crash_point("tool_call")
    return ok, result, error


def simulates(lease: Lease, tool: Tool) -> bool:
    """Whether this call of ``tool`` is simulated: the run is a dry run and the tool is not
    a ``read`` (a dry run reads for real). The run's flag came with the claim: no query."""
    return lease.run.dry_run and tool.effect != Effect.READ


def _no_dry_run(arguments: Any, ctx: ToolContext) -> ToolResult:
    # the tool lost its dry_run since the dry run started (a deploy): it is never called
    # for real in a dry run, the step fails and the agent sees why
    raise ToolFailed("dry run: this tool declares no dry_run behaviour, so it was not called")


def receipt_source(lease: Lease, tool: Tool) -> str:
    """The source of a receipt the tool itself answered: ``simulated`` in a dry run."""
    return ToolReceipt.Source.SIMULATED if simulates(lease, tool) else ToolReceipt.Source.TOOL


def _make_storable(lease: Lease, call: ToolCall, answer: ToolResult | Reconciliation) -> None:
    """A tool's or a lookup's answer records a real effect: it is never refused over a bad
    value (a NUL character, a string too long, nesting too deep — a receipt that cannot be
    written would loop the run to its recovery limit after the effect). The offending parts
    are replaced (``runs.jsonlimits.sanitize``) and the receipt's event says what changed."""
    answer.result, notes = jsonlimits.sanitize(answer.result)
    ref = answer.external_ref or ""
    if "\x00" in ref or len(ref) > _EXTERNAL_REF_MAX:
        notes.append(f"external reference cleaned and cut to {_EXTERNAL_REF_MAX} characters")
        answer.external_ref = ref.replace("\x00", "\ufffd")[:_EXTERNAL_REF_MAX]
    if notes:
        log.warning(
            "run %s: %s answered a value that had to be changed to be stored: %s",
            lease.run.id,
            call.tool_name,
            "; ".join(notes),
        )
    # carried on the answer to its receipt's event (_storage_notes): not a declared field
    answer._storage_notes = tuple(notes)  # type: ignore[union-attr]


def _storage_notes(answer: Any) -> tuple[str, ...]:
    return getattr(answer, "_storage_notes", ())


_EXTERNAL_REF_MAX: int = ToolReceipt._meta.get_field("external_ref").max_length  # type: ignore[assignment]  # a CharField has a max_length


def _execute(lease: Lease, step: Step, call: ToolCall, tool: Tool) -> str:
    ok, result, error = _call_tool(lease, call, tool, attempt=call.attempt_count)
    if ok is None:
        mark_unknown(lease, call, error)
        return _reconcile(lease, step, call, tool)
    with lease.checkpoint() as cp:
        # the receipt and both rows' new status go with the events (one statement on
        # PostgreSQL)
        record_receipt(
            cp,
            lease,
            call,
            ok=ok,
            result=result.result if result else {"error": error},
            external_ref=result.external_ref if result else "",
            source=receipt_source(lease, tool),
            notes=_storage_notes(result),
        )
        complete_step(cp, lease, step, call, ok, result.result if result else None, error)
    _slot_freed(tool, call)
    return Outcome.CONTINUE


def _slot_freed(tool: Tool, call: ToolCall) -> None:
    """A limited call got its receipt: its slot is free, so whoever's turn it is is woken
    now rather than by the next sweep. Nothing at all for a tool without a limit."""
    limits = flow.limit_for(tool)
    if limits is not None:
        flow.wake(tool.name, limits.key_of(call.arguments))


def record_receipt(
    cp,
    lease: Lease,
    call: ToolCall,
    *,
    ok: bool,
    result: Any,
    external_ref: str,
    source: str,
    notes: tuple[str, ...] = (),
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
        notes=notes,
    )


def complete_step(
    cp,
    lease: Lease,
    step: Step,
    call: ToolCall,
    ok: bool,
    output: Any,
    error: str,
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
    )


def _fail_step_in(cp, lease: Lease, step: Step, error: str) -> None:
    transitions.fail_step(cp, run=lease.run, agent=lease.agent, step=step, error=error)


def fail_step(lease: Lease, step: Step, error: str) -> None:
    with lease.checkpoint() as cp:
        _fail_step_in(cp, lease, step, error)


# --- unknown outcomes (DESIGN §5.3) -----------------------------------------------------------


def mark_unknown(lease: Lease, call: ToolCall, error: str) -> None:
    with lease.checkpoint() as cp:
        transitions.call_unknown(cp, call, error)


def unknown_needs_person(tool: Tool) -> bool:
    """The one rule for who settles an unknown outcome, hosted or remote: a person when
    nobody can find out or safely repeat it — an ``unsafe`` tool (never repeated
    automatically, whatever it declares), or one with no lookup by key whose downstream
    does not deduplicate by it (docs/agents.md, "Effect classes")."""
    if tool.effect == Effect.READ:
        return False
    return tool.effect == Effect.UNSAFE or (tool.reconcile is None and not tool.honours_key)


def park_unknown_outcome(lease: Lease, call: ToolCall) -> str:
    """Hand an unknown outcome to a person (``unknown_needs_person``): the run waits in
    ``needs_attention`` until an operator resolves the call."""
    park_needs_attention(
        lease,
        Run.Reason.UNKNOWN_OUTCOME,
        f"{call.tool_name} ({call.effect}) may or may not have acted: {call.last_error}",
    )
    return Outcome.PARKED


def absent_proves_never_landed(
    tool: Tool | None, started: datetime | None, landing: datetime | None
) -> bool:
    """The one rule for an ``absent`` lookup, hosted or remote: it allows sending the same
    key again only when the downstream deduplicates by key (the same key again is the
    lookup), or the lookup began once the original request could no longer land — one that
    straddles that deadline may have looked before the request arrived (DESIGN §9)."""
    if tool is not None and tool.honours_key:
        return True
    return started is not None and landing is not None and started >= landing


def resend_needs_person(tool: Tool | None, *, authorized: bool) -> bool:
    """An absent call of a ``resend: person`` tool is sent again only when a person says so
    (``authorized``: an operator chose "dispatch again")."""
    return tool is not None and tool.resend == Resend.PERSON and not authorized


def park_resend_for_person(lease: Lease, call: ToolCall) -> str:
    park_needs_attention(
        lease,
        Run.Reason.UNKNOWN_OUTCOME,
        f"{call.tool_name}: the lookup found nothing under key {call.idempotency_key}; "
        "the tool sends again only when a person says so (resend: person)",
    )
    return Outcome.PARKED


def _reconcile(
    lease: Lease,
    step: Step,
    call: ToolCall,
    tool: Tool,
    *,
    interrupted: bool = False,
    authorized: bool = False,
) -> str:
    """Decide an unknown outcome without ever repeating a side effect that may have happened.
    ``interrupted``: the call was left in dispatching by a process that died. ``authorized``:
    an operator chose "dispatch again" — their call replaces ``resend: person`` and an unsafe
    tool's hand-off, never the rule that a re-send waits for a lookup that started after the
    original request could no longer land (DESIGN §9)."""
    if tool.effect == Effect.READ:
        # No side effect: simply call it again. Only outcomes seen to be unknown count toward
        # READ_MAX_ATTEMPTS: an attempt cut short by a crash says nothing about the tool (a
        # crash loop ends at MAX_RECOVERIES). The count is written with the re-dispatch, so
        # a crash between the two cannot count one failure twice.
        failures = call.reconcile_attempts + (0 if interrupted else 1)
        if failures >= _conf("READ_MAX_ATTEMPTS") and not authorized:
            fail_step(lease, step, f"read tool failed {failures} times: {call.last_error}")
            return Outcome.CONTINUE
        call.reconcile_attempts = failures
        return dispatch(lease, step, call, tool)
    if unknown_needs_person(tool):
        if not authorized:
            return park_unknown_outcome(lease, call)
        # nothing to look up: the person decided; the original may still not land first
        landing_until = can_land_until(lease, call, tool)
        if db_now() < landing_until:
            release(lease, wake_at=landing_until)
            return Outcome.PARKED
        return dispatch(lease, step, call, tool)
    if tool.reconcile is None:
        # the external system deduplicates by key: the same key again is the lookup
        return dispatch(lease, step, call, tool)

    if call.next_reconcile_at is not None and call.next_reconcile_at > lease.now():
        release(lease, wake_at=call.next_reconcile_at)
        return Outcome.PARKED
    # when the lookup STARTED, in database time: only a lookup that began after the original
    # request could no longer land proves that it never will (one that straddles the
    # deadline may have looked before the request landed)
    lookup_started = db_now()
    try:
        found = tool.reconcile(call.idempotency_key, call.arguments)
        outcome, detail = found.outcome, found.detail
    except Exception as exc:
        # a lookup that fails is NOT absence
        found, outcome, detail = None, LookupResult.UNKNOWN, _describe(exc)

    attempt = call.reconcile_attempts + 1
    if outcome == LookupResult.FOUND:
        assert found is not None  # a lookup that raised answered UNKNOWN
        _make_storable(lease, call, found)
        with lease.checkpoint() as cp:
            ToolCall.objects.filter(id=call.id).update(
                reconcile_attempts=attempt,
                next_reconcile_at=None,
                lookup_started_at=lookup_started,
                lookups_begun=F("lookups_begun") + 1,
            )
            cp.event(
                EventType.TOOL_RECONCILE_ATTEMPTED,
                seq=step.seq,
                attempt=attempt,
                outcome="found",
                detail=detail,
                started_at=lookup_started.isoformat(),
            )
            record_receipt(
                cp,
                lease,
                call,
                ok=True,
                result=found.result,
                external_ref=found.external_ref,
                source=ToolReceipt.Source.RECONCILIATION,
                notes=_storage_notes(found),
            )
            complete_step(cp, lease, step, call, True, found.result, "")
        return Outcome.CONTINUE

    if outcome == LookupResult.ABSENT:
        # Reliably absent — as of when the lookup started. A re-send waits until a lookup
        # that started after the landing deadline says so.
        landing_until = can_land_until(lease, call, tool)
        too_early = not absent_proves_never_landed(tool, lookup_started, landing_until)
        to_person = not too_early and resend_needs_person(tool, authorized=authorized)
        with lease.checkpoint() as cp:
            ToolCall.objects.filter(id=call.id).update(
                reconcile_attempts=attempt,
                next_reconcile_at=landing_until if too_early else None,
                lookup_started_at=lookup_started,
                lookups_begun=F("lookups_begun") + 1,
            )
            cp.event(
                EventType.TOOL_RECONCILE_ATTEMPTED,
                seq=step.seq,
                attempt=attempt,
                outcome="absent",
                detail=detail,
                started_at=lookup_started.isoformat(),
                redispatch_after=landing_until.isoformat() if too_early else None,
            )
            if too_early:
                # look again once it can no longer land
                run_release(cp, wake_at=landing_until)
        if too_early:
            return Outcome.PARKED
        if to_person:
            return park_resend_for_person(lease, call)
        call.reconcile_attempts = attempt
        return dispatch(lease, step, call, tool)

    # the lookup could not decide: retry with backoff, then a person
    if attempt >= _conf("RECONCILE_MAX_ATTEMPTS"):
        with lease.checkpoint() as cp:
            ToolCall.objects.filter(id=call.id).update(
                reconcile_attempts=attempt, next_reconcile_at=None
            )
            cp.event(
                EventType.TOOL_RECONCILE_ATTEMPTED,
                seq=step.seq,
                attempt=attempt,
                outcome="unknown",
                detail=detail,
            )
        park_needs_attention(
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
            EventType.TOOL_RECONCILE_ATTEMPTED,
            seq=step.seq,
            attempt=attempt,
            outcome="unknown",
            detail=detail,
            retry_in_seconds=backoff,
        )
        run_release(cp, wake_at=next_at)
    return Outcome.PARKED


def can_land_until(lease: Lease, call: ToolCall, tool: Tool) -> datetime:
    """Until when a request sent at the call's last dispatch may still reach the system:
    its landing deadline, computed in database time by the dispatch (DESIGN §9). A call
    dispatched before deadlines were recorded: its dispatch time + the longest send window
    + the tool's timeout + the margin."""
    if call.landing_deadline is None and call.pk is not None:
        call.landing_deadline = (
            ToolCall.objects.filter(id=call.id).values_list("landing_deadline", flat=True).first()
        )
    if call.landing_deadline is not None:
        return call.landing_deadline
    if call.dispatched_at is None and call.pk is not None:
        call.dispatched_at = (
            ToolCall.objects.filter(id=call.id).values_list("dispatched_at", flat=True).first()
        )
    return (call.dispatched_at or lease.now()) + timedelta(seconds=_deadline_offsets(tool)[1])

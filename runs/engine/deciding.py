"""Acting on the agent's decision: the ``decided`` checkpoint for a finish, a tool call
(refused, sent for approval, dispatched, or a fork's family call) or a durable wait."""

from __future__ import annotations

from typing import Any

from django.db.models import F

from runs import flow, spend, waitrules
from runs.engine.lease import (
    Lease,
    Outcome,
    _conf,
    _describe,
    finish,
    principal_refusal,
)
from runs.engine.toolcalls import (
    _call_tool,
    _execute,
    _mark_dispatching,
    _reconcile,
    _storage_notes,
    complete_step,
    denial_text,
    dispatch,
    mark_unknown,
    record_receipt,
)
from runs.gate import Verdict, assess, gate_installed, policy_facts
from runs.models import Run, Step, ToolCall, ToolReceipt
from runs.record import transitions
from runs.record.checkpoint import Checkpoint
from runs.record.eventtypes import EventType
from runs.record.runs import call_await_approval, run_pause
from runs.registry import (
    AGENT_FAIL_CODES,
    AskQuestion,
    CallTool,
    Effect,
    Fail,
    Finish,
    Limits,
    Sleep,
    Tool,
    UnknownTool,
    WaitForSignal,
    digest,
    registry,
)


def _decide(lease: Lease, action: Any) -> str:
    seq = (lease.steps[-1].seq + 1) if lease.steps else 1
    if isinstance(action, Finish):
        finish(lease, Run.Status.SUCCEEDED, result=action.result, seq=seq)
        return Outcome.PARKED
    if isinstance(action, Fail):
        code, detail = action.code, action.reason
        if code not in AGENT_FAIL_CODES:
            code, detail = Run.Reason.AGENT_FAILED, f"{detail} (unknown reason code {code!r})"
        finish(lease, Run.Status.FAILED, reason=code, detail=detail, seq=seq)
        return Outcome.PARKED
    if isinstance(action, CallTool):
        return decide_call(lease, action, seq)
    if isinstance(action, WaitForSignal | Sleep | AskQuestion):
        return decide_wait(lease, action, seq)
    finish(
        lease,
        Run.Status.FAILED,
        reason=Run.Reason.AGENT_FAILED,
        detail=f"decide() returned {type(action).__name__}, not an action",
    )
    return Outcome.PARKED


def _rejected_call(
    lease: Lease,
    action: CallTool,
    seq: int,
    error: str,
    *,
    arguments: Any = "(not recorded: invalid call)",
    **event: Any,
) -> str:
    """A call the engine refuses before anything happens (unknown tool, bad arguments, a
    policy's ``deny``): recorded as a failed step the agent sees, never dispatched."""
    with lease.checkpoint() as cp:
        step = transitions.step_refused(
            cp,
            run_id=lease.run.id,
            seq=seq,
            kind=Step.Kind.TOOL_CALL,
            incarnation=lease.fence,
            input={"tool": action.tool, "arguments": arguments},
            error=error,
            tool=action.tool,
            **event,
        )
    lease.run.steps_used += 1
    lease.steps.append(step)
    return Outcome.CONTINUE


def decide_call(lease: Lease, action: CallTool, seq: int, *, execute: bool = True) -> str:
    """``execute=False`` (remote agents): the call is recorded and left ``proposed`` for the
    agent process to dispatch (``runs.remote``) instead of being called here."""
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
    try:
        fingerprint = tool.precondition(arguments) if tool.precondition else ""
    except Exception as exc:
        # nothing is dispatched or approved yet: the agent sees a refused call (the resource
        # it names may be gone) rather than the run crashing in every incarnation
        return _rejected_call(lease, action, seq, f"precondition raised: {_describe(exc)}")
    masked = tool.mask(arguments)
    facts = policy_facts(run)
    verdict = assess(run=run, tool=tool, arguments=arguments, facts=facts)
    if verdict.denied:
        return _denied_call(lease, action, seq, masked, verdict)
    needs_approval = verdict.needs_approval
    if needs_approval and not gate_installed():
        return _rejected_call(
            lease, action, seq, "the call needs approval and no gate is installed"
        )
    revoked = principal_refusal(lease, tool)
    root_id = run.root_run_id or run.id
    idempotency_key = f"{root_id}:{seq}"
    sibling = None
    if root_id != run.id:
        # A fork: its family may already have used this key (DESIGN §5.2, docs/recovery.md).
        sibling = family_call(run, idempotency_key)
        if sibling is not None and (
            sibling.tool_name != tool.name or sibling.arguments_digest != digest(arguments)
        ):
            # a different call at the same seq: sharing the key would make an idempotent
            # system answer with the other call's result, so this branch starts its own key
            idempotency_key, sibling = f"{run.id}:{seq}", None
    if sibling is not None and not revoked:
        return _decide_family_call(
            lease,
            seq,
            tool,
            arguments,
            masked,
            fingerprint,
            sibling,
            execute=execute,
            client_call_id=action.client_call_id,
            facts=facts,
            needs_approval=needs_approval,
        )

    step = Step(
        run_id=run.id,
        seq=seq,
        kind=Step.Kind.TOOL_CALL,
        input={"tool": tool.name, "arguments": masked},
        incarnation=lease.fence,
    )
    call = ToolCall(
        run_id=run.id,
        tool_name=tool.name,
        tool_version=tool.version,
        effect=str(tool.effect),
        arguments=arguments,
        arguments_masked=masked,
        arguments_digest=digest(arguments),
        idempotency_key=idempotency_key,
        client_call_id=action.client_call_id,
        precondition_fingerprint=fingerprint,
        policy_input=facts,
    )
    # a call of a run a spend cap covers is decided first, then dispatched under its caps
    # (``dispatch``): one more commit, for those only. A limited tool's call is decided and
    # dispatched under its limit in one commit, or decided and left waiting for capacity
    limits = flow.limit_for(tool)
    capped = spend.applies(run)
    limited = limits is not None or capped
    if execute and limits is not None and not capped and not revoked and not needs_approval:
        return _decided_under_limit(lease, step, call, tool, limits)
    if (
        execute
        and not limited
        and not revoked
        and not needs_approval
        and tool.effect == Effect.READ
        and lease.decision_usage is None
        and tool.timeout <= _conf("LEASE_TTL") / 2
    ):
        return _read_in_one_commit(lease, step, call, tool)

    # a call dispatched now: its step and row go with the events in the commit's one
    # statement
    with lease.checkpoint() as cp:
        _record_decided(cp, lease, step, call)
        cp.insert(call)
        if revoked:
            # the decision is kept (the agent is not asked again); it is dispatched, or sent
            # for approval, when the run is resumed with a principal allowed to use the tool
            run_pause(cp, by="system", code=Run.Reason.PRINCIPAL_REVOKED, detail=revoked)
        elif needs_approval:
            # decided + approval_requested share this commit: no external call between them
            call_await_approval(cp, run=run, call=call, tool=tool, seq=seq)
        else:
            # decided + dispatching share this commit: both come before the side effect
            if execute and not limited:
                _mark_dispatching(cp, call, lease, tool)
    run.steps_used += 1
    lease.steps.append(step)
    if revoked or needs_approval:
        return Outcome.PARKED
    if not execute:
        return Outcome.CONTINUE
    if limited:
        return dispatch(lease, step, call, tool)
    return _execute(lease, step, call, tool)


def _denied_call(
    lease: Lease, action: CallTool, seq: int, masked: dict[str, Any], verdict: Verdict
) -> str:
    """The approval policy denies the call: a failed step with the policy's reason (the
    agent sees it and decides again), nothing asked of anyone, nothing dispatched."""
    return _rejected_call(
        lease,
        action,
        seq,
        denial_text(verdict),
        arguments=masked,
        policy_version=verdict.policy_version,
    )


def _decided_under_limit(
    lease: Lease, step: Step, call: ToolCall, tool: Tool, limits: Limits
) -> str:
    """A limited tool's new call (no approval asked, no spend cap): ``decided`` and, in the
    same commit, either ``dispatching`` under the limit (``flow.acquire`` takes the slot in
    this transaction, as an unlimited call's decision and dispatch share one) or the wait
    for capacity — the decision is kept either way, and the agent is not asked again."""
    run = lease.run
    with lease.checkpoint() as cp:
        # the decision's events first; its rows after the limit's look, so that they go
        # with the commit's one statement rather than before that look
        _record_decided(cp, lease, step, call, insert=False)
        full = None
        try:
            flow.acquire(cp, run=run, call=call, tool_name=tool.name, limits=limits)
        except flow.AtCapacity as over:
            full = over  # nothing was granted: the decision waits, in this commit
        cp.insert(step)
        cp.insert(call)
        if full is None:
            _mark_dispatching(cp, call, lease, tool)
        else:
            flow.wait_commit(cp, run=run, call=call, seq=step.seq, full=full)
    run.steps_used += 1
    lease.steps.append(step)
    if full is not None:
        return Outcome.PARKED
    return _execute(lease, step, call, tool)


def _record_decided(
    cp: Checkpoint, lease: Lease, step: Step, call: ToolCall, *, insert: bool = True
) -> None:
    """``decided`` for a tool call: its step (``insert``: else the caller inserts it) and
    the call's events. The call itself is inserted by the caller (after its step)."""
    if insert:
        cp.insert(step)
    call.step = step
    cp.event(
        EventType.STEP_DECIDED,
        seq=step.seq,
        kind=step.kind,
        tool=call.tool_name,
        tool_version=call.tool_version,
        arguments=call.arguments_masked,
        idempotency_key=call.idempotency_key,
    )
    cp.update(steps_used=F("steps_used") + 1)
    cp.boundary("decided")


def _read_in_one_commit(lease: Lease, step: Step, call: ToolCall, tool: Tool) -> str:
    """A ``read`` call whose decision cost nothing (no model tokens): called first, then
    ``decided`` + ``dispatching`` + ``receipt_recorded`` + ``step_completed`` in ONE commit.

    A read has no side effect, so nothing happens outside between the decision and the
    outcome that a record of the decision alone would protect: a crash before the commit
    loses a free decision and a read, and the next incarnation simply makes both again
    (docs/recovery.md). This is the guarantee of a DBOS step, at one commit per step. A
    decision that cost tokens is recorded before the call (the two-commit path), so that
    it is never paid for twice; so is a slow read (one that may outlast half a lease)."""
    dispatched_at = lease.now()
    ok, result, error = _call_tool(lease, call, tool, attempt=1)
    if ok is None:
        # the read raised something unexpected: record the decision and the dispatch as the
        # two-commit path would have, then handle the unknown outcome the ordinary way
        with lease.checkpoint() as cp:
            _record_decided(cp, lease, step, call)
            _mark_dispatching(cp, call, lease, tool)
            cp.insert(call)
        lease.run.steps_used += 1
        lease.steps.append(step)
        mark_unknown(lease, call, error)
        return _reconcile(lease, step, call, tool)
    output = result.result if result else None
    with lease.checkpoint() as cp:
        transitions.step_outcome(step, ok=ok, output=output, error=error)
        # step, call and receipt: inserted with the events and the run's update (one
        # statement on PostgreSQL)
        _record_decided(cp, lease, step, call)
        _mark_dispatching(cp, call, lease, tool)
        call.dispatched_at = dispatched_at
        cp.insert(call)  # with the status the receipt gives it
        record_receipt(
            cp,
            lease,
            call,
            ok=ok,
            result=output if ok else {"error": error},
            external_ref=result.external_ref if result else "",
            source=ToolReceipt.Source.TOOL,
            notes=_storage_notes(result),
        )
        transitions.apply_to_state(cp, run=lease.run, agent=lease.agent, step=step)
    lease.run.steps_used += 1
    lease.steps.append(step)
    return Outcome.CONTINUE


def decide_wait(lease: Lease, action: WaitForSignal | Sleep | AskQuestion, seq: int) -> str:
    """``decided`` + ``run.waiting`` in one commit: the wait step, its question, and the run
    parked in ``waiting_event`` with no lease. A signal that arrived before the wait began
    (or a timer already due) ends it in this same commit: services lock the same run row,
    so a signal is either seen here or finds the run waiting and wakes it."""
    error = waitrules.validate(action)
    if error:
        with lease.checkpoint() as cp:
            step = transitions.step_refused(
                cp,
                run_id=lease.run.id,
                seq=seq,
                kind=Step.Kind.WAIT,
                incarnation=lease.fence,
                input={"wait": type(action).__name__, "refused": True},
                error=error,
            )
        lease.run.steps_used += 1
        lease.steps.append(step)
        return Outcome.CONTINUE
    spec, _wake_at = waitrules.spec(action, lease.now())
    with lease.checkpoint() as cp:
        step = Step.objects.create(
            run_id=lease.run.id, seq=seq, kind=Step.Kind.WAIT, input=spec, incarnation=lease.fence
        )
        cp.event(EventType.STEP_DECIDED, seq=seq, kind=step.kind, wait=spec)
        cp.update(steps_used=F("steps_used") + 1)
        cp.boundary("decided")
        if isinstance(action, AskQuestion):
            waitrules.question_create(cp, step=step)
        ended = waitrules.end_wait_if_due(
            cp, run=lease.run, agent=lease.agent, step=step, now=lease.now()
        )
        if not ended:
            waitrules.park(cp, step=step)
    lease.run.steps_used += 1
    lease.steps.append(step)
    return Outcome.CONTINUE if ended else Outcome.PARKED


def continue_wait(lease: Lease, step: Step) -> str:
    """An open wait found at claim: woken by a signal or an answer, by its timer or timeout,
    or by a recovery. What ends it is read from the record; if nothing does yet, the run
    parks again (a duplicate wake-up costs one commit, never a lost wait)."""
    with lease.checkpoint() as cp:
        ended = waitrules.end_wait_if_due(
            cp, run=lease.run, agent=lease.agent, step=step, now=lease.now()
        )
        if not ended:
            waitrules.park(cp, step=step, again=True)
    return Outcome.CONTINUE if ended else Outcome.PARKED


def family_call(run: Run, idempotency_key: str) -> ToolCall | None:
    """The call another run of this fork's family made under this key: the one with a
    receipt first, then one that was dispatched."""
    calls = list(
        ToolCall.objects.filter(idempotency_key=idempotency_key)
        .exclude(run_id=run.id)
        .select_related("receipt")
    )
    calls.sort(key=lambda c: (not hasattr(c, "receipt"), c.attempt_count == 0))
    return calls[0] if calls else None


def _decide_family_call(
    lease: Lease,
    seq: int,
    tool: Tool,
    arguments: dict[str, Any],
    masked: dict[str, Any],
    fingerprint: str,
    sibling: ToolCall,
    *,
    execute: bool = True,
    client_call_id: str = "",
    facts: dict[str, Any],
    needs_approval: bool,
) -> str:
    """A fork decided the very call its family already made under this key. Its effect is
    never repeated blindly: a succeeded receipt is adopted; a dispatch without a receipt is
    an unknown outcome, reconciled by key like any other; a call never dispatched is simply
    made (with the same key)."""
    run = lease.run
    receipt = getattr(sibling, "receipt", None)
    adopt = receipt is not None and receipt.outcome == ToolReceipt.Outcome.SUCCEEDED
    in_doubt = not adopt and receipt is None and sibling.attempt_count > 0
    limited = flow.limit_for(tool) is not None or spend.applies(run)
    with lease.checkpoint() as cp:
        step = Step(
            run_id=run.id,
            seq=seq,
            kind=Step.Kind.TOOL_CALL,
            input={"tool": tool.name, "arguments": masked},
            incarnation=lease.fence,
        )
        cp.insert(step)
        call = ToolCall(
            step=step,
            run_id=run.id,
            tool_name=tool.name,
            tool_version=tool.version,
            effect=str(tool.effect),
            arguments=arguments,
            arguments_masked=masked,
            arguments_digest=digest(arguments),
            idempotency_key=sibling.idempotency_key,
            client_call_id=client_call_id,
            precondition_fingerprint=fingerprint,
            policy_input=facts,
        )
        cp.event(
            EventType.STEP_DECIDED,
            seq=seq,
            kind=step.kind,
            tool=tool.name,
            tool_version=tool.version,
            arguments=masked,
            idempotency_key=call.idempotency_key,
            family_call={"run": sibling.run_id, "status": sibling.status},
        )
        cp.update(steps_used=F("steps_used") + 1)
        cp.boundary("decided")
        cp.insert(call)
        if adopt:
            assert receipt is not None  # adopt says so
            transitions.record_receipt(
                cp,
                call,
                ok=True,
                result=receipt.result,
                external_ref=receipt.external_ref,
                source=ToolReceipt.Source.RECONCILIATION,
                recorded_by=lease.actor,
                incarnation=lease.fence,
            )
            complete_step(cp, lease, step, call, True, receipt.result, "")
        elif in_doubt:
            transitions.call_in_doubt(cp, call, sibling=sibling, seq=seq)
        elif needs_approval:
            call_await_approval(cp, run=run, call=call, tool=tool, seq=seq)
        elif execute and not limited:
            _mark_dispatching(cp, call, lease, tool)
    run.steps_used += 1
    lease.steps.append(step)
    if adopt:
        return Outcome.CONTINUE
    if not execute:
        # remote agents reconcile an in-doubt family call themselves (it is ``unknown``)
        return Outcome.PARKED if needs_approval and not in_doubt else Outcome.CONTINUE
    if in_doubt:
        return _reconcile(lease, step, call, tool)
    if needs_approval:
        return Outcome.PARKED
    if limited:
        return dispatch(lease, step, call, tool)
    return _execute(lease, step, call, tool)

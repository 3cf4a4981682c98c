"""An open step found at claim (DESIGN §5): the record says what happens next — a wait
ends or parks again, a call is dispatched, waits for its approval, is reconciled, or is
re-bound to a tool that changed since it was decided."""

from __future__ import annotations

from runs.engine import serving
from runs.engine.deciding import continue_wait
from runs.engine.lease import Lease, Outcome, park_needs_attention, release
from runs.engine.toolcalls import (
    _fail_step_in,
    _precondition,
    _reconcile,
    complete_step,
    denial_text,
    dispatch,
    fail_step,
    mark_unknown,
)
from runs.gate import assess, get_gate, recorded_facts
from runs.models import Run, RunEvent, Step, ToolCall, ToolReceipt
from runs.record import transitions
from runs.record.eventtypes import EventType
from runs.record.runs import run_await_approval
from runs.registry import Tool, UnknownTool, registry


def _continue_step(lease: Lease, step: Step) -> str:
    if step.kind == Step.Kind.WAIT:
        return continue_wait(lease, step)
    if step.kind != Step.Kind.TOOL_CALL:
        fail_step(lease, step, f"cannot continue a {step.kind} step")
        return Outcome.CONTINUE
    call = ToolCall.objects.select_related("step").get(step=step)
    done, tool = open_call(lease, step, call)
    if done is not None:
        return done
    assert tool is not None  # open_call answers the tool of every call it leaves open
    status = call.status
    if status in (ToolCall.Status.PROPOSED, ToolCall.Status.APPROVED):
        return dispatch(lease, step, call, tool)
    if status == ToolCall.Status.AWAITING_APPROVAL:
        release(lease, status=Run.Status.WAITING_APPROVAL)
        return Outcome.PARKED
    if status == ToolCall.Status.DISPATCHING:
        # Left in flight by an earlier incarnation: nobody knows whether it took effect.
        mark_unknown(lease, call, f"left in dispatching by incarnation {call.dispatch_incarnation}")
        return _reconcile(lease, step, call, tool, interrupted=True)
    if status == ToolCall.Status.UNKNOWN and call.redispatch_authorized:
        # An operator chose "dispatch again" (toolcall_resolve): their call replaces the
        # hand-off to a person, but a tool with a lookup is still looked up first (a lookup
        # that started after the original request could no longer land), and any other
        # waits out its landing deadline (DESIGN §9)
        return _reconcile(lease, step, call, tool, authorized=True)
    return _reconcile(lease, step, call, tool)


def open_call(lease: Lease, step: Step, call: ToolCall) -> tuple[str | None, Tool | None]:
    """What the hosted loop and the remote protocol do first with a call found open at
    claim: settled is settled (``settle_from_record``); a call whose tool changed or was
    retired follows ``tool_changed``. Returns the outcome when that handled it, else None
    (and the tool as deployed here) for the caller to go on with the call's status."""
    if settle_from_record(lease, step, call):
        return Outcome.CONTINUE, None
    try:
        tool = registry.tool(call.tool_name)
    except UnknownTool:
        tool = None
    if not tool_accepts(lease, step, call, tool):
        return tool_changed(lease, step, call, tool), tool
    return None, tool


def settle_from_record(lease: Lease, step: Step, call: ToolCall) -> bool:
    """Settled is settled: a call with a receipt (from the tool, a reconciliation or an
    operator), a rejection or a cancellation ends its step from the record, whatever was
    deployed since — the tool is not looked at, so a changed or retired tool can neither
    fail a call that happened (the agent would decide it again: a side effect twice) nor
    turn an approver's rejection into ``tool_retired``. False for a call still to settle.
    The hosted loop and the remote protocol's resume checklist both start here."""
    if call.status == ToolCall.Status.REJECTED:
        comment = call.last_error  # the approver's comment (toolcall_gate_settled)
        fail_step(lease, step, f"approval rejected: {comment}" if comment else "approval rejected")
        return True
    if call.status == ToolCall.Status.CANCELLED:
        fail_step(lease, step, "tool call cancelled")
        return True
    if call.status not in (ToolCall.Status.SUCCEEDED, ToolCall.Status.FAILED):
        return False
    # a receipt recorded while its step could not be completed (an operator's answer on a
    # run whose agent changed version, a crash between the two): the step completes from it
    receipt = ToolReceipt.objects.filter(tool_call=call).first()
    ok = receipt is not None and receipt.outcome == ToolReceipt.Outcome.SUCCEEDED
    error = ""
    if not ok:
        result = receipt.result if receipt is not None else None
        error = str(result.get("error", "")) if isinstance(result, dict) else ""
        error = error or call.last_error or "the tool call failed"
    with lease.checkpoint() as cp:
        complete_step(cp, lease, step, call, ok, receipt.result if receipt and ok else None, error)
    return True


def tool_accepts(lease: Lease, step: Step, call: ToolCall, tool: Tool | None) -> bool:
    """Whether the registered tool is the one the call was decided for: the same fingerprint,
    or one the tool declares compatible on purpose (``compatible_with``). An accepted
    change is recorded once per call and fingerprint (``tool.version_accepted``); the call
    keeps the fingerprint it was decided and approved under."""
    if tool is None or not tool.accepts(call.tool_version):
        return False
    if tool.version != call.tool_version:
        recorded = RunEvent.objects.filter(
            run_id=lease.run.id,
            type=EventType.TOOL_VERSION_ACCEPTED,
            payload__seq=step.seq,
            payload__to_version=tool.version,
        ).exists()
        if not recorded:
            with lease.checkpoint() as cp:
                cp.event(
                    EventType.TOOL_VERSION_ACCEPTED,
                    seq=step.seq,
                    tool=call.tool_name,
                    from_version=call.tool_version,
                    to_version=tool.version,
                    declared_version=tool.declared_version,
                    status=call.status,
                )
    return True


def tool_changed(lease: Lease, step: Step, call: ToolCall, tool: Tool | None) -> str:
    """The call's tool is gone or changed since it was decided (DESIGN §5.2), and the call
    has not settled (``settle_from_record`` comes first). A call never dispatched is bound
    to the new fingerprint, its approval cancelled and asked again; one whose arguments the
    new tool refuses, or whose tool is gone, is cancelled and its step fails with
    ``tool_retired``; one in flight keeps its unknown outcome for a person."""
    detail = (
        f"tool {call.tool_name!r} is no longer registered"
        if tool is None
        else f"tool {call.tool_name!r} changed from version {call.tool_version} to {tool.version}"
    )
    if serving.hand_off(lease, detail, tool=(call.tool_name, call.tool_version)):
        return Outcome.PARKED  # a worker of the release that decided the call serves it
    if call.status in (ToolCall.Status.DISPATCHING, ToolCall.Status.UNKNOWN):
        if call.status == ToolCall.Status.DISPATCHING:
            mark_unknown(lease, call, "left in dispatching; " + detail)
        park_needs_attention(lease, Run.Reason.TOOL_RETIRED, detail + "; its outcome is unknown")
        return Outcome.PARKED
    if settle_from_record(lease, step, call):
        return Outcome.CONTINUE  # settled: never failed by a compatibility check
    undispatched = (
        ToolCall.Status.PROPOSED,
        ToolCall.Status.AWAITING_APPROVAL,
        ToolCall.Status.APPROVED,
    )
    if tool is not None and call.status in undispatched and call.attempt_count == 0:
        errors = tool.validate(call.arguments)
        if not errors:
            return _rebind_to_tool_version(lease, step, call, tool)
        detail += "; the call's arguments do not match it: " + "; ".join(errors)
    with lease.checkpoint() as cp:
        get_gate().cancel(cp=cp, call=call, reason="tool_retired")
        transitions.call_cancel(cp, call, reason="tool_retired", detail=detail)
        _fail_step_in(cp, lease, step, f"tool_retired: {detail}")
    return Outcome.CONTINUE


def _rebind_to_tool_version(lease: Lease, step: Step, call: ToolCall, tool: Tool) -> str:
    """A call not yet dispatched whose tool changed version: an approval given for the old
    version is not valid for the new one (the approver approved another tool), so it is
    cancelled and, if the new version's policy asks for one, requested again."""
    fingerprint = _precondition(lease, tool, call)
    if fingerprint is None:
        return Outcome.PARKED
    verdict = assess(
        run=lease.run, tool=tool, arguments=call.arguments, facts=recorded_facts(lease.run, call)
    )
    needs_approval = verdict.needs_approval
    previous = call.tool_version
    with lease.checkpoint() as cp:
        get_gate().cancel(cp=cp, call=call, reason="tool_version_changed")
        if verdict.denied:
            transitions.call_cancel(cp, call, reason="policy_denied", detail=verdict.reason)
            _fail_step_in(cp, lease, step, denial_text(verdict))
            return Outcome.CONTINUE
        transitions.call_rebind(call, tool, fingerprint=fingerprint, needs_approval=needs_approval)
        cp.event(
            EventType.TOOL_VERSION_CHANGED,
            seq=step.seq,
            tool=call.tool_name,
            from_version=previous,
            to_version=tool.version,
            approval_required=needs_approval,
        )
        if needs_approval:
            get_gate().request(cp=cp, run=lease.run, call=call, tool=tool)
            run_await_approval(cp, seq=step.seq, tool=tool.name)
    return Outcome.PARKED if needs_approval else Outcome.CONTINUE

"""Reads of the MCP gateway: what became of a recorded call (docs/mcp.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentops.mcp import remote
from agentops.mcp.gateway import AGENT_NAME
from agentops.mcp.models import GatewayCall
from runs.models import Run, Step, ToolCall

# what a held tools/call answers with (``Outcome.status``)
SUCCEEDED = "succeeded"
FAILED = "failed"
AWAITING_APPROVAL = "awaiting_approval"
PENDING = "pending"
FINAL = (SUCCEEDED, FAILED)


@dataclass
class Outcome:
    status: str
    result: Any = None
    error: str = ""
    handle: dict[str, Any] = field(default_factory=dict)
    # the engine's call this recorded call became, when the record does not say so yet
    # (``services.gateway_call_link``)
    unlinked_tool_call: int | None = None

    @property
    def final(self) -> bool:
        return self.status in FINAL


def gateway_call_outcome(*, call_id: int) -> Outcome:
    call = GatewayCall.objects.select_related("run").get(id=call_id)
    outcome = _outcome(call)
    tool_call_id = outcome.handle.get("tool_call_id")
    if call.tool_call_id is None and tool_call_id is not None:
        outcome.unlinked_tool_call = int(tool_call_id)
    return outcome


def _outcome(call: GatewayCall) -> Outcome:
    handle: dict[str, Any] = {
        "run_id": str(call.run_id),
        "position": call.position,
        "idempotency_key": call.client_key or None,
        "arguments_digest": call.arguments_digest,
    }
    if call.run.dry_run:
        # a dry run's call (docs/mcp.md): a tool that is not read only said what it would do
        handle["dry_run"] = True
    if call.run.agent_name != AGENT_NAME:
        return _remote_outcome(call, handle)
    step = (
        Step.objects.filter(run_id=call.run_id, kind=Step.Kind.TOOL_CALL)
        .order_by("seq")
        .only("id", "seq", "status", "error")[call.position - 1 : call.position]
        .first()
    )
    run = call.run
    if step is None:
        if run.status in Run.TERMINAL:
            return Outcome(
                FAILED,
                error=f"the run ended ({run.status}) before taking the call; "
                "call again to record it in a new run",
                handle=handle,
            )
        handle["run_status"] = run.status
        return Outcome(PENDING, handle=handle)
    handle["step"] = step.seq
    tool_call = ToolCall.objects.filter(step_id=step.id).select_related("receipt").first()
    if tool_call is None:
        # refused before anything happened (the engine's own checks)
        return Outcome(FAILED, error=step.error or "the call was refused", handle=handle)
    return _call_outcome(run, step, tool_call, handle)


def _remote_outcome(call: GatewayCall, handle: dict[str, Any]) -> Outcome:
    """A remote agent's tool: the call its process proposed under the call's client id,
    once it did; until then the call waits for the agent's process (``pending``)."""
    run = call.run
    handle["agent"] = run.agent_name
    tool_call = remote.tool_call_of(call)
    if tool_call is None:
        if run.status in Run.TERMINAL:
            return Outcome(
                FAILED,
                error=f"the run ended ({run.status}) before its agent took the call; "
                "call again to record it in a new run",
                handle=handle,
            )
        handle["run_status"] = run.status
        handle["waiting_for"] = "the agent's process"
        return Outcome(PENDING, handle=handle)
    handle["step"] = tool_call.step.seq
    return _call_outcome(run, tool_call.step, tool_call, handle)


def _call_outcome(run: Run, step: Step, tool_call: ToolCall, handle: dict[str, Any]) -> Outcome:
    handle.update(
        tool_call_id=str(tool_call.id),
        call_key=tool_call.idempotency_key,
        tool_call_status=tool_call.status,
    )
    status = tool_call.status
    receipt = getattr(tool_call, "receipt", None)
    if status == ToolCall.Status.SUCCEEDED:
        return Outcome(
            SUCCEEDED,
            result=receipt.result if receipt is not None else None,
            handle={**handle, "source": receipt.source if receipt is not None else None},
        )
    if status in (ToolCall.Status.FAILED, ToolCall.Status.REJECTED, ToolCall.Status.CANCELLED):
        error = step.error or tool_call.last_error or status
        return Outcome(
            FAILED, result=receipt.result if receipt else None, error=error, handle=handle
        )
    if status == ToolCall.Status.AWAITING_APPROVAL:
        from approvals.models import Approval

        approval = (
            Approval.objects.filter(tool_call=tool_call, status=Approval.Status.PENDING)
            .values("id", "expires_at")
            .first()
        )
        if approval is not None:
            handle["approval_id"] = str(approval["id"])
            handle["approval_expires_at"] = approval["expires_at"].isoformat()
        return Outcome(AWAITING_APPROVAL, handle=handle)
    handle["run_status"] = run.status
    return Outcome(PENDING, handle=handle)

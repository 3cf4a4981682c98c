"""Approval decisions. The web pages, email links, API and admin all call these."""

from __future__ import annotations

from typing import Any

from django.db.models.functions import Now
from django.utils import timezone

from approvals.models import Approval, ApprovalDecision
from runs.actors import Actor, PermissionDenied
from runs.events import checkpoint
from runs.models import ToolCall
from runs.services import InvalidState, toolcall_gate_settled


class AlreadyDecided(Exception):
    code = "already_decided"


class ApprovalExpired(Exception):
    code = "approval_expired"


def approval_decide(
    *,
    approval_id: Any,
    decision: str,
    actor: Actor,
    comment: str = "",
) -> Approval:
    """Record one person's decision. First decision wins; a decision after the approval
    settled, or a second one by the same person, raises ``AlreadyDecided`` and changes
    nothing. Expiry is checked under the lock, whatever the sweeper has done."""
    if decision not in ApprovalDecision.Decision.values:
        raise ValueError(f"decision must be one of {ApprovalDecision.Decision.values}")
    user = actor.user
    if user is None:
        raise PermissionDenied("approvals are decided by people")
    actor.require("approvals.decide_approval")
    run_id = Approval.objects.values_list("run_id", flat=True).get(id=approval_id)
    with checkpoint(run_id, actor=actor.label, channel=actor.channel) as cp:
        approval = Approval.objects.select_for_update().get(id=approval_id)
        if approval.status != Approval.Status.PENDING:
            raise AlreadyDecided(f"this approval is already {approval.status}")
        if not Approval.objects.filter(id=approval.id, expires_at__gt=Now()).exists():
            raise ApprovalExpired("this approval has expired and can no longer be decided")
        if not user.is_superuser and not user.groups.filter(name=approval.approver_group).exists():
            raise PermissionDenied(f"only members of {approval.approver_group} may decide")
        if (
            not approval.allow_self_approval
            and cp.run.principal_id is not None
            and cp.run.principal_id == user.pk
        ):
            raise PermissionDenied("the run's principal may not approve its own action")
        if approval.decisions.filter(decider=user).exists():
            raise AlreadyDecided("you have already decided this approval")
        ApprovalDecision.objects.create(
            approval=approval,
            decider=user,
            channel=actor.channel,
            decision=decision,
            comment=comment,
        )
        approvals = approval.decisions.filter(decision=ApprovalDecision.Decision.APPROVE).count()
        settled = (
            decision == ApprovalDecision.Decision.REJECT or approvals >= approval.required_count
        )
        cp.event(
            "approval.decided",
            approval=approval.id,
            decision=decision,
            by=actor.label,
            comment=comment,
            approvals=approvals,
            required=approval.required_count,
            settled=settled,
        )
        if settled:
            approved = decision == ApprovalDecision.Decision.APPROVE
            approval.status = Approval.Status.APPROVED if approved else Approval.Status.REJECTED
            approval.decided_at = timezone.now()
            approval.reason = comment
            approval.save(update_fields=["status", "decided_at", "reason"])
            call = ToolCall.objects.select_related("step").get(id=approval.tool_call_id)
            try:
                toolcall_gate_settled(cp=cp, call=call, approved=approved, reason=comment)
            except InvalidState as exc:
                raise AlreadyDecided(str(exc)) from None
    return approval


def approvals_expire_due(*, limit: int = 200) -> int:
    """Apply the on-expiry action of every pending approval past ``expires_at`` (the
    sweeper calls this every pass, so expiry during downtime is applied on recovery).
    ``reject``: the agent sees a rejection; ``terminate``: the run ends
    (``approval_expired``); ``escalate``: the approval is cancelled and a new one is
    requested from the policy's escalation group with a new expiry."""
    due = list(
        Approval.objects.filter(status=Approval.Status.PENDING, expires_at__lte=Now())
        .order_by("expires_at")
        .values_list("id", "run_id")[:limit]
    )
    for approval_id, run_id in due:
        _expire_one(approval_id, run_id)
    return len(due)


def _expire_one(approval_id: Any, run_id: Any) -> None:
    from runs.registry import UnknownTool, registry
    from runs.services import apply_terminate

    actor = Actor.system()
    with checkpoint(run_id, actor=actor.label, channel=actor.channel) as cp:
        approval = Approval.objects.select_for_update().get(id=approval_id)
        if approval.status != Approval.Status.PENDING or approval.expires_at > timezone.now():
            return  # decided or extended meanwhile
        approval.status = Approval.Status.EXPIRED
        approval.decided_at = timezone.now()
        approval.reason = f"expired at {approval.expires_at.isoformat()}"
        approval.save(update_fields=["status", "decided_at", "reason"])
        cp.event("approval.expired", approval=approval.id, on_expiry=approval.on_expiry)
        call = ToolCall.objects.select_related("step").get(id=approval.tool_call_id)
        if approval.on_expiry == "terminate":
            apply_terminate(
                cp,
                by=actor.label,
                reason="approval expired",
                reason_code="approval_expired",
            )
            return
        if approval.on_expiry == "escalate":
            try:
                tool = registry.tool(call.tool_name)
            except UnknownTool:
                tool = None
            group = tool.approval.escalate_to if tool is not None else ""
            if tool is not None and group and approval.approver_group != group:
                approval.status = Approval.Status.CANCELLED
                approval.reason = f"escalated to {group}"
                approval.save(update_fields=["status", "reason"])
                escalated = Approval.objects.create(
                    run_id=approval.run_id,
                    tool_call=call,
                    tool_name=approval.tool_name,
                    tool_version=approval.tool_version,
                    arguments_digest=approval.arguments_digest,
                    precondition_fingerprint=approval.precondition_fingerprint,
                    arguments_masked=approval.arguments_masked,
                    approver_group=group,
                    required_count=approval.required_count,
                    allow_self_approval=approval.allow_self_approval,
                    on_expiry="reject",
                    expires_at=timezone.now() + (approval.expires_at - approval.requested_at),
                )
                cp.event(
                    "approval.requested",
                    approval=escalated.id,
                    seq=call.step.seq,
                    tool=call.tool_name,
                    arguments=call.arguments_masked,
                    group=group,
                    escalated_from=approval.id,
                    expires_at=escalated.expires_at.isoformat(),
                )
                return
        if call.status == ToolCall.Status.AWAITING_APPROVAL:
            toolcall_gate_settled(cp=cp, call=call, approved=False, reason="approval_expired")

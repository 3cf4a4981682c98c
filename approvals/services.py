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

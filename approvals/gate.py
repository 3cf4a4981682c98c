"""The approvals app's implementation of ``runs.gate.ApprovalGate``."""

from __future__ import annotations

from datetime import timedelta

from django.db.models.functions import Now

from approvals.models import Approval
from approvals.notify import links_create_and_email
from runs.dbtime import db_now
from runs.gate import GateRefused, GateView
from runs.record.eventtypes import EventType


class ApprovalsGate:
    def approvals_of(self, call_ids) -> dict:
        views: dict = {}
        rows = (
            Approval.objects.filter(tool_call_id__in=list(call_ids))
            .order_by("id")
            .values_list("tool_call_id", "id", "status", "consumed_at")
        )
        for call_id, approval_id, status, consumed_at in rows:
            state = "consumed" if consumed_at is not None else status
            views.setdefault(call_id, []).append(GateView(approval_id, state))
        return views

    def request(self, *, cp, run, call, tool) -> None:
        policy = tool.approval
        approval = Approval.objects.create(
            run_id=call.run_id,
            tool_call=call,
            tool_name=call.tool_name,
            tool_version=call.tool_version,
            arguments_digest=call.arguments_digest,
            precondition_fingerprint=call.precondition_fingerprint,
            arguments_masked=call.arguments_masked,
            approver_group=policy.group,
            required_count=policy.required,
            allow_self_approval=policy.allow_self_approval,
            require_login=policy.links_need_sign_in,
            separate_duties=policy.separate_duties,
            on_expiry=str(policy.on_expiry),
            escalate_to=policy.escalate_to,
            ttl_seconds=policy.ttl_seconds,
            # database time, like every expiry check
            expires_at=db_now() + timedelta(seconds=policy.ttl_seconds),
        )
        cp.event(
            EventType.APPROVAL_REQUESTED,
            approval=approval.id,
            seq=call.step.seq,
            tool=call.tool_name,
            arguments=call.arguments_masked,
            group=policy.group,
            required=policy.required,
            expires_at=approval.expires_at.isoformat(),
        )
        # each eligible approver gets an email with their own link, sent after the commit
        links_create_and_email(approval=approval, principal_id=cp.run.principal_id)

    def consume(self, *, cp, call, tool) -> None:
        # One conditional UPDATE: an approval is consumed exactly once, and only while it is
        # still bound to this exact call (tool, version, arguments) and not expired.
        consumed = Approval.objects.filter(
            tool_call=call,
            # and of this call's own run: an approval (a dry run's too) is never another's
            run_id=call.run_id,
            status=Approval.Status.APPROVED,
            consumed_at__isnull=True,
            tool_name=call.tool_name,
            tool_version=call.tool_version,
            arguments_digest=call.arguments_digest,
            precondition_fingerprint=call.precondition_fingerprint,
        ).update(consumed_at=Now())
        if consumed != 1:
            raise GateRefused("no unconsumed approval bound to this call")
        cp.event(EventType.APPROVAL_CONSUMED, seq=call.step.seq, tool=call.tool_name)

    def cancel(self, *, cp, call, reason) -> None:
        live = Approval.objects.filter(
            tool_call=call,
            status__in=[Approval.Status.PENDING, Approval.Status.APPROVED],
            consumed_at__isnull=True,
        )
        for approval in live:
            approval.status = Approval.Status.CANCELLED
            approval.reason = reason
            approval.save(update_fields=["status", "reason"])
            cp.event(EventType.APPROVAL_CANCELLED, approval=approval.id, reason=reason)

"""Approval emails: who gets one, the single-use links they carry, and how they look.

Links and their emails are made inside the transaction that requests the approval (or
reminds, escalates, rejects, expires it): one ``runs.outbox`` row per recipient, written in
that commit, sent after it by whoever committed or by any worker's sweeper — a process
killed between the commit and the send loses no email (DESIGN §9). Only the token's sha256
is stored with the link; the outbox row holds the seed it is derived from
(``runs.links.link_token``). Each attempt is recorded on the run (``approval.email_sent`` /
``approval.email_failed``); a failed one is retried with backoff.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.mail import EmailMultiAlternatives
from django.template.loader import render_to_string

from approvals import selectors
from approvals.models import Approval, ApprovalDecision, ApprovalLink
from approvals.policies import describe_quorum
from runs import jsonlimits, links, outbox
from runs.masking import masker_for
from runs.models import Run, ToolCall
from runs.registry import call_summary

log = logging.getLogger(__name__)

EMAIL_CHANNEL = "email"

RISK = {
    "read": "read only: no side effect",
    "idempotent": "side effect; the external system deduplicates repeats",
    "reconcilable": "side effect; it can be looked up afterwards, not undone",
    "unsafe": "side effect that can be neither deduplicated nor looked up",
}


def eligible_approvers(approval: Approval, *, principal_id: Any) -> list[Any]:
    """Active members of the approval's groups (its own, and each with a minimum) with an
    email address who may decide it and have not decided yet, and whose approval would
    still count; the run's principal only when the policy allows self-approval."""
    users = (
        get_user_model()
        .objects.filter(is_active=True, groups__name__in=approval.eligible_groups)
        .exclude(email="")
        .exclude(
            pk__in=ApprovalDecision.objects.filter(
                approval=approval, decision__in=ApprovalDecision.DECIDING
            ).values("decider_id")
        )
        .distinct()
        .order_by("pk")
    )
    # who may not decide (the principal, whoever drove the run) gets no link either
    return [
        user
        for user in users
        if user.has_perm("approvals.decide_approval")
        and not selectors.duty_conflict(user=user, approval=approval, principal_id=principal_id)
        and not selectors.quorum_refusal(user=user, approval=approval)
    ]


def links_create_and_email(
    *, approval: Approval, principal_id: Any, kind: str = ApprovalLink.Kind.REQUEST
) -> int:
    """Inside the requesting transaction: one link and one outbox email per eligible
    approver. Returns how many are due to be sent."""
    emails = [
        links.emailed_link(
            kind=REQUEST_KIND,
            recipient=user,
            run_id=approval.run_id,
            payload={"approval": approval.id, "kind": kind},
            create_link=partial(
                ApprovalLink.objects.create, approval=approval, approver=user, kind=kind
            ),
        )
        for user in eligible_approvers(approval, principal_id=principal_id)
    ]
    outbox.emails_enqueue(emails)
    return len(emails)


def principal_notice_enqueue(*, approval: Approval, principal: Any, what: str) -> None:
    """Inside the transaction that rejected or expired the approval: tell the run's
    principal, if they have an email address."""
    if principal is None or not principal.email or not principal.is_active:
        return
    outbox.emails_enqueue(
        [
            outbox.Email(
                kind=NOTICE_KIND,
                to_address=principal.email,
                recipient_id=principal.pk,
                run_id=approval.run_id,
                payload={"approval": approval.id, "what": what},
            )
        ]
    )


# --- when the outbox sends them ------------------------------------------------------------

REQUEST_KIND = "approval.request"
NOTICE_KIND = "approval.notice"


def _context(approval: Approval) -> dict[str, Any]:
    from approvals.gate import quorum_of

    run = Run.objects.select_related("principal").get(id=approval.run_id)
    call = ToolCall.objects.select_related("step").get(id=approval.tool_call_id)
    return {
        "approval": approval,
        "run": run,
        "call": call,
        # an email is shown to nobody in particular: sensitive tool output masked
        "arguments_json": jsonlimits.pretty(masker_for(run)(approval.arguments_masked)),
        # what the call does, in one line (the tool's summary of its masked arguments)
        "summary": call_summary(approval.tool_name, masker_for(run)(approval.arguments_masked)),
        "risk": call.effect,
        "risk_text": RISK.get(call.effect, call.effect),
        "decisions": list(approval.decisions.select_related("decider")),
        # who must approve ("2 approvers from approver or finance, at least 1 from
        # finance") and where it stands ("1 of 2, needs 1 from finance")
        "quorum_text": describe_quorum(
            approval.approver_group, approval.required_count, approval.group_minimums
        ),
        "standing": quorum_of(approval).describe(),
        # a dry run's approval: its subject says so too
        "dry": "[dry run] " if run.dry_run else "",
    }


def _message(
    *, subject: str, template: str, context: dict[str, Any], to: str
) -> EmailMultiAlternatives:
    text = render_to_string(f"approvals/email/{template}.txt", context)
    html = render_to_string(f"approvals/email/{template}.html", context)
    message = EmailMultiAlternatives(
        subject=subject,
        body=text,
        from_email=settings.DEFAULT_FROM_EMAIL,
        to=[to],
        # what the message is about, for mail filters (and the chaos harness's sink)
        headers={"X-Agentops-Approval": str(context["approval"].id)},
    )
    message.attach_alternative(html, "text/html")
    return message


def render_request(row: Any) -> EmailMultiAlternatives | None:
    approval = Approval.objects.filter(id=row.payload["approval"]).first()
    link = ApprovalLink.objects.filter(id=row.payload["link"]).first()
    if approval is None or link is None or link.used_at is not None:
        return None
    if approval.status != Approval.Status.PENDING:
        return None  # decided, expired or escalated before its turn came: nothing to ask
    user = get_user_model().objects.filter(pk=row.recipient_id).first()
    if user is None:
        return None
    kind = row.payload.get("kind", ApprovalLink.Kind.REQUEST)
    context = _context(approval)
    prefix = "Reminder: approval" if kind == ApprovalLink.Kind.REMINDER else "Approval"
    subject = (
        f"{context['dry']}{prefix} needed: {context['summary']} (run {str(approval.run_id)[:8]}, "
        f"{context['run'].agent_name})"
    )
    link_text = links.link_url("approvals:link", row.payload["seed"])
    return _message(
        subject=subject,
        template="request",
        context={**context, "approver": user, "link": link_text, "kind": kind},
        to=row.to_address,
    )


def render_notice(row: Any) -> EmailMultiAlternatives | None:
    approval = Approval.objects.filter(id=row.payload["approval"]).first()
    if approval is None:
        return None
    context = _context(approval)
    principal = context["run"].principal
    what = row.payload["what"]
    subject = (
        f"{context['dry']}Approval {what}: {context['summary']} (run {str(approval.run_id)[:8]}, "
        f"{context['run'].agent_name})"
    )
    return _message(
        subject=subject,
        template="notice",
        context={**context, "what": what, "principal": principal},
        to=row.to_address,
    )


def recorded(row: Any, error: str) -> None:
    """Each attempt on the run's timeline (a failed one is retried; the approval itself is
    unaffected and stays decidable on the approvals page)."""
    if row.kind == NOTICE_KIND:
        kind = f"notice_{row.payload.get('what')}"
    else:
        kind = row.payload.get("kind", ApprovalLink.Kind.REQUEST)
    outbox.attempt_on_timeline(
        row, error, event_prefix="approval", approval=row.payload["approval"], kind=kind
    )


def install() -> None:
    """Called from ``ApprovalsConfig.ready``."""
    outbox.register_kind(REQUEST_KIND, render=render_request, recorded=recorded)
    outbox.register_kind(NOTICE_KIND, render=render_notice, recorded=recorded)

"""Approval emails: who gets one, the single-use links they carry, and sending them.

Links are made inside the transaction that requests the approval (only the token's sha256
is stored); the raw tokens live in memory until the commit, when the emails are sent and
``approval.email_sent`` is appended. Nothing here sends mail inside a transaction: a rolled
back request sends nothing, and a slow mail server never holds a lock.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Iterable
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.mail import EmailMultiAlternatives, get_connection
from django.db import transaction
from django.template.loader import render_to_string
from django.urls import reverse

from approvals import selectors
from approvals.models import Approval, ApprovalDecision, ApprovalLink
from runs import jsonlimits
from runs.events import checkpoint
from runs.masking import masker_for
from runs.models import Run, ToolCall

log = logging.getLogger(__name__)

EMAIL_ACTOR = "system"
EMAIL_CHANNEL = "email"

RISK = {
    "read": "read only: no side effect",
    "idempotent": "side effect; the external system deduplicates repeats",
    "reconcilable": "side effect; it can be looked up afterwards, not undone",
    "unsafe": "side effect that can be neither deduplicated nor looked up",
}


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def link_url(token: str) -> str:
    base = settings.AGENTOPS["BASE_URL"].rstrip("/")
    return base + reverse("approvals:link", args=[token])


def eligible_approvers(approval: Approval, *, principal_id: Any) -> list[Any]:
    """Active members of the approval's group with an email address who may decide it and
    have not decided yet; the run's principal only when the policy allows self-approval."""
    users = (
        get_user_model()
        .objects.filter(is_active=True, groups__name=approval.approver_group)
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
    ]


def links_create_and_email(
    *, approval: Approval, principal_id: Any, kind: str = ApprovalLink.Kind.REQUEST
) -> int:
    """Inside the requesting transaction: one link per eligible approver; the emails go out
    when it commits. Returns how many are due to be sent."""
    outgoing: list[tuple[Any, str]] = []
    for user in eligible_approvers(approval, principal_id=principal_id):
        token = secrets.token_urlsafe(32)  # 256 bits
        ApprovalLink.objects.create(
            approval=approval, approver=user, token_hash=hash_token(token), kind=kind
        )
        outgoing.append((user.pk, token))
    if outgoing:
        transaction.on_commit(
            partial(_send_approval_emails, approval.id, kind, outgoing), robust=True
        )
    return len(outgoing)


def principal_notice_on_commit(*, approval_id: Any, what: str) -> None:
    """Tell the run's principal (if they have an email) that an approval was rejected or
    expired, once the transaction that settled it commits."""
    transaction.on_commit(partial(_send_principal_notice, approval_id, what), robust=True)


# --- after commit ------------------------------------------------------------------------


def _context(approval: Approval) -> dict[str, Any]:
    run = Run.objects.select_related("principal").get(id=approval.run_id)
    call = ToolCall.objects.select_related("step").get(id=approval.tool_call_id)
    return {
        "approval": approval,
        "run": run,
        "call": call,
        # an email is shown to nobody in particular: sensitive tool output masked
        "arguments_json": jsonlimits.pretty(masker_for(run)(approval.arguments_masked)),
        "risk": call.effect,
        "risk_text": RISK.get(call.effect, call.effect),
        "decisions": list(approval.decisions.select_related("decider")),
    }


def _message(
    *, subject: str, template: str, context: dict[str, Any], to: str, connection
) -> EmailMultiAlternatives:
    text = render_to_string(f"approvals/email/{template}.txt", context)
    html = render_to_string(f"approvals/email/{template}.html", context)
    message = EmailMultiAlternatives(
        subject=subject,
        body=text,
        from_email=settings.DEFAULT_FROM_EMAIL,
        to=[to],
        connection=connection,
    )
    message.attach_alternative(html, "text/html")
    return message


def _send_approval_emails(approval_id: Any, kind: str, outgoing: Iterable[tuple[Any, str]]) -> None:
    approval = Approval.objects.get(id=approval_id)
    users = get_user_model().objects.in_bulk([pk for pk, _ in outgoing])
    context = _context(approval)
    prefix = "Reminder: approval" if kind == ApprovalLink.Kind.REMINDER else "Approval"
    subject = (
        f"{prefix} needed: {approval.tool_name} for run {str(approval.run_id)[:8]} "
        f"({context['run'].agent_name})"
    )
    results = []
    connection = get_connection()
    for pk, token in outgoing:
        user = users[pk]
        message = _message(
            subject=subject,
            template="request",
            context={**context, "approver": user, "link": link_url(token), "kind": kind},
            to=user.email,
            connection=connection,
        )
        results.append((user, _deliver(message)))
    _record(approval, kind, results)


def _send_principal_notice(approval_id: Any, what: str) -> None:
    approval = Approval.objects.get(id=approval_id)
    context = _context(approval)
    principal = context["run"].principal
    if principal is None or not principal.email or not principal.is_active:
        return
    subject = (
        f"Approval {what}: {approval.tool_name} for run {str(approval.run_id)[:8]} "
        f"({context['run'].agent_name})"
    )
    message = _message(
        subject=subject,
        template="notice",
        context={**context, "what": what, "principal": principal},
        to=principal.email,
        connection=get_connection(),
    )
    _record(approval, f"notice_{what}", [(principal, _deliver(message))])


def _deliver(message: EmailMultiAlternatives) -> str:
    # Mail is best effort: a failure is recorded on the run (the approval itself is
    # unaffected and stays decidable on the approvals page; the reminder sends new links).
    try:
        message.send()
    except Exception as exc:  # smtplib, socket and backend errors alike
        log.warning("approval email to %s failed: %s", message.to, exc)
        return f"{type(exc).__name__}: {exc}"
    return ""


def _record(approval: Approval, kind: str, results: list[tuple[Any, str]]) -> None:
    with checkpoint(approval.run_id, actor=EMAIL_ACTOR, channel=EMAIL_CHANNEL) as cp:
        for user, error in results:
            if error:
                cp.event(
                    "approval.email_failed",
                    approval=approval.id,
                    kind=kind,
                    to=user.get_username(),
                    error=error,
                )
            else:
                cp.event(
                    "approval.email_sent", approval=approval.id, kind=kind, to=user.get_username()
                )

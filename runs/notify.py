"""Question emails (docs/waits.md): who gets one, the single-use links they carry, and
sending them. The same rules as approval links (approvals/notify.py):

- a link is made inside the transaction that asks the question (the engine's ``decided``
  commit); only the token's sha256 is stored, the raw token lives in memory until the commit;
- the emails go out after that commit, never inside a transaction: a rolled back decision
  sends nothing, and a slow mail server never holds the run's row lock;
- each sending is recorded on the run (``question.email_sent`` / ``question.email_failed``)
  and on the link (``mailed_at``). A process killed between the commit and the sending
  leaves links that were never mailed: the sweeper replaces each with a fresh link (the raw
  token is gone) and sends it (``question_emails_resend_due``), so a crash loses no email.

Opening a link (GET) only shows the question and a form; answering is a POST
(``runs.waits.question_link_answer``): mail scanners and link previews open links.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Iterable
from datetime import timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.mail import EmailMultiAlternatives, get_connection
from django.db import transaction
from django.db.models.functions import Now
from django.template.loader import render_to_string
from django.urls import reverse

from runs.events import checkpoint
from runs.masking import masker_for
from runs.models import Question, QuestionLink

log = logging.getLogger(__name__)

EMAIL_ACTOR = "system"
EMAIL_CHANNEL = "email"
# A link not mailed this long after it was made was orphaned by a dead process: the
# after-commit sending takes milliseconds, plus however long the mail server takes to answer.
RESEND_AFTER = timedelta(minutes=5)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def link_url(token: str) -> str:
    base = settings.AGENTOPS["BASE_URL"].rstrip("/")
    return base + reverse("runs:question_link", args=[token])


def eligible_recipients(question: Question) -> list[Any]:
    """Active members of the question's group who have an email address. (A superuser
    outside the group may answer in the console, but is not mailed: the group is who the
    agent asked.)"""
    return list(
        get_user_model()
        .objects.filter(is_active=True, groups__name=question.group)
        .exclude(email="")
        .distinct()
        .order_by("pk")
    )


def question_links_create_and_email(*, question: Question) -> int:
    """Inside the asking transaction: one link per eligible person; the emails go out when
    it commits. Returns how many are due to be sent."""
    outgoing = [_new_link(question, user) for user in eligible_recipients(question)]
    if outgoing:
        # robust: a failing callback must not hide the commit that already happened from
        # the engine (it would take a committed wait for a failed one)
        transaction.on_commit(partial(_send_question_emails, question.id, outgoing), robust=True)
    return len(outgoing)


def _new_link(question: Question, user: Any) -> tuple[Any, str, int]:
    token = secrets.token_urlsafe(32)  # 256 bits
    link = QuestionLink.objects.create(
        question=question, recipient=user, token_hash=hash_token(token)
    )
    return user.pk, token, link.id


def question_emails_resend_due(*, limit: int = 100) -> int:
    """A sweep hook: links of open questions that were never mailed ``RESEND_AFTER`` after
    they were made (the process that asked died between its commit and the sending) are
    replaced by fresh ones, emailed after the replacing commit. Returns how many."""
    stale = list(
        QuestionLink.objects.filter(
            mailed_at__isnull=True,
            used_at__isnull=True,
            created_at__lt=Now() - RESEND_AFTER,
            question__status=Question.Status.OPEN,
            question__expires_at__gt=Now(),
        )
        .select_related("question", "recipient")
        .order_by("created_at")[:limit]
    )
    replaced = 0
    for link in stale:
        with transaction.atomic():
            # the delete is the claim: of two sweepers (or a late first sending), one wins
            deleted, _ = QuestionLink.objects.filter(id=link.id, mailed_at__isnull=True).delete()
            if deleted != 1:
                continue
            if link.recipient not in eligible_recipients(link.question):
                continue  # left the group, lost their address or was deactivated meanwhile
            outgoing = [_new_link(link.question, link.recipient)]
            transaction.on_commit(
                partial(_send_question_emails, link.question_id, outgoing, resent=True),
                robust=True,
            )
            replaced += 1
    return replaced


# --- after commit ------------------------------------------------------------------------


def _send_question_emails(
    question_id: Any, outgoing: Iterable[tuple[Any, str, int]], *, resent: bool = False
) -> None:
    question = Question.objects.select_related("run", "step").get(id=question_id)
    run = question.run
    users = get_user_model().objects.in_bulk([pk for pk, _, _ in outgoing])
    # an email is shown to nobody in particular: sensitive tool output the agent put in its
    # question is masked (runs.masking)
    text = masker_for(run)(question.text)
    subject = f"Question from run {str(run.id)[:8]} ({run.agent_name}): {_one_line(text)}"
    context = {"question": question, "question_text": text, "run": run}
    connection = get_connection()
    results = []
    for pk, token, link_id in outgoing:
        user = users.get(pk)
        if user is None or not QuestionLink.objects.filter(id=link_id).exists():
            continue  # deleted since the commit, or the link replaced by the sweeper
        personal = {**context, "recipient": user, "link": link_url(token)}
        message = EmailMultiAlternatives(
            subject=subject,
            body=render_to_string("runs/email/question.txt", personal),
            from_email=settings.DEFAULT_FROM_EMAIL,
            to=[user.email],
            connection=connection,
        )
        message.attach_alternative(
            render_to_string("runs/email/question.html", personal), "text/html"
        )
        results.append((user, _deliver(message)))
        # after the attempt, not before: a crash in between sends it twice, never not at all
        QuestionLink.objects.filter(id=link_id).update(mailed_at=Now())
    _record(question, results, resent=resent)


def _one_line(text: str, limit: int = 80) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _deliver(message: EmailMultiAlternatives) -> str:
    # Mail is best effort: a failure is recorded on the run, and the question stays
    # answerable in the console (runs:questions) until it expires.
    try:
        message.send()
    except Exception as exc:  # smtplib, socket and backend errors alike
        log.warning("question email to %s failed: %s", message.to, exc)
        return f"{type(exc).__name__}: {exc}"
    return ""


def _record(question: Question, results: list[tuple[Any, str]], *, resent: bool) -> None:
    if not results:
        return
    with checkpoint(question.run_id, actor=EMAIL_ACTOR, channel=EMAIL_CHANNEL) as cp:
        for user, error in results:
            detail: dict[str, Any] = {"question_id": question.id, "to": user.get_username()}
            if resent:
                detail["resent"] = True
            if error:
                cp.event("question.email_failed", error=error, **detail)
            else:
                cp.event("question.email_sent", **detail)

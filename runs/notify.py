"""Question emails (docs/waits.md): who gets one, the single-use links they carry, and
sending them. The same rules as approval links (approvals/notify.py):

- a link and its email (a ``runs.outbox`` row) are made inside the transaction that asks
  the question (the engine's ``decided`` commit); only the token's sha256 is stored with the
  link, the outbox row holds the seed it is derived from (``runs.links.link_token``);
- the emails go out after that commit, never inside a transaction: a rolled back decision
  sends nothing, and a slow mail server never holds the run's row lock. A process killed
  between the commit and the sending leaves the rows pending: a worker's sweeper sends them;
- each attempt is recorded on the run (``question.email_sent`` / ``question.email_failed``)
  and a sent one on the link (``mailed_at``); a failed one is retried with backoff.

Opening a link (GET) only shows the question and a form; answering is a POST
(``runs.waits.question_link_answer``): mail scanners and link previews open links
(docs/links.md).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.mail import EmailMultiAlternatives
from django.db.models.functions import Now
from django.template.loader import render_to_string

from runs import links, outbox
from runs.masking import masker_for
from runs.models import Question, QuestionLink

log = logging.getLogger(__name__)

EMAIL_CHANNEL = "email"
QUESTION_KIND = "question"


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
    """Inside the asking transaction: one link and one outbox email per eligible person.
    Returns how many are due to be sent."""
    emails = [
        links.emailed_link(
            kind=QUESTION_KIND,
            recipient=user,
            run_id=question.run_id,
            payload={"question": question.id},
            create_link=partial(QuestionLink.objects.create, question=question, recipient=user),
        )
        for user in eligible_recipients(question)
    ]
    outbox.emails_enqueue(emails)
    return len(emails)


# --- when the outbox sends them ------------------------------------------------------------


def render(row: Any) -> EmailMultiAlternatives | None:
    question = Question.objects.select_related("run", "step").filter(id=row.payload["question"])
    question = question.first()
    link = QuestionLink.objects.filter(id=row.payload["link"]).first()
    if question is None or link is None or link.used_at is not None:
        return None
    if question.status != Question.Status.OPEN:
        return None  # answered, expired or its run ended before its turn came
    user = get_user_model().objects.filter(pk=row.recipient_id).first()
    if user is None:
        return None
    run = question.run
    # an email is shown to nobody in particular: sensitive tool output the agent put in its
    # question is masked (runs.masking)
    text = masker_for(run)(question.text)
    subject = f"Question from run {str(run.id)[:8]} ({run.agent_name}): {_one_line(text)}"
    personal = {
        "question": question,
        "question_text": text,
        "run": run,
        "recipient": user,
        "link": links.link_url("runs:question_link", row.payload["seed"]),
    }
    message = EmailMultiAlternatives(
        subject=subject,
        body=render_to_string("runs/email/question.txt", personal),
        from_email=settings.DEFAULT_FROM_EMAIL,
        to=[row.to_address],
        headers={"X-Agentops-Question": str(question.id)},
    )
    message.attach_alternative(render_to_string("runs/email/question.html", personal), "text/html")
    return message


def _one_line(text: str, limit: int = 80) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def recorded(row: Any, error: str) -> None:
    """Each attempt on the run's timeline and, once sent, on the link (the question stays
    answerable in the console, runs:questions, whatever the mail server does)."""
    if not error:
        QuestionLink.objects.filter(id=row.payload["link"]).update(mailed_at=Now())
    outbox.attempt_on_timeline(
        row, error, event_prefix="question", question_id=row.payload["question"]
    )


def install() -> None:
    """Called from ``RunsConfig.ready``."""
    outbox.register_kind(QUESTION_KIND, render=render, recorded=recorded)

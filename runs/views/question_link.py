"""What a question's emailed link has of its own (the rest: ``runs.views.links``): the
question's states, its facts, and a POST that answers through
``runs.waits.question_link_answer`` as the link's recipient on channel ``email``."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.utils import timezone

from runs import waits
from runs.masking import masker_for
from runs.models import Question, QuestionLink
from runs.services import InvalidInput
from runs.views.links import LinkFormError, LinkPage, after_sign_in_view, client_of, link_view


def _state(link: QuestionLink) -> str:
    question = link.question
    if question.status == Question.Status.ANSWERED:
        return "answered"
    if question.status == Question.Status.CANCELLED:
        return "cancelled"
    if question.status == Question.Status.EXPIRED or question.expires_at <= timezone.now():
        # past its time but not yet recorded as expired (the engine records it when it wakes
        # the run): the service refuses an answer anyway
        return "expired"
    if link.used_at is not None:
        return "answered"
    if not waits.may_answer(link.recipient, question):
        return "refused"
    return "confirm"


def _context(request: HttpRequest, link: QuestionLink) -> dict[str, Any]:
    question = link.question
    return {
        "question": question,
        "question_text": masker_for(question.run, user=request.user)(question.text),
        "run": question.run,
    }


def _answer(request: HttpRequest, token: str) -> Question:
    try:
        return waits.question_link_answer(
            token=token,
            answer=request.POST.get("answer", ""),
            user=request.user,
            **client_of(request),
        )
    except InvalidInput as exc:
        # the form again, with what they wrote: nothing was used up
        raise LinkFormError(str(exc)) from exc


QUESTION_LINK_PAGE = LinkPage(
    kind=waits.QUESTION_LINKS,
    template="runs/question_link.html",
    done="answered",
    after_sign_in="runs:question_link_after_sign_in",
    inbox="runs:questions",
    inbox_label="questions inbox",
    nothing_done="Nothing was answered.",
    recipient_noun="person",
    state=_state,
    context=_context,
    decide=_answer,
    conflicts=(waits.AlreadyAnswered, waits.QuestionClosed),
)

question_link = link_view(QUESTION_LINK_PAGE)
question_link_after_sign_in = after_sign_in_view(QUESTION_LINK_PAGE)

"""The landing page of an emailed question link (runs.notify).

GET (and HEAD) only renders the question with an answer form: mail scanners and link
previews open links, and must answer nothing. POST answers, through
``runs.waits.question_link_answer``, as the link's recipient on channel ``email`` — signed in
as that recipient: whoever else holds the link (a forwarded email) is asked to sign in.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from runs import waits
from runs.actors import PermissionDenied
from runs.masking import masker_for
from runs.models import Question, QuestionLink
from runs.services import InvalidInput
from runs.views.link_sign_in import sign_in_url_keeping_the_link

AFTER_SIGN_IN = "runs:question_link_after_sign_in"

# the HTTP status of each state's page: a link that can no longer answer is gone (410)
_STATUS = {"confirm": 200, "answered": 200, "expired": 410, "cancelled": 410, "refused": 403}


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


def _page(
    request: HttpRequest,
    state: str,
    *,
    link: QuestionLink | None = None,
    status: int | None = None,
    error: str = "",
    answer: str = "",
) -> HttpResponse:
    context: dict[str, Any] = {"state": state, "error": error, "link": link, "answer": answer}
    if state == "login":
        context["sign_in_url"] = sign_in_url_keeping_the_link(request, after=AFTER_SIGN_IN)
    if link is not None:
        question = link.question
        context.update(
            question=question,
            question_text=masker_for(question.run, user=request.user)(question.text),
            run=question.run,
            seconds_left=max(0, int((question.expires_at - timezone.now()).total_seconds())),
        )
    response = render(
        request, "runs/question_link.html", context, status=status or _STATUS.get(state, 200)
    )
    # the token is in the URL: keep it out of other sites' Referer headers, caches and
    # search engines. Not "no-referrer": with it browsers send "Origin: null" on the form's
    # POST, which Django's CSRF origin check refuses.
    response["Referrer-Policy"] = "same-origin"
    response["X-Robots-Tag"] = "noindex, nofollow"
    return response


@never_cache
@require_http_methods(["GET", "HEAD", "POST"])
def question_link(request: HttpRequest, token: str) -> HttpResponse:
    try:
        link = waits.question_link_get(token)
    except waits.LinkInvalid:
        return _page(request, "invalid", status=404)
    try:
        waits.question_link_check_user(link, request.user)
    except waits.LinkNotYours as exc:
        return _page(request, "not_yours", link=link, status=403, error=str(exc))
    except waits.LinkLoginRequired:
        if request.method == "POST":
            return redirect(sign_in_url_keeping_the_link(request, after=AFTER_SIGN_IN))
        state = _state(link)
        return _page(request, "login" if state == "confirm" else state, link=link)
    if request.method != "POST":
        return _page(request, _state(link), link=link)

    answer = request.POST.get("answer", "")
    try:
        waits.question_link_answer(token=token, answer=answer, user=request.user)
    except InvalidInput as exc:
        # the form again, with what they wrote: nothing was used up
        return _page(request, "confirm", link=link, status=400, error=str(exc), answer=answer)
    except (waits.LinkUsed, waits.AlreadyAnswered, waits.QuestionClosed) as exc:
        link = waits.question_link_get(token)
        state = _state(link)
        status = 410 if state in ("expired", "cancelled") else 409
        return _page(request, state, link=link, status=status, error=str(exc))
    except PermissionDenied as exc:
        return _page(request, "refused", link=link, status=403, error=str(exc))
    return _page(request, "answered", link=waits.question_link_get(token))

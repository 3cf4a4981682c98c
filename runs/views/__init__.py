"""HTML pages for runs. Views stay thin: parse, call a selector or service, render."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods
from django_htmx.middleware import HtmxDetails

from runs import selectors, waits
from runs.actors import Actor
from runs.actors import PermissionDenied as ActorPermissionDenied
from runs.forms import UnclippedCharField
from runs.masking import masker_for, maskers_for_ids
from runs.models import Question
from runs.services import InvalidInput


class HtmxHttpRequest(HttpRequest):
    htmx: HtmxDetails


# The dashboard, the runs list, starting runs and bulk actions: runs.views.console.


# --- questions to people (docs/waits.md) ------------------------------------------------------


class AnswerForm(forms.Form):
    answer = UnclippedCharField(max_length=waits.ANSWER_MAX, widget=forms.Textarea)

    def __init__(self, *args: Any, question: Question, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if question.choices is not None:
            self.fields["answer"] = forms.ChoiceField(
                choices=[(c, c) for c in question.choices], widget=forms.RadioSelect
            )


@login_required
def question_inbox(request: HtmxHttpRequest) -> HttpResponse:
    open_questions, settled = selectors.question_inbox(user=request.user)
    # a question may quote a value the agent read (runs.masking): shown masked
    masks = maskers_for_ids({q.run_id for q in [*open_questions, *settled]}, user=request.user)
    for question in [*open_questions, *settled]:
        question.text_shown = masks[question.run_id](question.text)
    now = timezone.now()
    context = {
        "open_questions": [
            (q, max(0, int((q.expires_at - now).total_seconds()))) for q in open_questions
        ],
        "settled": settled,
    }
    template = "runs/questions.html#question-list" if request.htmx else "runs/questions.html"
    return render(request, template, context)


@login_required
@require_http_methods(["GET", "HEAD", "POST"])
def question_detail(request: HtmxHttpRequest, question_id: int) -> HttpResponse:
    """GET shows the question and the answer form; POST (with CSRF) answers it."""
    try:
        question = selectors.question_get(question_id=question_id)
    except Question.DoesNotExist:
        raise Http404("no such question") from None
    may_answer = waits.may_answer(request.user, question)
    if not (may_answer or request.user.has_perm("runs.view_run")):
        raise PermissionDenied
    form = AnswerForm(question=question)
    error, status = "", 200
    if request.method == "POST":
        form = AnswerForm(request.POST, question=question)
        if form.is_valid():
            try:
                waits.question_answer(
                    question_id=question.id,
                    answer=form.cleaned_data["answer"],
                    actor=Actor.for_user(request.user, "web"),
                )
            except ActorPermissionDenied as exc:
                error, status = str(exc), 403
            except (waits.AlreadyAnswered, waits.QuestionClosed) as exc:
                error, status = str(exc), 409
            except InvalidInput as exc:
                form.add_error("answer", str(exc))
                status = 400
            else:
                messages.success(request, "Your answer was recorded; the run continues.")
                return redirect("runs:question", question_id=question.id)
            question = selectors.question_get(question_id=question_id)
        else:
            status = 400
    context = {
        "question": question,
        "question_text": masker_for(question.run, user=request.user)(question.text),
        "run": question.run,
        "may_answer": may_answer and question.status == Question.Status.OPEN,
        "form": form,
        "error": error,
        "seconds_left": max(0, int((question.expires_at - timezone.now()).total_seconds())),
    }
    return render(request, "runs/question.html", context, status=status)

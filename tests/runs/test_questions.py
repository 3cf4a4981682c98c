"""Questions to people: the demo onboarding agent asks an operator, the run waits with no
lease, the first valid answer from the group continues it, an unanswered question times out
to its default; and the answers inbox pages (GET shows, POST answers, CSRF, members only)."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from runs import sweeper
from runs.actors import Actor, PermissionDenied
from runs.models import Question, Run, Step
from runs.registry import AskQuestion
from runs.services import InvalidInput, run_create, run_terminate
from runs.waits import AlreadyAnswered, QuestionClosed, question_answer, run_signal
from tests.conftest import drive
from tests.runs.wait_support import assert_no_lease, fall_due, waits_then_finishes
from tests.support import event_types, events

pytestmark = pytest.mark.usefixtures("roles")


def _onboarding(system_actor, **input) -> Run:
    run = run_create(
        agent_name="onboarding", input={"customer": "Acme", **input}, actor=system_actor
    )
    return drive(run.id)


def _answer(question, user, answer, channel="web") -> Question:
    return question_answer(
        question_id=question.id, answer=answer, actor=Actor.for_user(user, channel)
    )


@pytest.mark.django_db
def test_the_demo_agent_asks_waits_and_continues_with_the_answer_and_a_signal(
    system_actor, operator
):
    run = _onboarding(system_actor)

    assert_no_lease(run)
    question = Question.objects.get(run=run)
    assert question.status == Question.Status.OPEN
    assert question.choices == ["starter", "pro", "enterprise"]
    assert question.group == "operator"
    assert run.wake_at == question.expires_at  # expiry is the wait's timeout

    _answer(question, operator, "pro")
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED  # no longer waiting once answered
    run = drive(run.id)

    assert_no_lease(run)  # now waiting for payment_confirmed
    assert run.state["plan"] == "pro"
    question.refresh_from_db()
    assert (question.status, question.answer, question.channel) == ("answered", "pro", "web")
    assert question.answered_by == operator
    [answered] = events(run.id, "question.answered")
    assert answered.payload["by"] == "user:olivia" and answered.payload["channel"] == "web"
    assert (answered.actor, answered.channel) == ("user:olivia", "web")
    [ended] = events(run.id, "run.wait_ended")
    assert ended.payload["ended_by"] == "answer"
    assert ended.payload["answered_by"] == "olivia"

    run_signal(
        run_id=run.id, name="payment_confirmed", payload={"confirmed": True}, actor=system_actor
    )
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED
    assert run.result["plan"] == "pro" and run.result["paid"] is True


@pytest.mark.django_db
def test_the_first_valid_answer_wins(system_actor, operator, django_user_model):
    from django.contrib.auth.models import Group

    other = django_user_model.objects.create_user(username="oscar", password="pw")
    other.groups.add(Group.objects.get(name="operator"))
    run = _onboarding(system_actor)
    question = Question.objects.get(run=run)

    with pytest.raises(InvalidInput):
        _answer(question, operator, "platinum")  # not a choice: not an answer at all
    _answer(question, operator, "pro")
    with pytest.raises(AlreadyAnswered) as refused:
        _answer(question, other, "enterprise")

    assert refused.value.code == "already_decided"
    assert "olivia" in str(refused.value)
    question.refresh_from_db()
    assert (question.answer, question.answered_by) == ("pro", operator)
    assert len(events(run.id, "question.answered")) == 1


@pytest.mark.django_db
def test_only_members_of_the_group_may_answer(system_actor, viewer, approver):
    run = _onboarding(system_actor)
    question = Question.objects.get(run=run)

    for outsider in (viewer, approver):
        with pytest.raises(PermissionDenied):
            _answer(question, outsider, "pro")

    question.refresh_from_db()
    assert question.status == Question.Status.OPEN
    assert "question.answered" not in event_types(run.id)


@pytest.mark.django_db
def test_an_unanswered_question_times_out_to_its_default(system_actor, operator):
    run = _onboarding(system_actor, payment_timeout_seconds=60)
    question = Question.objects.get(run=run)

    fall_due(run.id)
    # the expiry time passed but no worker has woken the run yet: too late to answer
    with pytest.raises(QuestionClosed):
        _answer(question, operator, "pro")
    assert run.id in sweeper.runnable_orphans()
    run = drive(run.id)

    question.refresh_from_db()
    assert question.status == Question.Status.EXPIRED
    assert question.answered_by is None
    assert run.state["plan"] == "starter"
    step = Step.objects.get(run=run, seq=1)
    assert (step.status, step.output) == (Step.Status.COMPLETED, "starter")
    [timed_out] = events(run.id, "run.wait_timed_out")
    assert timed_out.payload["on"] == "question" and timed_out.payload["timed_out"] is True
    assert "question.expired" in event_types(run.id)
    assert_no_lease(run)  # waiting for the payment now

    fall_due(run.id)
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED
    assert run.result["paid"] is False


@pytest.mark.django_db
def test_a_question_is_withdrawn_when_its_run_is_terminated(system_actor, operator):
    run = _onboarding(system_actor)
    question = Question.objects.get(run=run)

    run_terminate(run_id=run.id, actor=system_actor, reason="duplicate signup")

    question.refresh_from_db()
    assert question.status == Question.Status.CANCELLED
    with pytest.raises(QuestionClosed):
        _answer(question, operator, "pro")


@pytest.mark.django_db
def test_a_free_text_question_takes_any_non_empty_answer(register, system_actor, operator):
    register(waits_then_finishes("asker", AskQuestion("Why was the refund late?")))
    run = drive(run_create(agent_name="asker", actor=system_actor).id)
    question = Question.objects.get(run=run)

    with pytest.raises(InvalidInput):
        _answer(question, operator, "   ")
    _answer(question, operator, "  The bank was closed.  ")
    run = drive(run.id)

    assert run.result["outputs"] == ["The bank was closed."]


@pytest.mark.django_db
def test_a_question_for_a_group_that_does_not_exist_is_refused(register, system_actor):
    register(waits_then_finishes("asker", AskQuestion("Anyone?", group="nobody")))

    run = drive(run_create(agent_name="asker", actor=system_actor).id)

    assert run.status == Run.Status.SUCCEEDED
    assert "no group named 'nobody'" in run.result["errors"][0]
    assert not Question.objects.exists()


# --- pages ---------------------------------------------------------------------------------------


def _detail(question) -> str:
    return reverse("runs:question", args=[question.id])


@pytest.fixture
def asked(system_actor):
    return Question.objects.get(run=_onboarding(system_actor))


@pytest.mark.django_db
def test_the_inbox_needs_a_signed_in_user(client, asked):
    response = client.get(reverse("runs:questions"))

    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")


@pytest.mark.django_db
def test_the_inbox_lists_open_questions_for_the_users_groups(
    client, asked, operator, approver, django_assert_max_num_queries
):
    client.force_login(operator)
    with django_assert_max_num_queries(8):
        page = client.get(reverse("runs:questions"))
    html = page.content.decode()
    assert page.status_code == 200
    assert _detail(asked) in html
    assert "Which plan should Acme start on?" in html
    assert f'href="{reverse("runs:questions")}"' in html  # the nav link
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), "inline script"

    client.force_login(approver)  # not in group operator
    assert _detail(asked) not in client.get(reverse("runs:questions")).content.decode()


@pytest.mark.django_db
def test_get_shows_the_question_and_post_answers_it(asked, operator):
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)

    page = client.get(_detail(asked))
    assert page.status_code == 200
    html = page.content.decode()
    assert "Which plan should Acme start on?" in html
    for choice in ("starter", "pro", "enterprise"):
        assert f'value="{choice}"' in html
    asked.refresh_from_db()
    assert asked.status == Question.Status.OPEN  # a GET changes nothing

    assert client.post(_detail(asked), {"answer": "pro"}).status_code == 403  # no CSRF token
    token = client.cookies["csrftoken"].value
    response = client.post(_detail(asked), {"answer": "pro", "csrfmiddlewaretoken": token})

    assert response.status_code == 302
    asked.refresh_from_db()
    assert (asked.status, asked.answer, asked.channel) == ("answered", "pro", "web")
    assert asked.answered_by == operator
    after = client.get(response["Location"]).content.decode()
    assert "Your answer was recorded" in after
    assert "olivia" in after and '<form method="post" action="' + _detail(asked) not in after


@pytest.mark.django_db
def test_a_second_answer_through_the_page_is_a_conflict(client, asked, operator):
    _answer(asked, operator, "enterprise")
    client.force_login(operator)

    response = client.post(_detail(asked), {"answer": "pro"})

    assert response.status_code == 409
    assert "already answered by olivia" in response.content.decode()
    asked.refresh_from_db()
    assert asked.answer == "enterprise"


@pytest.mark.django_db
def test_an_invalid_choice_is_shown_back_with_the_form(client, asked, operator):
    client.force_login(operator)

    response = client.post(_detail(asked), {"answer": "platinum"})

    assert response.status_code == 400
    asked.refresh_from_db()
    assert asked.status == Question.Status.OPEN


@pytest.mark.django_db
def test_a_non_member_sees_the_question_but_cannot_answer(client, asked, viewer, approver):
    client.force_login(viewer)  # may view runs, not in group operator
    page = client.get(_detail(asked))
    assert page.status_code == 200
    assert "Only people in group operator" in page.content.decode()
    assert client.post(_detail(asked), {"answer": "pro"}).status_code == 403

    client.force_login(approver)  # another role, not in group operator
    assert client.post(_detail(asked), {"answer": "pro"}).status_code == 403

    asked.refresh_from_db()
    assert asked.status == Question.Status.OPEN

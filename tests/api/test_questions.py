"""``POST /api/v1/questions/{id}/answer/``: a member of the asked group answers with a bearer
token (docs/waits.md promised it; the console's page takes no token)."""

from __future__ import annotations

import pytest

from runs.actors import Actor
from runs.models import Question, Run
from runs.services import run_create
from tests.conftest import drive

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


@pytest.fixture
def question() -> Question:
    """The onboarding demo agent asks the operator group which plan a customer gets."""
    run = run_create(agent_name="onboarding", input={"customer": "acme"}, actor=Actor.system("cli"))
    assert drive(run.id).status == Run.Status.WAITING_EVENT
    return Question.objects.get(run=run)


def answer(client, question_id, body):
    return client.post(f"/api/v1/questions/{question_id}/answer/", body, format="json")


def test_a_member_of_the_group_answers_and_the_run_goes_on(as_operator, operator, question):
    response = answer(as_operator, question.id, {"answer": "pro"})

    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["status"], body["answer"], body["answered_by"]) == (
        "answered",
        "pro",
        operator.username,
    )
    assert body["channel"] == "api"
    assert Run.objects.get(id=question.run_id).status in Run.RUNNABLE
    drive(question.run_id)
    assert Run.objects.get(id=question.run_id).state["plan"] == "pro"


def test_someone_outside_the_group_is_refused_and_nothing_changes(as_viewer, question):
    response = answer(as_viewer, question.id, {"answer": "pro"})

    assert response.status_code == 403
    assert response.json()["code"] == "permission_denied"
    assert Question.objects.get(id=question.id).status == Question.Status.OPEN


def test_the_first_answer_wins(as_operator, question):
    assert answer(as_operator, question.id, {"answer": "pro"}).status_code == 200
    again = answer(as_operator, question.id, {"answer": "starter"})
    assert again.status_code == 409 and again.json()["code"] == "already_decided"
    assert Question.objects.get(id=question.id).answer == "pro"


def test_an_answer_off_the_choices_an_unknown_question_and_no_token(
    as_operator, anonymous, question
):
    off = answer(as_operator, question.id, {"answer": "platinum"})
    assert off.status_code == 400 and off.json()["code"] == "validation_error"
    assert answer(as_operator, 999_999, {"answer": "pro"}).status_code == 404
    assert answer(anonymous, question.id, {"answer": "pro"}).status_code == 401
    assert Question.objects.get(id=question.id).status == Question.Status.OPEN

"""POST /api/v1/runs/{id}/signals/: kept until a wait consumes it, delivered once per key."""

from __future__ import annotations

import pytest

from runs.actors import Actor
from runs.models import Run, Signal
from runs.registry import Finish, WaitForSignal
from runs.services import run_terminate
from tests.api.conftest import assert_error
from tests.conftest import drive
from tests.support import ScriptedAgent

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


@pytest.fixture
def waiting(register, operator) -> Run:
    def decide(ctx):
        if not ctx.steps:
            return WaitForSignal("go")
        return Finish({"got": ctx.last_step.output})

    register(ScriptedAgent("api_waiter", decide))
    from runs.services import run_create

    run = run_create(agent_name="api_waiter", actor=Actor.for_user(operator, "api"))
    run = drive(run.id)
    assert run.status == Run.Status.WAITING_EVENT
    return run


def _url(run) -> str:
    return f"/api/v1/runs/{run.id}/signals/"


def test_signal_wakes_the_waiting_run(as_operator, waiting):
    response = as_operator.post(_url(waiting), {"name": "go", "payload": {"n": 1}})

    assert response.status_code == 202, response.content
    body = response.json()
    assert body["name"] == "go" and body["sent_by"] == "token:token-olivia"
    assert body["channel"] == "api" and body["consumed_at"] is None
    assert Run.objects.get(id=waiting.id).status == "queued"
    run = drive(waiting.id)
    assert run.result == {"got": {"n": 1}}


def test_same_key_is_the_same_signal(as_operator, waiting):
    first = as_operator.post(_url(waiting), {"name": "go", "idempotency_key": "k1"}).json()
    again = as_operator.post(_url(waiting), {"name": "go", "idempotency_key": "k1"}).json()
    assert first["id"] == again["id"]
    assert Signal.objects.filter(run=waiting).count() == 1


def test_same_key_other_signal_is_refused(as_operator, waiting):
    as_operator.post(_url(waiting), {"name": "go", "idempotency_key": "k1"})
    response = as_operator.post(
        _url(waiting), {"name": "go", "idempotency_key": "k1", "payload": 2}
    )
    assert_error(response, 409, "idempotency_key_reused")


def test_signal_to_a_finished_run_is_invalid_state(as_operator, waiting, operator):
    run_terminate(run_id=waiting.id, actor=Actor.for_user(operator, "api"), reason="x")
    assert_error(as_operator.post(_url(waiting), {"name": "go"}), 409, "invalid_state")


def test_signal_needs_operate_permission(as_viewer, anonymous, waiting):
    assert_error(as_viewer.post(_url(waiting), {"name": "go"}), 403, "permission_denied")
    assert_error(anonymous.post(_url(waiting), {"name": "go"}), 401, "not_authenticated")
    assert not Signal.objects.exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "name"),
        ({"name": " "}, "name"),
        ({"name": "x" * 101}, "name"),
        ({"name": "go", "idempotency_key": "k" * 201}, "idempotency_key"),
    ],
)
def test_signal_bad_input(as_operator, waiting, body, field):
    response = as_operator.post(_url(waiting), body, format="json")
    assert field in assert_error(response, 400, "validation_error")["fields"]


def test_signal_to_a_missing_run(as_operator):
    response = as_operator.post(
        "/api/v1/runs/00000000-0000-0000-0000-000000000000/signals/", {"name": "go"}
    )
    assert_error(response, 404, "not_found")


def test_the_run_shows_its_open_wait_until_the_signal_ends_it(as_operator, waiting):
    (wait,) = as_operator.get(f"/api/v1/runs/{waiting.id}/").json()["open_waits"]
    assert (wait["kind"], wait["signal"], wait["deadline"], wait["question"]) == (
        "signal",
        "go",
        None,
        None,
    )

    as_operator.post(_url(waiting), {"name": "go"})
    assert as_operator.get(f"/api/v1/runs/{waiting.id}/").json()["open_waits"] == []


def test_an_open_question_is_shown_with_its_id_and_deadline(as_operator, register, operator):
    from runs.models import Question
    from runs.registry import AskQuestion
    from runs.services import run_create

    register(
        ScriptedAgent(
            "api_asker",
            lambda ctx: Finish({}) if ctx.steps else AskQuestion("Ship it?", choices=("yes", "no")),
        )
    )
    run = drive(run_create(agent_name="api_asker", actor=Actor.for_user(operator, "api")).id)

    (wait,) = as_operator.get(f"/api/v1/runs/{run.id}/").json()["open_waits"]
    question = Question.objects.get(run=run)
    assert (wait["kind"], wait["question"], wait["text"], wait["choices"]) == (
        "question",
        question.id,
        "Ship it?",
        ["yes", "no"],
    )
    assert wait["deadline"] is not None and wait["signal"] is None

"""POST /api/v1/runs/{id}/waits/: a remote agent's durable waits. The run parks with no lease;
a signal, an answer, its timer or its timeout ends the wait in that commit, queues the run for
an agent process and sends the run.wait_ended webhook; the next lease's resume packet has the
finished wait with its outcome."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest
import schemathesis
from django.core import mail
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from django.utils import timezone

from agentops.client import Client, verify_webhook
from agentops.wsgi import application
from runs import remote, sweeper
from runs.actors import Actor
from runs.models import ApiToken, Question, Run, Signal, Step, WebhookDelivery
from runs.services import run_terminate
from runs.tokens import api_token_create
from runs.waits import question_answer, run_signal
from runs.webhooks import webhooks_deliver_due
from tests.api.conftest import assert_error, client_for, start, token_for
from tests.api.remote_support import Agent
from tests.api.test_webhooks import Receiver
from tests.runs.wait_support import fall_due
from tests.support import event_types, events, expire_lease

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    started = Receiver()
    yield started
    started.stop()


@pytest.fixture
def hooked(operator, receiver) -> ApiToken:
    token, _raw = api_token_create(
        name="hooks", principal=operator, actor=Actor.system("cli"), webhook_url=receiver.url
    )
    return token


def _wait(agent: Agent, **body):
    return agent.run_post("waits", body)


def _signal(run: Run, operator, name: str, payload=None) -> Signal:
    return run_signal(
        run_id=run.id, name=name, payload=payload, actor=Actor.for_user(operator, "api")
    )


def _resume_wait_steps(agent: Agent) -> list[dict]:
    return [step for step in agent.resume["steps"] if step["kind"] == "wait"]


# --- waiting --------------------------------------------------------------------------------


def test_signal_wait_parks_the_run_and_releases_the_lease(run, leased, as_operator):
    response = _wait(leased, kind="signal", name="customer_replied", timeout_seconds=3600)

    assert response.status_code == 201, response.content
    body = response.json()
    assert body["kind"] == "signal" and body["waiting"] is True and body["step_seq"] == 1
    assert body["outcome"] is None and body["output"] is None and body["deadline"]
    run.refresh_from_db()
    assert run.status == Run.Status.WAITING_EVENT
    assert (run.lease_owner, run.lease_expires_at) == ("", None)
    assert run.wake_at is not None
    assert event_types(run.id)[-2:] == ["step.decided", "run.waiting"]
    # the process is done with this run until something ends the wait
    assert_error(leased.run_post("lease/heartbeat"), 409, "lease_lost")
    assert_error(leased.lease(), 409, "invalid_state")
    detail = as_operator.get(f"/api/v1/runs/{run.id}/").json()
    (wait,) = detail["open_waits"]
    assert (wait["step"], wait["kind"], wait["signal"]) == (1, "signal", "customer_replied")
    assert wait["deadline"] == body["deadline"]


def test_a_signal_ends_the_wait_wakes_the_process_by_webhook_and_the_next_lease_has_the_payload(
    run, leased, operator, hooked, receiver
):
    _wait(leased, kind="signal", name="customer_replied", default={"replied": False})
    response = client_for(operator).post(
        f"/api/v1/runs/{run.id}/signals/",
        {"name": "customer_replied", "payload": {"text": "yes please"}},
    )
    assert response.status_code == 202, response.content

    # the wait ended in the signal's own commit: the run waits for an agent process
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    assert run.reason_detail == remote.WAITING_FOR_PROCESS and run.wake_at is None
    step = Step.objects.get(run=run, seq=1)
    assert (step.status, step.output) == ("completed", {"text": "yes please"})
    signal = Signal.objects.get(run=run)
    assert signal.consumed_by_step_id == step.id and signal.consumed_at is not None
    (ended,) = events(run.id, "run.wait_ended")
    assert ended.payload["ended_by"] == "signal" and ended.payload["signal_id"] == signal.id
    # workers never get it
    assert run.id not in sweeper.runnable_orphans()

    # a process that exited hears about it
    (delivery,) = WebhookDelivery.objects.filter(event_type="run.wait_ended")
    assert webhooks_deliver_due() >= 1
    delivery.refresh_from_db()
    assert delivery.status == "delivered"
    headers, body = receiver.requests[-1]
    hook = verify_webhook(hooked.webhook_secret, headers, body)
    assert (
        hook["type"] == "run.wait_ended" and headers["Agentops-Webhook-Event"] == "run.wait_ended"
    )
    assert hook["run"] == {"id": str(run.id), "agent": "pay_bot", "status": "queued"}
    assert hook["event"]["payload"]["ended_by"] == "signal"

    # ... leases the run and finds the finished wait with the payload
    response = leased.lease(owner="proc-2")
    assert response.status_code == 200, response.content
    assert response.json()["fence"] == 2
    (wait,) = _resume_wait_steps(leased)
    assert wait["status"] == "completed" and wait["output"] == {"text": "yes please"}
    assert wait["wait"] == {
        "kind": "signal",
        "ended_by": "signal",
        "timed_out": False,
        "signal_id": signal.id,
        "question_id": None,
        "answered_by": None,
    }
    assert Run.objects.get(id=run.id).reason_detail == ""
    assert leased.run_post("finish", {"result": {"done": True}}).status_code == 200


def test_a_signal_for_another_name_is_kept_and_wakes_nothing(run, leased, operator):
    _wait(leased, kind="signal", name="customer_replied")
    _signal(run, operator, "payment_confirmed")

    assert Run.objects.get(id=run.id).status == Run.Status.WAITING_EVENT
    assert Signal.objects.get(run=run).consumed_at is None
    assert not events(run.id, "run.wait_ended")


def test_a_signal_sent_before_the_wait_ends_it_at_once(run, leased, operator):
    _signal(run, operator, "customer_replied", {"text": "early"})

    response = _wait(leased, kind="signal", name="customer_replied", timeout_seconds=60)

    assert response.status_code == 201, response.content
    body = response.json()
    assert body["waiting"] is False and body["output"] == {"text": "early"}
    assert body["outcome"]["ended_by"] == "signal" and body["outcome"]["timed_out"] is False
    # one commit: decided and ended; the process keeps its lease and goes on
    run.refresh_from_db()
    assert run.status == Run.Status.RUNNING and run.lease_owner
    assert "run.waiting" not in event_types(run.id)
    assert Signal.objects.get(run=run).consumed_by_step.seq == 1
    assert leased.run_post("lease/heartbeat").status_code == 200
    assert leased.run_post("steps", {"output": "next"}).json()["seq"] == 2


def test_timer_wait_ends_when_the_sweeper_finds_it_due(run, leased, hooked):
    response = _wait(leased, kind="timer", seconds=3600)
    assert response.status_code == 201 and response.json()["waiting"] is True
    assert remote.remote_waits_end_due() == 0  # not yet

    fall_due(run.id)  # the hour went by, also while no sweeper ran
    sweeper.sweep()

    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED and run.id not in sweeper.runnable_orphans()
    (ended,) = events(run.id, "run.wait_ended")
    assert (ended.payload["ended_by"], ended.actor) == ("timer", "system")
    assert WebhookDelivery.objects.filter(event_type="run.wait_ended").count() == 1
    leased.lease()
    (wait,) = _resume_wait_steps(leased)
    assert wait["wait"]["ended_by"] == "timer" and set(wait["output"]) == {"until"}


def test_timer_until_a_time_already_past_ends_at_once(run, leased):
    past = (timezone.now() - timedelta(minutes=1)).isoformat()
    body = _wait(leased, kind="timer", until=past).json()
    assert body["waiting"] is False and body["outcome"]["ended_by"] == "timer"


def test_signal_wait_times_out_with_its_default(run, leased, hooked):
    _wait(leased, kind="signal", name="customer_replied", timeout_seconds=60, default={"n": 0})
    fall_due(run.id)

    assert remote.remote_waits_end_due() == 1

    assert Run.objects.get(id=run.id).status == Run.Status.QUEUED
    (timed_out,) = events(run.id, "run.wait_timed_out")
    assert timed_out.payload["default"] == {"n": 0}
    (delivery,) = WebhookDelivery.objects.filter(event_type="run.wait_ended")
    assert delivery.payload["event"]["type"] == "run.wait_timed_out"
    leased.lease()
    (wait,) = _resume_wait_steps(leased)
    assert wait["output"] == {"n": 0}
    assert (wait["wait"]["ended_by"], wait["wait"]["timed_out"]) == ("timeout", True)


def test_lease_takes_a_due_timer_before_the_sweeper_does(run, leased):
    _wait(leased, kind="timer", seconds=3600)
    fall_due(run.id)

    response = leased.lease()  # claimable once due: the claim ends the wait itself

    assert response.status_code == 200, response.content
    (wait,) = _resume_wait_steps(leased)
    assert wait["wait"]["ended_by"] == "timer"
    assert Run.objects.get(id=run.id).status == Run.Status.RUNNING


def test_question_answered_through_the_question_service_ends_the_wait(
    run, leased, operator, django_capture_on_commit_callbacks
):
    operator.email = "olivia@example.com"
    operator.save(update_fields=["email"])
    with django_capture_on_commit_callbacks(execute=True):
        response = _wait(
            leased,
            kind="question",
            text="Refund the shipping too?",
            choices=["yes", "no"],
            default="no",
            ttl_seconds=3600,
        )
    assert response.status_code == 201, response.content
    body = response.json()
    question = Question.objects.get(id=body["question"])
    assert (question.text, question.group, question.status) == (
        "Refund the shipping too?",
        "operator",
        "open",
    )
    assert [m.to for m in mail.outbox] == [["olivia@example.com"]]  # with her own link

    question_answer(question_id=question.id, answer="yes", actor=Actor.for_user(operator, "web"))

    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    leased.lease()
    (wait,) = _resume_wait_steps(leased)
    assert wait["output"] == "yes"
    assert wait["wait"]["ended_by"] == "answer" and wait["wait"]["answered_by"] == "olivia"
    assert wait["wait"]["question_id"] == question.id


def test_unanswered_question_expires_with_its_default(run, leased):
    body = _wait(leased, kind="question", text="Which plan?", default="starter").json()
    fall_due(run.id)

    assert remote.remote_waits_end_due() == 1

    assert Question.objects.get(id=body["question"]).status == "expired"
    leased.lease()
    (wait,) = _resume_wait_steps(leased)
    assert wait["output"] == "starter" and wait["wait"]["ended_by"] == "timeout"


def test_terminating_a_waiting_run_withdraws_its_question(run, leased, operator):
    body = _wait(leased, kind="question", text="Which plan?").json()

    run_terminate(run_id=run.id, actor=Actor.for_user(operator, "web"), reason="wrong customer")

    assert Question.objects.get(id=body["question"]).status == "cancelled"
    assert Step.objects.get(run=run, seq=1).status == "failed"


# --- refusals -----------------------------------------------------------------------------------


def test_stale_fence_is_lease_lost_and_writes_nothing(run, leased, operator):
    stale = leased.fence
    expire_lease(run.id)
    successor = Agent(leased.client, run.id)
    assert successor.lease().status_code == 200
    seq = Run.objects.get(id=run.id).event_seq
    leased.fence = stale

    assert_error(_wait(leased, kind="signal", name="go"), 409, "lease_lost")

    assert Run.objects.get(id=run.id).event_seq == seq
    assert not Step.objects.filter(run=run).exists()
    assert Run.objects.get(id=run.id).status == Run.Status.RUNNING


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "kind"),
        ({"kind": "forever"}, "kind"),
        ({"kind": "signal"}, "name"),
        ({"kind": "signal", "name": "has space"}, "name"),
        ({"kind": "signal", "name": "go", "timeout_seconds": -1}, "timeout_seconds"),
        ({"kind": "timer"}, "non_field_errors"),
        ({"kind": "timer", "seconds": 5, "until": "2030-01-01T00:00:00Z"}, "non_field_errors"),
        ({"kind": "timer", "until": "next tuesday"}, "until"),
        ({"kind": "question", "text": " "}, "text"),
        ({"kind": "question", "text": "?", "choices": ["a", "a"]}, "choices"),
        ({"kind": "question", "text": "?", "choices": ["a"], "default": "b"}, "default"),
        ({"kind": "question", "text": "?", "group": "nobody"}, "group"),
        ({"kind": "question", "text": "?", "ttl_seconds": 0}, "ttl_seconds"),
    ],
)
def test_bad_wait_is_a_validation_error_and_writes_nothing(run, leased, body, field):
    seq = Run.objects.get(id=run.id).event_seq

    response = _wait(leased, **body)

    assert field in assert_error(response, 400, "validation_error")["fields"], response.json()
    assert Run.objects.get(id=run.id).event_seq == seq
    assert Run.objects.get(id=run.id).status == Run.Status.RUNNING


def test_fence_is_required(run, leased):
    response = leased.client.post(f"/api/v1/runs/{run.id}/waits/", {"kind": "timer", "seconds": 1})
    assert "fence" in assert_error(response, 400, "validation_error")["fields"]


def test_hosted_run_is_invalid_state(as_robot, api_agents):
    hosted = start()
    response = as_robot.post(
        f"/api/v1/runs/{hosted.id}/waits/",
        {"fence": 1, "lease_token": "t", "kind": "timer", "seconds": 1},
    )
    assert_error(response, 409, "invalid_state")


def test_open_tool_call_is_invalid_state(run, leased):
    leased.propose("lookup", {})
    assert_error(_wait(leased, kind="timer", seconds=1), 409, "invalid_state")


def test_viewers_and_strangers_are_refused(run, leased, as_viewer, anonymous):
    url = f"/api/v1/runs/{run.id}/waits/"
    body = {"fence": leased.fence, "lease_token": leased.lease_token, "kind": "timer", "seconds": 1}
    assert_error(as_viewer.post(url, body), 403, "permission_denied")
    assert_error(anonymous.post(url, body), 401, "not_authenticated")
    assert not Step.objects.filter(run=run).exists()


def test_missing_run_is_not_found(as_robot):
    response = as_robot.post(
        "/api/v1/runs/00000000-0000-0000-0000-000000000000/waits/",
        {"fence": 1, "lease_token": "t", "kind": "timer", "seconds": 1},
    )
    assert_error(response, 404, "not_found")


def test_a_wait_over_budget_is_budget_exhausted(run, leased):
    Run.objects.filter(id=run.id).update(max_steps=0)
    assert_error(_wait(leased, kind="timer", seconds=1), 409, "budget_exhausted")
    assert Run.objects.get(id=run.id).status == Run.Status.NEEDS_ATTENTION


# --- the client -----------------------------------------------------------------------------------


@pytest.fixture
def in_process():
    """Requests through the WSGI app in this thread, inside the test's transaction: as
    Django's test client does, the app must not close the connection after a request."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield httpx.WSGITransport(app=application)
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def in_process_client(robot, in_process) -> Iterator[Client]:
    with Client("http://testserver", token_for(robot), transport=in_process) as client:
        yield client


def test_answers_conform_to_the_schema(robot, run, operator, in_process):
    """The wait's answers (parked, ended at once, a retry) and a resume packet with a finished
    wait, checked against the OpenAPI schema (Schemathesis' fuzzing seldom gets this far)."""
    api = schemathesis.openapi.from_wsgi("/api/schema/", application)
    waits = api["/api/v1/runs/{run_id}/waits/"]["POST"]
    lease = api["/api/v1/runs/{run_id}/lease/"]["POST"]
    headers = {"Authorization": f"Bearer {token_for(robot)}"}
    with httpx.Client(base_url="http://testserver", transport=in_process, headers=headers) as http:
        leased = http.post(f"/api/v1/runs/{run.id}/lease/", json={})
        fence = leased.json()["fence"]
        token = leased.json()["lease_token"]
        _signal(run, operator, "early", {"n": 1})
        answers = [
            http.post(
                f"/api/v1/runs/{run.id}/waits/",
                json={
                    "fence": fence,
                    "lease_token": token,
                    "kind": "signal",
                    "name": "early",
                    "seq": 1,
                },
            ),
            http.post(
                f"/api/v1/runs/{run.id}/waits/",
                json={
                    "fence": fence,
                    "lease_token": token,
                    "kind": "signal",
                    "name": "early",
                    "seq": 1,
                },
            ),
            http.post(
                f"/api/v1/runs/{run.id}/waits/",
                json={
                    "fence": fence,
                    "lease_token": token,
                    "kind": "question",
                    "text": "Which plan?",
                },
            ),
        ]
        assert [a.status_code for a in answers] == [201, 200, 201]
        for answer in answers:
            waits.validate_response(answer)
        fall_due(run.id)
        remote.remote_waits_end_due()
        leased = http.post(f"/api/v1/runs/{run.id}/lease/", json={})
        assert [s["wait"]["ended_by"] for s in leased.json()["resume"]["steps"]] == [
            "signal",
            "timeout",
        ]
        lease.validate_response(leased)


def test_client_waits_for_a_signal_and_a_new_process_reads_the_outcome(
    run, in_process_client, operator
):
    client = in_process_client
    first = client.lease(str(run.id), owner="proc-1")
    assert first.resume.next_seq == 1
    wait = first.wait_for_signal("customer_replied", timeout=3600, default={"replied": False})
    assert wait.waiting and wait.outcome is None and wait.step_seq == 1

    _signal(run, operator, "customer_replied", {"replied": True})  # a person's signal

    second = client.lease(str(run.id), owner="proc-2")
    outcome = second.resume.last_wait
    assert outcome is not None
    assert (outcome.kind, outcome.ended_by, outcome.timed_out, outcome.output) == (
        "signal",
        "signal",
        False,
        {"replied": True},
    )
    assert second.resume.next_seq == 2
    ended_at_once = second.sleep(0)
    assert not ended_at_once.waiting and ended_at_once.outcome.ended_by == "timer"
    question = second.ask("Which plan?", choices=["starter", "pro"], default="starter")
    assert question.waiting and question.question_id is not None and question.step_seq == 3

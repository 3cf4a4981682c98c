"""``agentops.client`` for issue 27's protocol additions — a framework's call id on propose, a
JSON patch of the state, the conversation history, long polls — through the WSGI app, and their
answers and errors checked against the OpenAPI schema."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.db import close_old_connections

from agentops.client import (
    Client,
    ClientCallIdConflict,
    HistoryConflict,
    PatchTestFailed,
    StateVersionMismatch,
)
from agentops.client.routing import CallRouter
from agentops.wsgi import application
from approvals.models import Approval
from approvals.services import approval_decide
from runs.actors import Actor
from runs.api import longpoll
from runs.models import Run, Step
from tests.api.conftest import token_for
from tests.support import expire_lease

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

REFUND = {"order_id": "ord_1", "amount_cents": 500}


@pytest.fixture
def in_process() -> Iterator[httpx.WSGITransport]:
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield httpx.WSGITransport(app=application)
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def client(robot, in_process) -> Iterator[Client]:
    with Client("http://testserver", token_for(robot, "client"), transport=in_process) as client:
        yield client


def test_a_framework_call_id_survives_a_new_process(run, client):
    first = client.lease(str(run.id), owner="proc-1")
    proposal = first.propose("refund", REFUND, call_id="call_abc")
    assert (proposal.decision, proposal.replayed, proposal.call_id) == (
        "approved",
        False,
        "call_abc",
    )
    expire_lease(run.id)

    second = client.lease(str(run.id), owner="proc-2")
    (open_call,) = second.resume.open_tool_calls
    assert open_call.client_call_id == "call_abc"
    again = second.propose("refund", REFUND, call_id="call_abc")
    assert again.replayed and again.tool_call_id == proposal.tool_call_id
    with pytest.raises(ClientCallIdConflict) as refused:
        second.propose("refund", {**REFUND, "amount_cents": 1}, call_id="call_abc")
    assert refused.value.body["tool_call"] == proposal.tool_call_id


def test_state_patches_and_history_rebuild_a_conversation(run, client):
    first = client.lease(str(run.id), owner="proc-1")
    version = first.resume.state_version
    patched = first.patch_state(
        [{"op": "add", "path": "/turns", "value": 1}], state_version=version
    )
    assert patched == {"state": {"turns": 1}, "state_version": version + 1}
    with pytest.raises(StateVersionMismatch):
        first.patch_state([{"op": "add", "path": "/x", "value": 1}], state_version=version)
    with pytest.raises(PatchTestFailed):
        first.patch_state([{"op": "test", "path": "/turns", "value": 2}])
    appended = first.append_messages([{"role": "user", "content": "hi"}], after_seq=0)
    assert appended["last_seq"] == 1
    with pytest.raises(HistoryConflict) as conflict:
        first.append_messages([{"role": "user", "content": "again"}], after_seq=0)
    assert conflict.value.body["last_seq"] == 1
    expire_lease(run.id)

    second = client.lease(str(run.id), owner="proc-2")
    assert second.resume.state == {"turns": 1}
    assert second.messages() == [{"role": "user", "content": "hi"}]


def test_a_checkpointed_conversation_is_stored_once_and_rebuilt_by_the_next_process(run, client):
    """The adapters' checkpoints (``CallRouter.checkpoint``): only what is new goes to the
    history store, the step names the stored messages, a dead process's unnamed messages are
    skipped, and the run's state is never touched."""
    state_before = Run.objects.get(id=run.id).state
    crashed = client.lease(str(run.id), owner="proc-1")
    crashed.append_messages([{"role": "orphan"}])  # then died before its checkpoint
    expire_lease(run.id)

    second = CallRouter(client.lease(str(run.id), owner="proc-2"))
    assert second.last_checkpoint() is None
    asked = [{"role": "user", "content": "refund"}, {"role": "assistant", "call": 1}]
    second.checkpoint(lambda seq: asked, {"tool_calls": []})
    answered = [*asked, {"role": "tool", "result": 1}, {"role": "assistant", "call": 2}]
    seq = second.checkpoint(lambda seq: answered, {"tool_calls": []})
    assert [m["message"] for m in client.messages(str(run.id))] == [{"role": "orphan"}, *answered]
    assert Step.objects.get(run_id=run.id, seq=seq).output["history"] == [[2, 5]]
    expire_lease(run.id)

    third = CallRouter(client.lease(str(run.id), owner="proc-3"))
    assert third.last_checkpoint() == (seq, answered)
    # a framework that rewrote its last message: stored again from there, nothing overwritten
    rewritten = [*answered[:3], {"role": "assistant", "call": "2b"}]
    later = third.checkpoint(lambda seq: rewritten, {"tool_calls": []})
    assert Step.objects.get(run_id=run.id, seq=later).output["history"] == [[2, 4], [6, 6]]
    expire_lease(run.id)

    fourth = CallRouter(client.lease(str(run.id), owner="proc-4"))
    assert fourth.last_checkpoint() == (later, rewritten)
    assert Run.objects.get(id=run.id).state == state_before


def test_wait_for_run_returns_once_the_approval_is_decided(run, client, approver, monkeypatch):
    leased = client.lease(str(run.id), owner="proc-1")
    proposal = leased.propose("refund", {**REFUND, "amount_cents": 50000})
    assert proposal.decision == "awaiting_approval"

    def decide(seconds: float) -> None:
        approval_decide(
            approval_id=proposal.approval_id,
            decision="approve",
            actor=Actor.for_user(approver, "api"),
        )

    monkeypatch.setattr(longpoll, "sleep", decide)
    assert client.wait_for_run(str(run.id), timeout=60)["status"] == "queued"
    assert Approval.objects.get(id=proposal.approval_id).status == "approved"


def test_wait_for_run_waits_as_told_while_the_server_holds_all_it_may(
    run, client, approver, monkeypatch, settings
):
    """``long_polls_busy``: the client sleeps ``retry_after`` and reads again — no busy loop."""
    leased = client.lease(str(run.id), owner="proc-1")
    proposal = leased.propose("refund", {**REFUND, "amount_cents": 50000})
    settings.AGENTOPS = {**settings.AGENTOPS, "LONG_POLLS_PER_PROCESS": 0}
    slept: list[float] = []

    def client_sleeps(seconds: float) -> None:
        slept.append(seconds)
        settings.AGENTOPS = {**settings.AGENTOPS, "LONG_POLLS_PER_PROCESS": 5}
        approval_decide(
            approval_id=proposal.approval_id,
            decision="approve",
            actor=Actor.for_user(approver, "api"),
        )

    monkeypatch.setattr("agentops.client.time.sleep", client_sleeps)
    monkeypatch.setattr(longpoll, "sleep", lambda seconds: pytest.fail("held"))
    assert client.wait_for_run(str(run.id), timeout=60)["status"] == "queued"
    assert slept == [longpoll.BUSY_RETRY_AFTER]


def test_answers_and_errors_conform_to_the_schema(robot, run, in_process):
    api = schemathesis.openapi.from_wsgi("/api/schema/", application)
    headers = {"Authorization": f"Bearer {token_for(robot, 'schema')}"}
    with httpx.Client(base_url="http://testserver", transport=in_process, headers=headers) as http:
        leased = http.post(f"/api/v1/runs/{run.id}/lease/", json={"owner": "p"}).json()
        fence = {"fence": leased["fence"], "lease_token": leased["lease_token"]}
        runs = f"/api/v1/runs/{run.id}"
        propose = {**fence, "tool": "refund", "arguments": REFUND, "client_call_id": "c1"}
        answers = {
            ("/api/v1/runs/{run_id}/tool-calls/", "POST"): [
                http.post(f"{runs}/tool-calls/", json=propose),
                http.post(f"{runs}/tool-calls/", json=propose),
                http.post(
                    f"{runs}/tool-calls/",
                    json={**propose, "arguments": {**REFUND, "amount_cents": 9}},
                ),
            ],
            ("/api/v1/runs/{run_id}/state/", "POST"): [
                http.post(
                    f"{runs}/state/",
                    json={**fence, "patch": [{"op": "add", "path": "/a", "value": None}]},
                ),
                http.post(
                    f"{runs}/state/",
                    json={**fence, "patch": [{"op": "remove", "path": "/nope"}]},
                ),
                http.post(
                    f"{runs}/state/",
                    json={**fence, "patch": [{"op": "add", "path": "/a"}]},
                ),
            ],
            ("/api/v1/runs/{run_id}/messages/", "POST"): [
                http.post(f"{runs}/messages/", json={**fence, "messages": [{"m": 1}]}),
                http.post(
                    f"{runs}/messages/", json={**fence, "messages": [{"m": 2}], "after_seq": 0}
                ),
            ],
            ("/api/v1/runs/{run_id}/messages/", "GET"): [
                http.get(f"{runs}/messages/", params={"limit": 1}),
            ],
            ("/api/v1/runs/{run_id}/", "GET"): [
                http.get(f"{runs}/", params={"wait": 1}),
                http.get(f"{runs}/", params={"wait": 99}),
            ],
        }
        codes = {key: [a.status_code for a in found] for key, found in answers.items()}
        assert codes == {
            ("/api/v1/runs/{run_id}/tool-calls/", "POST"): [201, 200, 409],
            ("/api/v1/runs/{run_id}/state/", "POST"): [200, 409, 400],
            ("/api/v1/runs/{run_id}/messages/", "POST"): [201, 409],
            ("/api/v1/runs/{run_id}/messages/", "GET"): [200],
            ("/api/v1/runs/{run_id}/", "GET"): [200, 400],
        }, [a.content for found in answers.values() for a in found]
        for (path, method), found in answers.items():
            for answer in found:
                api[path][method].validate_response(answer)

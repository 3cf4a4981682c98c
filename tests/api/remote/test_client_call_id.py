"""A remote agent's own call id on propose (issue 27): the framework's tool-call id, unique in
the run. Proposed again — a retry, or a successor replaying its framework's history — it
answers the same call (whatever became of it), never a second one; with other arguments it is
``client_call_id_conflict``, like an idempotency key reused with another body."""

from __future__ import annotations

import itertools

import pytest
from django.db import IntegrityError, connection, transaction
from rest_framework.test import APIClient

from approvals.models import Approval
from runs.models import Run, Step, ToolCall
from tests.api.conftest import assert_error, token_for
from tests.api.remote.test_deadlines import _race
from tests.api.remote_support import Agent
from tests.support import expire_lease

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

REFUND = {"order_id": "ord_1", "amount_cents": 500}
BIG_REFUND = {"order_id": "ord_1", "amount_cents": 50000}
_tokens = itertools.count(1)


def client_for(user) -> APIClient:
    """Another process's client (a token of its own)."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(user, f'proc-{next(_tokens)}')}")
    return client


def _seq(run: Run) -> int:
    return Run.objects.get(id=run.id).event_seq


def test_the_id_is_stored_and_shown_in_the_answer(run, leased):
    proposed = leased.propose("refund", REFUND, client_call_id="call_abc123")

    assert proposed.status_code == 201, proposed.content
    assert proposed.json()["tool_call"]["client_call_id"] == "call_abc123"
    assert ToolCall.objects.get(run=run).client_call_id == "call_abc123"


def test_the_same_id_again_answers_the_same_call(run, leased):
    first = leased.propose("refund", REFUND, client_call_id="toolu_01")
    seq = _seq(run)

    again = leased.propose("refund", dict(reversed(REFUND.items())), client_call_id="toolu_01")

    assert again.status_code == 200, again.content
    assert again.json() == first.json()
    assert ToolCall.objects.filter(run=run).count() == 1
    assert Step.objects.filter(run=run).count() == 1
    assert _seq(run) == seq  # nothing recorded


def test_the_same_id_with_other_arguments_is_a_conflict(run, leased):
    first = leased.propose("refund", REFUND, client_call_id="toolu_01").json()

    other = leased.propose("refund", {**REFUND, "amount_cents": 600}, client_call_id="toolu_01")
    another_tool = leased.propose("lookup", {}, client_call_id="toolu_01")

    body = assert_error(other, 409, "client_call_id_conflict")
    assert body["tool_call"] == first["tool_call"]["id"]
    assert_error(another_tool, 409, "client_call_id_conflict")
    assert ToolCall.objects.filter(run=run).count() == 1


def test_a_settled_call_is_answered_again_after_a_successor_took_over(run, leased, robot):
    """The framework replays its history in a new process: the call it made before is
    answered as it stands (succeeded), never proposed a second time."""
    call = leased.propose("refund", REFUND, client_call_id="call_1").json()["tool_call"]
    assert leased.dispatch(call["id"]).json()["go"] is True
    receipt = leased.receipt(call["id"], outcome="succeeded", result={"refund_id": "rf_1"})
    assert receipt.status_code == 200, receipt.content
    expire_lease(run.id)
    successor = Agent(client_for(robot), run.id)
    assert successor.lease().status_code == 200

    again = successor.propose("refund", REFUND, client_call_id="call_1")

    assert again.status_code == 200, again.content
    assert again.json()["decision"] == "succeeded"
    assert again.json()["tool_call"]["id"] == call["id"]
    assert ToolCall.objects.filter(run=run).count() == 1
    # a new id is a new call
    assert successor.propose("refund", REFUND, client_call_id="call_2").status_code == 201
    assert ToolCall.objects.filter(run=run).count() == 2


def test_a_call_awaiting_approval_is_answered_to_its_proposer_after_the_lease_was_released(
    run, leased
):
    first = leased.propose("refund", BIG_REFUND, client_call_id="call_big")
    assert first.json()["decision"] == "awaiting_approval"
    assert Run.objects.get(id=run.id).status == Run.Status.WAITING_APPROVAL

    again = leased.propose("refund", BIG_REFUND, client_call_id="call_big")

    assert again.status_code == 200, again.content
    assert again.json()["approval"] == first.json()["approval"] is not None
    assert Approval.objects.filter(tool_call__run=run).count() == 1


def test_a_rejected_call_is_answered_as_rejected(run, leased, as_approver):
    call = leased.propose("refund", BIG_REFUND, client_call_id="call_big").json()
    decided = as_approver.post(
        f"/api/v1/approvals/{call['approval']}/decision/", {"decision": "reject"}
    )
    assert decided.status_code == 200, decided.content
    assert leased.lease().status_code == 200

    again = leased.propose("refund", BIG_REFUND, client_call_id="call_big")

    assert again.status_code == 200, again.content
    assert again.json()["decision"] == "rejected"


def test_an_earlier_fence_is_told_its_lease_is_lost(run, leased, robot):
    leased.propose("lookup", {}, client_call_id="call_1")
    stale = leased.fence
    expire_lease(run.id)
    assert Agent(client_for(robot), run.id).lease().status_code == 200
    leased.fence = stale

    assert_error(leased.propose("lookup", {}, client_call_id="call_1"), 409, "lease_lost")


def test_another_token_is_not_answered(run, leased, robot):
    leased.propose("lookup", {}, client_call_id="call_1")
    stranger = Agent(client_for(robot), run.id)
    stranger.fence, stranger.lease_token = leased.fence, "not-the-token"

    assert_error(stranger.propose("lookup", {}, client_call_id="call_1"), 403, "lease_not_yours")


@pytest.mark.parametrize(
    "bad",
    ["", "has space", "x" * 201, "tab\there", "é-accent", 17, None],
    ids=["empty", "space", "too-long", "tab", "non-ascii", "number", "null"],
)
def test_a_malformed_id_is_a_validation_error(run, leased, bad):
    answer = leased.propose("lookup", {}, client_call_id=bad)

    body = assert_error(answer, 400, "validation_error")
    assert "client_call_id" in body["fields"]
    assert not ToolCall.objects.filter(run=run).exists()


def test_the_database_keeps_one_call_per_id_in_a_run(run, leased):
    leased.propose("lookup", {}, client_call_id="call_1")
    call = ToolCall.objects.get(run=run)

    def another(client_call_id: str, seq: int) -> ToolCall:
        return ToolCall.objects.create(
            step=Step.objects.create(run=run, seq=seq, kind=Step.Kind.TOOL_CALL, incarnation=1),
            run=run,
            tool_name=call.tool_name,
            tool_version=call.tool_version,
            effect=call.effect,
            arguments_digest=call.arguments_digest,
            idempotency_key=f"other:{seq}",
            client_call_id=client_call_id,
        )

    with pytest.raises(IntegrityError), transaction.atomic():
        another("call_1", 98)
    # calls without an id are not constrained by it
    another("", 98)
    another("", 99)


def test_the_resume_packet_shows_the_id(run, leased, robot):
    leased.propose("refund", REFUND, client_call_id="call_1")
    expire_lease(run.id)
    successor = Agent(client_for(robot), run.id)
    assert successor.lease().status_code == 200

    (open_call,) = successor.resume["open_tool_calls"]
    assert open_call["client_call_id"] == "call_1"


@pytest.mark.django_db(transaction=True)
def test_simultaneous_proposals_under_one_id_make_one_call(robot, run, leased):
    if connection.vendor != "postgresql":
        pytest.skip("SQLite serialises writers; the race needs PostgreSQL")
    body = {
        "fence": leased.fence,
        "lease_token": leased.lease_token,
        "tool": "refund",
        "arguments": REFUND,
        "client_call_id": "call_race",
    }

    answers = _race(robot, f"/api/v1/runs/{run.id}/tool-calls/", body)

    assert sorted(a.status_code for a in answers) == [200, 200, 200, 201], [
        a.content for a in answers
    ]
    assert len({a.json()["tool_call"]["id"] for a in answers}) == 1
    assert ToolCall.objects.filter(run=run).count() == 1

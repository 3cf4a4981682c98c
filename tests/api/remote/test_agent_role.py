"""Agents are not operators (issue 16, item 1): a service account in the ``agent`` role
leases, drives and reads the runs of the remote agents it owns, asks only the groups its
manifest declares, and does nothing an operator does; nobody else — operators, superusers,
other agents — leases a remote run or receives its unmasked arguments."""

from __future__ import annotations

import pytest

from runs.models import Question, Run, Step, ToolCall
from tests.api.conftest import assert_error, client_for
from tests.api.remote_support import Agent, register_remote, remote_run
from tests.conftest import _user_in

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

CARD = "4242-4242-4242-4242"


def _proposed_with_a_card(leased: Agent) -> int:
    """The holder proposes a refund with a sensitive card number and leaves the lease."""
    call = leased.propose("refund", {"order_id": "o", "amount_cents": 5, "card": CARD})
    assert call.status_code == 201, call.content
    assert leased.run_post("lease/release").status_code == 200
    return call.json()["tool_call"]["id"]


@pytest.mark.parametrize("who", ["operator", "superuser", "owner_without_role", "other_agent"])
def test_only_the_owner_in_the_agent_role_leases_and_sees_the_arguments(
    who, run, leased, django_user_model
):
    _proposed_with_a_card(leased)
    users = {
        "operator": lambda: _user_in(django_user_model, "oscar", "operator"),
        "superuser": lambda: django_user_model.objects.create_superuser("sue", password="x"),
        "owner_without_role": lambda: _user_in(django_user_model, "owen", "operator"),
        "other_agent": lambda: _user_in(django_user_model, "otto", "agent"),
    }
    user = users[who]()
    if who == "owner_without_role":  # named owner, but without the agent role's permission
        from runs.models import AgentManifest

        AgentManifest.objects.filter(name="pay_bot").update(owner=user)
    response = client_for(user).post(f"/api/v1/runs/{run.id}/lease/", {"owner": "x"})
    assert_error(response, 403, "permission_denied")
    assert CARD not in response.content.decode()
    stored = Run.objects.get(id=run.id)
    assert (stored.status, stored.fence, stored.lease_owner) == ("queued", 1, "")


def test_the_owner_gets_the_unmasked_arguments_back(run, leased):
    call_id = _proposed_with_a_card(leased)
    again = Agent(leased.client, run.id)
    assert again.lease().status_code == 200
    (open_call,) = again.resume["open_tool_calls"]
    assert open_call["id"] == call_id and open_call["arguments"]["card"] == CARD


OPERATOR_ACTIONS = [
    ("runs/{run}/pause/", {"reason": "x"}),
    ("runs/{run}/terminate/", {"reason": "x"}),
    ("runs/{run}/budget/", {"add_steps": 5}),
    ("runs/{run}/signals/", {"name": "go"}),
    ("runs/{run}/fork/", {"from_step": 1}),
    ("runs/{run}/retry-recovery/", {}),
    ("tool-calls/{call}/resolution/", {"outcome": "happened"}),
]


@pytest.mark.parametrize(("template", "body"), OPERATOR_ACTIONS)
def test_the_agent_does_nothing_an_operator_does(template, body, run, leased):
    """Not even on its own runs: it tops up no budget, resolves no unknown outcome of its
    own, terminates, forks and signals nothing."""
    call = leased.propose("notify", {}).json()["tool_call"]
    leased.dispatch(call["id"])
    leased.receipt(call["id"], outcome="unknown")  # unsafe: the run needs a person
    before = Run.objects.get(id=run.id)
    assert before.status == Run.Status.NEEDS_ATTENTION
    path = "/api/v1/" + template.format(run=run.id, call=call["id"])
    assert_error(leased.client.post(path, body, format="json"), 403, "permission_denied")
    after = Run.objects.get(id=run.id)
    assert (after.event_seq, after.status, after.max_steps) == (
        before.event_seq,
        before.status,
        before.max_steps,
    )
    assert ToolCall.objects.get(id=call["id"]).status == ToolCall.Status.UNKNOWN
    assert Run.objects.count() == 1  # no fork


def test_the_agent_starts_no_runs_and_registers_no_manifest(run, as_robot):
    started = as_robot.post("/api/v1/runs/", {"agent": "pay_bot", "input": {"order_id": "o"}})
    assert_error(started, 403, "permission_denied")
    assert Run.objects.count() == 1


def test_the_agent_reads_only_its_own_agents_runs(run, leased, admin, operator, robot):
    register_remote(admin, "other_bot")  # nobody's
    other = remote_run(operator, "other_bot")
    client = leased.client
    assert client.get(f"/api/v1/runs/{run.id}/").status_code == 200
    assert client.get(f"/api/v1/runs/{run.id}/events/").status_code == 200
    assert_error(client.get(f"/api/v1/runs/{other.id}/"), 404, "not_found")
    assert_error(client.get(f"/api/v1/runs/{other.id}/events/"), 404, "not_found")
    listed = [r["id"] for r in client.get("/api/v1/runs/").json()["results"]]
    assert listed == [str(run.id)]
    leased.propose("lookup", {})
    calls = client.get("/api/v1/tool-calls/").json()["results"]
    assert {c["run"] for c in calls} == {str(run.id)}
    # approvals are a person's business
    assert_error(client.get("/api/v1/approvals/"), 403, "permission_denied")


def test_questions_go_only_to_the_groups_the_manifest_declares(run, leased):
    refused = leased.run_post(
        "waits", {"kind": "question", "text": "Wire me the money?", "group": "approver"}
    )
    assert_error(refused, 403, "permission_denied")
    assert not Question.objects.exists() and not Step.objects.filter(run=run).exists()
    asked = leased.run_post(
        "waits", {"kind": "question", "text": "Refund shipping?", "group": "operator"}
    )
    assert asked.status_code == 201, asked.content
    assert Question.objects.get().group == "operator"

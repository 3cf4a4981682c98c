"""Approvals over the API: list, read and decide through approval_decide."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.models import Approval, ApprovalDecision
from runs.models import Run, RunEvent, ToolCall
from tests.api.conftest import assert_error, client_for

# each request commits or rolls back on its own, as in production
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("roles")]


def _approval(run: Run) -> Approval:
    return Approval.objects.get(run=run)


def test_list_pending_masks_sensitive_arguments(as_approver, waiting_run):
    response = as_approver.get("/api/v1/approvals/", {"status": "pending"})

    assert response.status_code == 200
    (item,) = response.json()["results"]
    assert item["id"] == _approval(waiting_run).id
    assert item["run"] == str(waiting_run.id)
    assert item["arguments"] == {"amount_cents": 500, "card": "***"}
    assert item["decisions"] == []
    assert as_approver.get("/api/v1/approvals/", {"status": "approved"}).json()["results"] == []


def test_list_filters_by_run(as_approver, waiting_run):
    other = as_approver.get("/api/v1/approvals/", {"run": "00000000-0000-0000-0000-000000000000"})
    assert other.json()["results"] == []
    mine = as_approver.get("/api/v1/approvals/", {"run": str(waiting_run.id)})
    assert len(mine.json()["results"]) == 1


def test_list_bad_filter(as_approver):
    data = assert_error(
        as_approver.get("/api/v1/approvals/", {"status": "nope"}), 400, "validation_error"
    )
    assert "status" in data["fields"]


def test_list_and_detail_need_view_permission(as_viewer, waiting_run):
    assert_error(as_viewer.get("/api/v1/approvals/"), 403, "permission_denied")
    url = f"/api/v1/approvals/{_approval(waiting_run).id}/"
    assert_error(as_viewer.get(url), 403, "permission_denied")


def test_detail(as_approver, waiting_run):
    approval = _approval(waiting_run)
    data = as_approver.get(f"/api/v1/approvals/{approval.id}/").json()
    assert (data["id"], data["status"], data["tool_name"]) == (approval.id, "pending", "api_pay")
    assert_error(as_approver.get("/api/v1/approvals/999999/"), 404, "not_found")


def test_approve_makes_the_run_runnable_and_records_the_api_channel(
    as_approver, approver, waiting_run
):
    approval = _approval(waiting_run)

    response = as_approver.post(
        f"/api/v1/approvals/{approval.id}/decision/", {"decision": "approve", "comment": "ok"}
    )

    assert response.status_code == 200, response.json()
    data = response.json()
    assert data["status"] == "approved"
    assert data["decisions"][0] == {
        **data["decisions"][0],
        "decider": approver.username,
        "decision": "approve",
        "channel": "api",
        "comment": "ok",
    }
    assert Run.objects.get(id=waiting_run.id).status == Run.Status.QUEUED
    assert ToolCall.objects.get(run=waiting_run).status == ToolCall.Status.APPROVED
    event = RunEvent.objects.get(run=waiting_run, type="approval.decided")
    assert (event.actor, event.channel) == ("token:token-alice", "api")


def test_reject(as_approver, waiting_run):
    approval = _approval(waiting_run)
    response = as_approver.post(
        f"/api/v1/approvals/{approval.id}/decision/", {"decision": "reject"}
    )
    assert response.json()["status"] == "rejected"
    assert ToolCall.objects.get(run=waiting_run).status == ToolCall.Status.REJECTED


def test_second_decision_is_already_decided(as_approver, waiting_run):
    url = f"/api/v1/approvals/{_approval(waiting_run).id}/decision/"
    as_approver.post(url, {"decision": "approve"})

    assert_error(as_approver.post(url, {"decision": "reject"}), 409, "already_decided")
    assert _approval(waiting_run).status == Approval.Status.APPROVED


def test_expired_approval_cannot_be_decided(as_approver, waiting_run):
    approval = _approval(waiting_run)
    Approval.objects.filter(id=approval.id).update(expires_at=timezone.now() - timedelta(seconds=1))

    response = as_approver.post(
        f"/api/v1/approvals/{approval.id}/decision/", {"decision": "approve"}
    )

    assert_error(response, 409, "approval_expired")
    assert not ApprovalDecision.objects.exists()


def test_decision_needs_the_decide_permission(as_operator, as_viewer, waiting_run):
    url = f"/api/v1/approvals/{_approval(waiting_run).id}/decision/"
    assert_error(as_operator.post(url, {"decision": "approve"}), 403, "permission_denied")
    assert_error(as_viewer.post(url, {"decision": "approve"}), 403, "permission_denied")
    assert not ApprovalDecision.objects.exists()


def test_the_principal_may_not_approve_its_own_run(api_agents, django_user_model):
    from django.contrib.auth.models import Group

    from runs.actors import Actor
    from runs.services import run_create
    from tests.conftest import drive

    both = django_user_model.objects.create_user("both")
    both.groups.add(*Group.objects.filter(name__in=["operator", "approver"]))
    run = run_create(
        agent_name="api_payer", input={"amount_cents": 1}, actor=Actor.for_user(both, "api")
    )
    run = drive(run.id)

    response = client_for(both).post(
        f"/api/v1/approvals/{_approval(run).id}/decision/", {"decision": "approve"}
    )

    assert_error(response, 403, "permission_denied")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "decision"),
        ({"decision": "maybe"}, "decision"),
        ({"decision": "approve", "arguments": {"amount_cents": 0}}, "arguments"),
        ({"decision": "reject", "arguments": {"amount_cents": 5}}, "arguments"),
        ({"decision": "approve", "comment": "x" * 2001}, "comment"),
    ],
)
def test_decision_bad_input(as_approver, waiting_run, body, field):
    url = f"/api/v1/approvals/{_approval(waiting_run).id}/decision/"
    data = assert_error(as_approver.post(url, body), 400, "validation_error")
    assert field in data["fields"]
    assert _approval(waiting_run).status == Approval.Status.PENDING


def test_decision_on_a_missing_approval(as_approver):
    response = as_approver.post("/api/v1/approvals/999999/decision/", {"decision": "approve"})
    assert_error(response, 404, "not_found")

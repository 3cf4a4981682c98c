"""The remote-agent protocol: lease, heartbeat, release, steps, propose, dispatch, receipt,
finish — one state machine with hosted agents, every write fenced."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.models import Approval
from runs import engine, remote, sweeper
from runs.actors import Actor
from runs.models import Run, Step, ToolCall, ToolReceipt
from runs.services import run_pause, run_terminate
from tests.api.conftest import assert_error, client_for, start
from tests.api.remote_support import Agent
from tests.support import event_types, events, expire_lease, rewind

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


def _seq(run: Run) -> int:
    return Run.objects.get(id=run.id).event_seq


# --- the lease ------------------------------------------------------------------------------


def test_lease_returns_fence_and_resume_packet(run, agent):
    response = agent.lease(owner="host-1:123")

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["fence"] == 1
    assert body["resume"]["state"] == {} and body["resume"]["steps"] == []
    assert body["resume"]["open_tool_calls"] == [] and body["resume"]["unknown_outcomes"] == []
    run.refresh_from_db()
    assert run.status == Run.Status.RUNNING
    assert run.lease_owner == "token:token-robby#host-1:123"
    claimed = events(run.id, "run.claimed")[0]
    assert (claimed.actor, claimed.channel) == ("token:token-robby#host-1:123", "api")


def test_second_process_gets_lease_held(robot, run, leased, operator):
    other = Agent(client_for_second(robot), run.id)
    assert_error(other.lease(), 409, "lease_held")


def client_for_second(user):
    from rest_framework.test import APIClient

    from tests.api.conftest import token_for

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(user, 'second')}")
    return client


def test_hosted_runs_are_not_leased(as_robot, api_agents):
    hosted = start()
    assert_error(as_robot.post(f"/api/v1/runs/{hosted.id}/lease/"), 409, "invalid_state")


def test_lease_needs_operate_permission(run, as_viewer, anonymous):
    assert_error(as_viewer.post(f"/api/v1/runs/{run.id}/lease/"), 403, "permission_denied")
    assert_error(anonymous.post(f"/api/v1/runs/{run.id}/lease/"), 401, "not_authenticated")


def test_lease_of_a_missing_run(as_robot):
    response = as_robot.post("/api/v1/runs/00000000-0000-0000-0000-000000000000/lease/")
    assert_error(response, 404, "not_found")


def test_lease_bad_input(as_robot, run):
    response = as_robot.post(f"/api/v1/runs/{run.id}/lease/", {"owner": "x" * 101})
    assert "owner" in assert_error(response, 400, "validation_error")["fields"]


def test_finished_run_is_not_leased(run, agent, operator):
    run_terminate(run_id=run.id, actor=Actor.for_user(operator, "api"), reason="done")
    assert_error(agent.lease(), 409, "invalid_state")


def test_heartbeat_extends_and_reports_requests(run, leased, operator):
    before = Run.objects.get(id=run.id).lease_expires_at
    response = leased.run_post("lease/heartbeat")
    assert response.status_code == 200
    assert response.json()["requested_action"] == ""
    assert Run.objects.get(id=run.id).lease_expires_at >= before

    run_pause(run_id=run.id, actor=Actor.for_user(operator, "web"), reason="look")
    assert leased.run_post("lease/heartbeat").json()["requested_action"] == "pause"


def test_stale_fence_is_lease_lost_and_changes_nothing(run, leased):
    seq = _seq(run)
    stale = Agent(leased.client, run.id)
    stale.fence = leased.fence + 5
    stale.lease_token = leased.lease_token
    for response in (
        stale.run_post("lease/heartbeat"),
        stale.run_post("steps", {"state": {"x": 1}}),
        stale.propose("lookup", {}),
        stale.run_post("finish", {"result": {}}),
        stale.run_post("lease/release"),
    ):
        assert_error(response, 409, "lease_lost")
    assert _seq(run) == seq
    assert Run.objects.get(id=run.id).state == {}


def test_fence_is_required(run, leased):
    response = leased.client.post(f"/api/v1/runs/{run.id}/steps/", {"state": {}})
    assert "fence" in assert_error(response, 400, "validation_error")["fields"]


def test_release_gives_the_lease_back(run, leased):
    response = leased.run_post("lease/release")
    assert response.status_code == 200
    assert response.json()["status"] == "queued"
    assert Run.objects.get(id=run.id).lease_owner == ""
    # the released fence writes nothing more
    assert_error(leased.run_post("steps", {}), 409, "lease_lost")
    # workers never take it
    assert engine.advance(run.id, worker="w") == "not_claimed"
    assert run.id not in sweeper.runnable_orphans()


# --- steps --------------------------------------------------------------------------------


def test_step_checkpoints_decision_state_and_usage(run, leased):
    response = leased.run_post(
        "steps",
        {
            "input": {"prompt": "plan"},
            "output": {"plan": ["refund"]},
            "state": {"n": 1},
            "cost": "0.25",
            "tokens": 120,
        },
    )

    assert response.status_code == 201, response.content
    assert response.json()["seq"] == 1 and response.json()["kind"] == "decision"
    run.refresh_from_db()
    assert run.state == {"n": 1} and run.state_version == 1
    assert (run.steps_used, run.tokens_used, str(run.cost_used)) == (1, 120, "0.250000")
    assert "step.decided" in event_types(run.id)


def test_step_over_budget_is_budget_exhausted(run, leased):
    Run.objects.filter(id=run.id).update(max_steps=1, steps_used=1)
    assert_error(leased.run_post("steps", {}), 409, "budget_exhausted")
    run.refresh_from_db()
    assert (run.status, run.reason_code) == ("needs_attention", "budget_exhausted")


def test_step_bad_input(run, leased):
    response = leased.run_post("steps", {"state": [1], "tokens": -1})
    fields = assert_error(response, 400, "validation_error")["fields"]
    assert {"state", "tokens"} <= set(fields)


# --- a call without approval: propose, dispatch, receipt, finish ----------------------------------


def test_small_refund_goes_through_dispatch_receipt_and_finish(run, leased):
    proposed = leased.propose(
        "refund", {"order_id": "ord_1", "amount_cents": 500, "card": "4242-4242-SECRET"}
    )
    assert proposed.status_code == 201, proposed.content
    body = proposed.json()
    assert body["decision"] == "approved" and body["approval"] is None
    call = body["tool_call"]
    assert call["status"] == "proposed"
    assert call["arguments"]["card"] == "***"  # masked everywhere but the lease holder's view
    assert call["tool_name"] == "pay_bot/refund"

    dispatched = leased.dispatch(call["id"])
    assert dispatched.status_code == 200, dispatched.content
    assert dispatched.json()["go"] is True
    assert dispatched.json()["idempotency_key"] == f"{run.id}:1"
    assert dispatched.json()["arguments"]["card"] == "4242-4242-SECRET"
    assert ToolCall.objects.get(id=call["id"]).status == "dispatching"
    # a retried dispatch request is answered the same, not counted twice
    assert leased.dispatch(call["id"]).json()["attempt"] == 1

    receipt = leased.receipt(
        call["id"],
        outcome="succeeded",
        result={"refund_id": "rf_1"},
        external_ref="rf_1",
        state={"refunded": True},
    )
    assert receipt.status_code == 200, receipt.content
    assert receipt.json()["status"] == "succeeded"
    assert receipt.json()["receipt"]["source"] == "agent"
    assert Step.objects.get(run=run, seq=1).status == "completed"
    assert Run.objects.get(id=run.id).state == {"refunded": True}

    finished = leased.run_post("finish", {"result": {"ok": True}})
    assert finished.status_code == 200
    assert finished.json()["status"] == "succeeded"
    assert finished.json()["result"] == {"ok": True}
    assert event_types(run.id)[-1] == "run.succeeded"


def test_propose_refused_for_a_tool_not_in_the_manifest(run, leased):
    body = leased.propose("wire_money", {}).json()
    assert body["decision"] == "refused" and body["tool_call"] is None
    assert "may not use tool" in body["error"]
    assert Step.objects.get(run=run, seq=1).status == "failed"


def test_propose_refused_for_arguments_breaking_the_schema(run, leased):
    body = leased.propose("refund", {"order_id": "ord_1"}).json()
    assert body["decision"] == "refused" and "amount_cents" in body["error"]


def test_one_open_call_at_a_time(run, leased):
    leased.propose("lookup", {})
    # another call (a retry of the same one gets that call: tests/api/remote/test_retries.py)
    assert_error(leased.propose("notify", {}), 409, "invalid_state")
    assert_error(leased.propose("lookup", {"other": 1}), 409, "invalid_state")
    assert_error(leased.run_post("steps", {}), 409, "invalid_state")
    assert_error(leased.run_post("finish", {}), 409, "invalid_state")


def test_receipt_needs_a_dispatched_call(run, leased):
    call = leased.propose("lookup", {}).json()["tool_call"]
    assert_error(leased.receipt(call["id"], outcome="succeeded"), 409, "invalid_state")
    response = leased.receipt(call["id"], outcome="maybe")
    assert "outcome" in assert_error(response, 400, "validation_error")["fields"]
    assert_error(
        leased.post("tool-calls/999999/receipt/", {"outcome": "succeeded"}), 404, "not_found"
    )


def test_finish_failed_needs_a_reason(run, leased):
    response = leased.run_post("finish", {"status": "failed"})
    assert_error(response, 400, "validation_error")
    response = leased.run_post("finish", {"status": "failed", "reason": "gave up"})
    assert response.json()["status"] == "failed"
    assert response.json()["reason_code"] == "agent_failed"


# --- approvals --------------------------------------------------------------------------------


def test_large_refund_waits_for_approval_and_dispatch_consumes_it(
    run, leased, as_approver, second_approver
):
    proposed = leased.propose("refund", {"order_id": "ord_1", "amount_cents": 20000}).json()
    assert proposed["decision"] == "awaiting_approval"
    approval_id = proposed["approval"]
    run.refresh_from_db()
    assert run.status == "waiting_approval" and run.lease_owner == ""
    # waiting releases the lease: the old fence writes nothing
    assert_error(leased.run_post("lease/heartbeat"), 409, "lease_lost")

    decided = as_approver.post(
        f"/api/v1/approvals/{approval_id}/decision/",
        {
            "decision": "approve",
            "comment": "ok, but less",
            "arguments": {"order_id": "ord_1", "amount_cents": 15000},
        },
    )
    assert decided.status_code == 200, decided.content
    assert decided.json()["decisions"][0]["edited_arguments"]["amount_cents"] == 15000
    # an edit counts as its author's approval; one more person approves what was changed
    assert Run.objects.get(id=run.id).status == "waiting_approval"
    second = client_for(second_approver).post(
        f"/api/v1/approvals/{approval_id}/decision/", {"decision": "approve"}
    )
    assert second.status_code == 200, second.content
    assert Run.objects.get(id=run.id).status == "queued"

    assert leased.lease().status_code == 200
    (open_call,) = leased.resume["open_tool_calls"]
    assert open_call["status"] == "approved" and open_call["approval"] == approval_id
    dispatched = leased.dispatch(open_call["id"]).json()
    assert dispatched["go"] is True
    assert dispatched["arguments"]["amount_cents"] == 15000
    assert Approval.objects.get(id=approval_id).consumed_at is not None


def test_rejected_call_fails_its_step_at_the_next_lease(run, leased, as_approver):
    approval_id = leased.propose("refund", {"order_id": "o", "amount_cents": 20000}).json()[
        "approval"
    ]
    as_approver.post(
        f"/api/v1/approvals/{approval_id}/decision/", {"decision": "reject", "comment": "no"}
    )
    leased.lease()
    assert leased.resume["open_tool_calls"] == []
    assert leased.resume["steps"][-1]["status"] == "failed"
    assert "rejected" in leased.resume["steps"][-1]["error"]


def test_precondition_changed_cancels_the_call(run, leased):
    call = leased.propose("charge", {}, precondition="balance:100").json()["tool_call"]
    response = leased.dispatch(call["id"], precondition="balance:40").json()
    assert response["go"] is False
    assert response["tool_call"]["status"] == "cancelled"
    assert Step.objects.get(run=run, seq=1).status == "failed"


def test_precondition_unchanged_dispatches(run, leased):
    call = leased.propose("charge", {}, precondition="balance:100").json()["tool_call"]
    assert leased.dispatch(call["id"], precondition="balance:100").json()["go"] is True


# --- a process that dies --------------------------------------------------------------------


def test_expired_lease_goes_back_to_queued_and_dispatching_is_unknown(robot, run, leased, operator):
    call = leased.propose("refund", {"order_id": "o", "amount_cents": 5}).json()["tool_call"]
    leased.dispatch(call["id"])
    expire_lease(run.id)

    assert remote.remote_leases_expire() == 1
    run.refresh_from_db()
    assert run.status == "queued" and run.reason_detail == "waiting for an agent process"
    assert events(run.id, "run.lease_expired")[0].payload["fence"] == leased.fence
    assert_error(leased.receipt(call["id"], outcome="succeeded"), 409, "lease_lost")

    second = Agent(client_for_second(robot), run.id)
    assert second.lease().status_code == 200
    assert second.fence == leased.fence + 1
    (unknown,) = second.resume["unknown_outcomes"]
    assert unknown["id"] == call["id"] and unknown["status"] == "unknown"
    assert unknown["idempotency_key"] == f"{run.id}:1"
    # never silently dispatched again
    assert_error(second.dispatch(call["id"]), 409, "reconcile_required")

    found = second.receipt(
        call["id"],
        outcome="succeeded",
        source="reconciliation",
        result={"refund_id": "rf_9"},
        external_ref="rf_9",
    )
    assert found.json()["status"] == "succeeded"
    receipt = ToolReceipt.objects.get(tool_call_id=call["id"])
    assert receipt.source == "reconciliation"
    assert "tool.reconcile_attempted" in event_types(run.id)


def test_reconciled_absent_is_dispatched_again_with_the_same_key_once_it_cannot_land(
    robot, run, leased, operator
):
    call = leased.propose("refund", {"order_id": "o", "amount_cents": 5}).json()["tool_call"]
    leased.dispatch(call["id"])
    expire_lease(run.id)
    second = Agent(client_for_second(robot), run.id)
    second.lease()

    # a lookup begun while the first request may still land: its absent proves nothing
    early = second.lookup(call["id"]).json()
    assert early["absent_allows_resend"] is False
    refused = second.receipt(
        call["id"], outcome="absent", source="reconciliation", lookup=early["lookup"]
    )
    assert assert_error(refused, 409, "lookup_too_early")["resend_after"] == early["resend_after"]
    assert_error(second.dispatch(call["id"]), 409, "reconcile_required")

    rewind(run.id)  # the landing deadline has passed; a new lookup begins after it
    late = second.lookup(call["id"]).json()
    assert late["lookup"] == early["lookup"] + 1 and late["absent_allows_resend"] is True
    absent = second.receipt(
        call["id"], outcome="absent", source="reconciliation", lookup=late["lookup"]
    )
    assert absent.json()["status"] == "unknown" and absent.json()["run_status"] == "running"
    again = second.dispatch(call["id"]).json()
    assert again["go"] is True and again["idempotency_key"] == f"{run.id}:1"
    assert again["attempt"] == 2


def test_unsafe_unknown_outcome_goes_to_a_person(robot, run, leased, operator):
    call = leased.propose("notify", {}).json()["tool_call"]
    leased.dispatch(call["id"])
    expire_lease(run.id)
    second = Agent(client_for_second(robot), run.id)

    assert_error(second.lease(), 409, "invalid_state")
    run.refresh_from_db()
    assert (run.status, run.reason_code) == ("needs_attention", "unknown_outcome")


def test_agent_reports_an_unknown_outcome(run, leased):
    call = leased.propose("refund", {"order_id": "o", "amount_cents": 5}).json()["tool_call"]
    leased.dispatch(call["id"])
    response = leased.receipt(call["id"], outcome="unknown", result="timed out")
    assert response.json()["status"] == "unknown"
    assert "tool.unknown" in event_types(run.id)


def test_claim_of_an_unexpired_dead_lease_counts_a_recovery(robot, run, leased, operator):
    Run.objects.filter(id=run.id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    second = Agent(client_for_second(robot), run.id)
    assert second.lease().status_code == 200
    assert events(run.id, "run.claimed")[-1].payload["recovered"] is True


# --- operators -------------------------------------------------------------------------------


def test_pause_request_is_honoured_at_the_next_write(run, leased, operator):
    run_pause(run_id=run.id, actor=Actor.for_user(operator, "web"), reason="look")
    assert_error(leased.run_post("steps", {}), 409, "lease_lost")
    assert Run.objects.get(id=run.id).status == "paused"


def test_terminate_request_after_dispatch_still_records_the_receipt(run, leased, operator):
    call = leased.propose("refund", {"order_id": "o", "amount_cents": 5}).json()["tool_call"]
    leased.dispatch(call["id"])
    run_terminate(run_id=run.id, actor=Actor.for_user(operator, "web"), reason="stop")

    response = leased.receipt(call["id"], outcome="succeeded", result={"refund_id": "rf"})
    assert response.json()["status"] == "succeeded"
    assert Run.objects.get(id=run.id).status == "terminated"


FENCED = [
    "runs/{run}/lease/heartbeat/",
    "runs/{run}/lease/release/",
    "runs/{run}/steps/",
    "runs/{run}/tool-calls/",
    "runs/{run}/finish/",
    "tool-calls/{call}/dispatch/",
    "tool-calls/{call}/send-check/",
    "tool-calls/{call}/lookups/",
    "tool-calls/{call}/receipt/",
]
VALID = {
    "runs/{run}/tool-calls/": {"tool": "lookup", "arguments": {}},
    "tool-calls/{call}/receipt/": {"outcome": "succeeded"},
    "tool-calls/{call}/send-check/": {"attempt": 1},
}


def _path(template: str, run: Run, call_id: int) -> str:
    return "/api/v1/" + template.format(run=run.id, call=call_id)


@pytest.mark.parametrize("template", FENCED)
def test_fenced_endpoints_refuse_viewers_strangers_and_bad_input(
    template, run, leased, as_viewer, anonymous
):
    call_id = leased.propose("lookup", {}).json()["tool_call"]["id"]
    seq = _seq(run)
    body = {"fence": leased.fence, "lease_token": leased.lease_token, **VALID.get(template, {})}
    path = _path(template, run, call_id)

    assert_error(as_viewer.post(path, body), 403, "permission_denied")
    assert_error(anonymous.post(path, body), 401, "not_authenticated")
    bad = leased.client.post(path, {**body, "fence": "not a number"})
    assert "fence" in assert_error(bad, 400, "validation_error")["fields"]
    assert _seq(run) == seq


@pytest.mark.parametrize("template", FENCED)
def test_fenced_endpoints_on_missing_objects(template, leased):
    path = "/api/v1/" + template.format(run="00000000-0000-0000-0000-000000000000", call=999999)
    body = {"fence": 1, "lease_token": leased.lease_token, **VALID.get(template, {})}
    assert_error(leased.client.post(path, body), 404, "not_found")


def test_console_shows_a_remote_run(run, leased, client, operator):
    """The console's run page and list work for a remote agent's run (the registry resolves
    its manifest like a hosted agent)."""
    call = leased.propose(
        "refund", {"order_id": "o", "amount_cents": 5, "card": "4242-4242-SECRET"}
    )
    leased.dispatch(call.json()["tool_call"]["id"])
    client.force_login(operator)

    page = client.get(f"/runs/{run.id}/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "pay_bot/refund" in html and "4242-4242-SECRET" not in html
    assert client.get("/runs/").status_code == 200


def test_operator_resolves_an_unsafe_unknown_and_the_agent_goes_on(robot, run, leased, operator):
    call = leased.propose("notify", {}).json()["tool_call"]
    leased.dispatch(call["id"])
    expire_lease(run.id)
    second = Agent(client_for_second(robot), run.id)
    second.lease()  # needs_attention: unknown_outcome

    # the agent may not settle its own unknown outcome: a person does
    resolution = {"outcome": "happened", "external_ref": "msg-1"}
    path = f"/api/v1/tool-calls/{call['id']}/resolution/"
    assert_error(second.client.post(path, resolution), 403, "permission_denied")
    assert ToolCall.objects.get(id=call["id"]).status == ToolCall.Status.UNKNOWN
    resolved = client_for(operator).post(path, resolution)
    assert resolved.status_code == 200, resolved.content

    assert second.lease().status_code == 200
    assert second.resume["unknown_outcomes"] == []
    assert second.resume["steps"][-1]["status"] == "completed"
    assert second.run_post("finish", {"result": {}}).json()["status"] == "succeeded"


def test_the_recovery_limit_parks_a_remote_run_whose_leases_keep_expiring(
    robot, run, leased, settings
):
    """The one resume checklist (engine.resume_checks): a remote run's recovery is counted
    when its lease expires, so the claim after one expiry too many parks it for a person
    (``recovery_limit``) instead of leasing it again."""
    settings.AGENTOPS = {**settings.AGENTOPS, "MAX_RECOVERIES": 1}
    expire_lease(run.id)
    assert remote.remote_leases_expire() == 1
    second = Agent(client_for_second(robot), run.id)
    assert second.lease().status_code == 200  # 1 recovery: within the limit
    expire_lease(run.id)
    assert remote.remote_leases_expire() == 1
    assert second.lease().status_code == 409
    run.refresh_from_db()
    assert (run.status, run.reason_code) == ("needs_attention", "recovery_limit")
    assert "recovered 2 times (limit 1)" in run.reason_detail

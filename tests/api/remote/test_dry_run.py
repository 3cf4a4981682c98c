"""Dry runs of a remote agent (issue 23 item 5): its process executes its tools itself, so a
dry run is a flag — in the lease, the resume packet and every dispatch answer ("do not
execute") — and its receipts of such calls are recorded as simulated."""

from __future__ import annotations

import pytest

from runs.actors import Actor
from runs.models import Run, ToolCall, ToolReceipt
from runs.services import run_create
from tests.api.remote_support import Agent, register_remote
from tests.support import events

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


@pytest.fixture
def dry(admin, operator, robot, as_robot) -> Agent:
    register_remote(admin, owner=robot)
    run = run_create(
        agent_name="pay_bot",
        input={"order_id": "ord_1001"},
        actor=Actor.for_user(operator, "api"),
        dry_run=True,  # a remote agent's tools need no dry_run: its process simulates
    )
    return Agent(as_robot, run.id)


def _dispatched(agent: Agent, tool: str, arguments: dict) -> tuple[int, dict]:
    call_id = agent.propose(tool, arguments).json()["tool_call"]["id"]
    answer = agent.dispatch(call_id)
    assert answer.status_code == 200, answer.content
    return call_id, answer.json()


def test_the_lease_the_resume_packet_and_each_dispatch_say_do_not_execute(dry):
    lease = dry.lease(owner="proc-1").json()
    assert lease["dry_run"] is True and lease["resume"]["dry_run"] is True

    call_id, answer = _dispatched(dry, "refund", {"order_id": "ord_1001", "amount_cents": 500})

    assert (answer["go"], answer["dry_run"], answer["execute"]) == (True, True, False)
    assert "do not execute" in answer["reason"]
    # a read is called for real in a dry run
    dry.receipt(call_id, outcome="succeeded", result={"would": "refund 5.00"})
    read_id, read = _dispatched(dry, "lookup", {})
    assert (read["dry_run"], read["execute"]) == (True, True)
    # a repeated dispatch is answered the same
    repeated = dry.dispatch(read_id).json()
    assert repeated["replayed"] is True and repeated["execute"] is True


def test_receipts_of_a_dry_run_are_recorded_as_simulated(dry):
    dry.lease()
    call_id, _ = _dispatched(dry, "refund", {"order_id": "ord_1001", "amount_cents": 500})

    response = dry.receipt(call_id, outcome="succeeded", result={"would": "refund 5.00"})

    assert response.status_code == 200, response.content
    receipt = ToolReceipt.objects.get(tool_call_id=call_id)
    assert receipt.source == ToolReceipt.Source.SIMULATED
    assert events(dry.run_id, "tool.succeeded")[-1].payload["source"] == "simulated"
    assert events(dry.run_id, "tool.dispatching")[-1].payload["simulated"] is True
    # a retried receipt is the same receipt
    again = dry.receipt(call_id, outcome="succeeded", result={"would": "refund 5.00"})
    assert again.status_code == 200
    assert ToolCall.objects.get(id=call_id).status == ToolCall.Status.SUCCEEDED
    assert dry.run_post("finish", {"status": "succeeded"}).status_code == 200
    assert Run.objects.get(id=dry.run_id).status == Run.Status.SUCCEEDED


def test_a_real_remote_run_is_told_to_execute(run, leased):
    assert leased.resume["dry_run"] is False
    _, answer = _dispatched(leased, "lookup", {})
    assert (answer["dry_run"], answer["execute"]) == (False, True)

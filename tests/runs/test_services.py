"""Service functions (CONVENTIONS §1): permission, guard, one transaction, an event naming
the actor. Operators never bump the fence under a working process."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import transaction

from approvals.models import Approval
from approvals.services import AlreadyDecided, approval_decide
from runs import engine
from runs.actors import Actor, PermissionDenied
from runs.models import Run, RunEvent, Step, ToolCall
from runs.registry import CallTool, Finish, UnknownAgent
from runs.services import (
    InvalidInput,
    InvalidState,
    run_create,
    run_pause,
    run_resume,
    run_terminate,
)
from tests.conftest import drive
from tests.support import CountingTool, ScriptedAgent, event_types, events, make_tool, refund_posts

pytestmark = pytest.mark.usefixtures("roles")


def _nothing_written() -> bool:
    return not Run.objects.exists() and not RunEvent.objects.exists()


# --- run_create ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_create_records_the_run_and_who_started_it(operator):
    run = run_create(
        agent_name="refund",
        input={"order_id": "ord_1001", "amount_cents": 500},
        actor=Actor.for_user(operator, "web"),
        max_steps=7,
    )

    run.refresh_from_db()
    assert (run.status, run.fence, run.max_steps, run.principal) == ("queued", 0, 7, operator)
    assert run.root_run_id == run.id
    (created,) = RunEvent.objects.filter(run=run)
    assert (created.type, created.actor, created.channel) == ("run.created", "user:olivia", "web")
    assert created.payload["principal"] == "olivia"


@pytest.mark.django_db
def test_create_with_a_cost_budget_records_it(operator):
    run = run_create(
        agent_name="refund",
        input={"order_id": "ord_1001", "amount_cents": 500},
        actor=Actor.for_user(operator, "api"),
        max_cost=Decimal("2.50"),
    )

    run.refresh_from_db()
    assert run.max_cost == Decimal("2.50")
    (created,) = RunEvent.objects.filter(run=run)
    assert Decimal(created.payload["budget"]["max_cost"]) == Decimal("2.50")


@pytest.mark.django_db
def test_create_with_unknown_agent_writes_nothing(operator):
    with pytest.raises(UnknownAgent):
        run_create(agent_name="no_such_agent", actor=Actor.for_user(operator, "web"))

    assert _nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "bad_input",
    [
        {"order_id": "ord_1001"},
        {"order_id": "not-an-order", "amount_cents": 500},
        {"order_id": "ord_1001", "amount_cents": -5},
        {"order_id": "ord_1001", "amount_cents": 500, "extra": True},
    ],
    ids=["missing_amount", "bad_order_id", "negative_amount", "unexpected_field"],
)
def test_create_with_bad_input_writes_nothing(operator, bad_input):
    with pytest.raises(InvalidInput) as info:
        run_create(agent_name="refund", input=bad_input, actor=Actor.for_user(operator, "web"))

    assert info.value.code == "validation_error"
    assert _nothing_written()


@pytest.mark.django_db
def test_viewer_cannot_start_a_run(viewer):
    with pytest.raises(PermissionDenied):
        run_create(
            agent_name="refund",
            input={"order_id": "ord_1001", "amount_cents": 500},
            actor=Actor.for_user(viewer, "web"),
        )

    assert _nothing_written()


# --- run_terminate ----------------------------------------------------------------------------


def _waiting_for_approval(system_actor) -> Run:
    run = run_create(
        agent_name="refund",
        input={"order_id": "ord_1004", "amount_cents": 50_000},
        actor=system_actor,
    )
    run = drive(run.id)
    assert run.status == Run.Status.WAITING_APPROVAL
    return run


@pytest.mark.django_db
def test_terminate_unleased_run_cancels_what_was_not_dispatched(
    sandbox, system_actor, operator, approver
):
    run = _waiting_for_approval(system_actor)

    run = run_terminate(
        run_id=run.id, actor=Actor.for_user(operator, "web"), reason="customer withdrew"
    )

    assert run.status == Run.Status.TERMINATED
    assert run.reason_code == Run.Reason.OPERATOR_TERMINATED
    assert run.reason_detail == "customer withdrew"
    assert run.finished_at is not None
    (terminated,) = events(run.id, "run.terminated")
    assert (terminated.actor, terminated.channel) == ("user:olivia", "web")
    assert terminated.payload == {"by": "user:olivia", "reason": "customer withdrew"}
    call = ToolCall.objects.get(run=run, tool_name="refund_payment")
    assert call.status == ToolCall.Status.CANCELLED
    assert call.step.status == Step.Status.FAILED
    approval = Approval.objects.get(run=run)
    assert approval.status == Approval.Status.CANCELLED
    assert events(run.id, "approval.cancelled")[0].payload["reason"] == "run_terminated"

    # the approver arrives too late: nothing can revive the call
    with pytest.raises(AlreadyDecided), transaction.atomic():
        approval_decide(
            approval_id=approval.id, decision="approve", actor=Actor.for_user(approver, "email")
        )
    assert engine.advance(run.id, worker="w1") == "not_claimed"
    assert refund_posts(sandbox) == []


@pytest.fixture
def terminated_mid_call(register, operator):
    """The operator presses terminate while the worker's read call is in flight."""

    def behaviour(arguments, ctx):
        run_terminate(
            run_id=ctx.run_id, actor=Actor.for_user(operator, "web"), reason="wrong customer"
        )

    body = CountingTool(behaviour)

    def decide(ctx):
        if len(ctx.steps) < 3:
            return CallTool("slow_read", {})
        return Finish({})

    register(make_tool("slow_read", body), ScriptedAgent("reader3", decide, tools=("slow_read",)))
    return body


@pytest.mark.django_db
def test_terminate_under_a_live_lease_is_honoured_at_the_next_boundary(
    terminated_mid_call, system_actor
):
    run = run_create(agent_name="reader3", actor=system_actor)

    run = drive(run.id)

    assert run.status == Run.Status.TERMINATED
    assert run.reason_code == Run.Reason.OPERATOR_TERMINATED
    assert len(terminated_mid_call.calls) == 1  # no further decision after the request
    # the call in flight kept its outcome: its receipt came before the termination
    call = ToolCall.objects.get(run=run)
    assert call.status == ToolCall.Status.SUCCEEDED
    assert call.step.status == Step.Status.COMPLETED
    types = event_types(run.id)
    assert types.index("run.terminate_requested") < types.index("tool.succeeded")
    assert types.index("tool.succeeded") < types.index("run.terminated")
    (requested,) = events(run.id, "run.terminate_requested")
    assert requested.actor == "user:olivia"
    # the operator never took the lease: only the worker's claim moved the fence
    assert run.fence == 1
    assert events(run.id, "run.terminated")[0].payload["by"] == "user:olivia"
    assert run.requested_action == ""


@pytest.mark.django_db
def test_terminate_request_does_not_change_a_leased_run_until_the_holder_acts(
    sandbox, system_actor, operator
):
    run = run_create(
        agent_name="refund",
        input={"order_id": "ord_1001", "amount_cents": 500},
        actor=system_actor,
    )
    lease = engine.claim(run.id, worker="w1")

    run = run_terminate(run_id=run.id, actor=Actor.for_user(operator, "web"), reason="stop")

    assert run.status == Run.Status.RUNNING
    assert (run.fence, run.lease_owner) == (lease.fence, "w1")
    assert run.requested_action == Run.Request.TERMINATE
    assert engine.drive(lease) == "parked"
    run.refresh_from_db()
    assert run.status == Run.Status.TERMINATED
    assert refund_posts(sandbox) == []


@pytest.mark.django_db
def test_viewer_cannot_terminate(sandbox, system_actor, viewer):
    run = _waiting_for_approval(system_actor)
    seq = run.event_seq

    with pytest.raises(PermissionDenied):
        run_terminate(run_id=run.id, actor=Actor.for_user(viewer, "web"), reason="no")

    run.refresh_from_db()
    assert (run.status, run.event_seq) == (Run.Status.WAITING_APPROVAL, seq)


@pytest.mark.django_db
def test_terminate_needs_a_reason_and_a_live_run(sandbox, system_actor, operator):
    run = _waiting_for_approval(system_actor)
    actor = Actor.for_user(operator, "web")

    with pytest.raises(InvalidInput):
        run_terminate(run_id=run.id, actor=actor, reason="  ")
    run_terminate(run_id=run.id, actor=actor, reason="done")
    with pytest.raises(InvalidState), transaction.atomic():
        run_terminate(run_id=run.id, actor=actor, reason="again")

    assert len(events(run.id, "run.terminated")) == 1


# --- pause and resume -------------------------------------------------------------------------


@pytest.mark.django_db
def test_paused_run_is_not_claimed_until_resumed(sandbox, system_actor, operator):
    run = run_create(
        agent_name="refund",
        input={"order_id": "ord_1001", "amount_cents": 500},
        actor=system_actor,
    )
    actor = Actor.for_user(operator, "web")

    run = run_pause(run_id=run.id, actor=actor, reason="checking")
    assert run.status == Run.Status.PAUSED
    assert engine.advance(run.id, worker="w1") == "not_claimed"

    run_resume(run_id=run.id, actor=actor)
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert len(refund_posts(sandbox)) == 1
    assert [e.actor for e in events(run.id, "run.paused")] == ["user:olivia"]

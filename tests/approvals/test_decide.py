"""Approvals (DESIGN §7): bound to the exact call, decided once per person, settled once,
consumed once in the dispatch transaction."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.db import transaction
from django.utils import timezone

from approvals.models import Approval, ApprovalDecision
from approvals.services import AlreadyDecided, ApprovalExpired, approval_decide
from runs import engine
from runs.actors import Actor, PermissionDenied
from runs.gate import GateRefused, get_gate
from runs.gate import GateView as gate_view
from runs.models import Run, RunEvent, ToolCall
from runs.registry import ApprovalPolicy, CallTool, Effect, Finish, registry
from runs.services import run_create
from tests.conftest import drive
from tests.support import (
    CountingTool,
    ScriptedAgent,
    WorkerKilled,
    events,
    expire_lease,
    make_tool,
    refund_posts,
    refunds,
    rewind,
    set_faults,
)

pytestmark = pytest.mark.usefixtures("roles")

LARGE_REFUND = {"order_id": "ord_1004", "amount_cents": 50_000}  # order of 2,500.00


def _large_refund(system_actor, principal=None) -> Run:
    run = run_create(
        agent_name="refund", input=LARGE_REFUND, actor=system_actor, principal=principal
    )
    return drive(run.id)


def _decide(approval: Approval, user, decision: str = "approve", **kw) -> Approval:
    return approval_decide(
        approval_id=approval.id, decision=decision, actor=Actor.for_user(user, "web"), **kw
    )


def _refused(exc_type, approval: Approval, user, decision: str = "approve"):
    """A decision that must be refused. The savepoint keeps the test's transaction usable
    after the service's transaction rolls back."""
    with pytest.raises(exc_type) as info, transaction.atomic():
        _decide(approval, user, decision)
    return info.value


def _snapshot(run: Run) -> tuple:
    run.refresh_from_db()
    approval = Approval.objects.get(run=run)
    return (
        run.status,
        run.event_seq,
        approval.status,
        approval.decided_at,
        ApprovalDecision.objects.filter(approval=approval).count(),
        list(ToolCall.objects.filter(run=run).values_list("status", flat=True)),
    )


@pytest.mark.django_db
def test_large_refund_waits_for_approval_without_holding_the_lease(sandbox, system_actor):
    run = _large_refund(system_actor)

    assert run.status == Run.Status.WAITING_APPROVAL
    assert (run.lease_owner, run.lease_expires_at) == ("", None)
    (approval,) = Approval.objects.filter(run=run)
    assert approval.status == Approval.Status.PENDING
    assert approval.tool_name == "refund_payment"
    assert approval.arguments_masked["customer_email"] == "***"
    call = ToolCall.objects.get(run=run, tool_name="refund_payment")
    assert call.status == ToolCall.Status.AWAITING_APPROVAL
    assert (approval.tool_call_id, approval.arguments_digest) == (call.id, call.arguments_digest)
    assert refund_posts(sandbox) == []
    assert engine.advance(run.id, worker="w2") == "not_claimed"


@pytest.mark.django_db
def test_approval_makes_the_run_runnable_and_it_dispatches_exactly_once(
    sandbox, system_actor, approver
):
    run = _large_refund(system_actor)
    approval = Approval.objects.get(run=run)

    _decide(approval, approver, comment="checked the order")

    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    (decided,) = events(run.id, "approval.decided")
    assert (decided.actor, decided.channel) == ("user:alice", "web")
    assert decided.payload["settled"] is True

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.result["refunded"] is True
    assert len(refund_posts(sandbox)) == 1
    (refund,) = refunds(sandbox)
    assert refund["amount_cents"] == 50_000
    approval.refresh_from_db()
    assert approval.status == Approval.Status.APPROVED
    assert approval.consumed_at is not None
    assert len(events(run.id, "approval.consumed")) == 1


@pytest.mark.django_db
def test_second_decision_is_already_decided_and_changes_nothing(
    sandbox, system_actor, approver, second_approver
):
    run = _large_refund(system_actor)
    approval = Approval.objects.get(run=run)
    _decide(approval, approver)
    before = _snapshot(run)

    _refused(AlreadyDecided, approval, second_approver, "reject")
    _refused(AlreadyDecided, approval, approver, "reject")

    assert _snapshot(run) == before
    approval.refresh_from_db()
    assert approval.status == Approval.Status.APPROVED


@pytest.mark.django_db
def test_rejection_reaches_the_agent_as_the_steps_outcome(sandbox, system_actor, approver):
    run = _large_refund(system_actor)
    approval = Approval.objects.get(run=run)

    _decide(approval, approver, "reject", comment="customer already refunded by cheque")
    run = drive(run.id)

    # the run ends failed with the reason a person gave, not as the agent's own failure
    assert (run.status, run.reason_code) == (Run.Status.FAILED, "approval_rejected")
    assert "customer already refunded by cheque" in run.reason_detail
    assert refund_posts(sandbox) == []
    assert refunds(sandbox) == []
    call = ToolCall.objects.get(run=run, tool_name="refund_payment")
    assert call.status == ToolCall.Status.REJECTED
    assert call.step.status == "failed"
    approval.refresh_from_db()
    assert (approval.status, approval.consumed_at) == (Approval.Status.REJECTED, None)


@pytest.mark.django_db
def test_approval_is_consumed_once(sandbox, system_actor, approver):
    run = _large_refund(system_actor)
    approval = Approval.objects.get(run=run)
    _decide(approval, approver)
    lease = engine.claim(run.id, worker="w1")
    call = ToolCall.objects.select_related("step").get(run=run, tool_name="refund_payment")
    tool = registry.tool("refund_payment")

    with lease.checkpoint() as cp:
        get_gate().consume(cp=cp, call=call, tool=tool)
    with pytest.raises(GateRefused), transaction.atomic(), lease.checkpoint() as cp:
        get_gate().consume(cp=cp, call=call, tool=tool)

    assert len(events(run.id, "approval.consumed")) == 1


@pytest.mark.django_db
def test_approval_for_other_arguments_cannot_be_consumed(sandbox, system_actor, approver):
    run = _large_refund(system_actor)
    approval = Approval.objects.get(run=run)
    _decide(approval, approver)
    lease = engine.claim(run.id, worker="w1")
    call = ToolCall.objects.select_related("step").get(run=run, tool_name="refund_payment")
    call.arguments_digest = "0" * 64  # the call now stands for different arguments

    with pytest.raises(GateRefused), transaction.atomic(), lease.checkpoint() as cp:
        get_gate().consume(cp=cp, call=call, tool=registry.tool("refund_payment"))

    approval.refresh_from_db()
    assert approval.consumed_at is None


@pytest.mark.django_db(transaction=True)
def test_resurrected_approved_call_asks_again_instead_of_dispatching_twice(
    sandbox, system_actor, approver, monkeypatch
):
    from agentops.demo.tools import REFUND_PAYMENT

    run = _large_refund(system_actor)
    approval = Approval.objects.get(run=run)
    _decide(approval, approver)
    real_call = REFUND_PAYMENT.call

    def refund_then_die(arguments, ctx):
        real_call(arguments, ctx)
        raise WorkerKilled

    monkeypatch.setattr(REFUND_PAYMENT, "call", refund_then_die)
    with pytest.raises(WorkerKilled):
        engine.advance(run.id, worker="w1")
    monkeypatch.setattr(REFUND_PAYMENT, "call", real_call)
    approval.refresh_from_db()
    assert approval.consumed_at is not None
    # a bug or a bad manual edit puts the call back to approved: the consumed approval
    # must not let it through a second time
    ToolCall.objects.filter(run=run, tool_name="refund_payment").update(
        status=ToolCall.Status.APPROVED
    )
    expire_lease(run.id)

    run = drive(run.id)

    assert run.status == Run.Status.WAITING_APPROVAL
    assert len(refund_posts(sandbox)) == 1
    assert len(refunds(sandbox)) == 1
    pending = Approval.objects.get(run=run, status=Approval.Status.PENDING)
    assert pending.id != approval.id
    assert "no unconsumed approval" in events(run.id, "run.waiting")[-1].payload["why"]


@pytest.mark.django_db
def test_expired_approval_cannot_be_approved(sandbox, system_actor, approver):
    run = _large_refund(system_actor)
    approval = Approval.objects.get(run=run)
    Approval.objects.filter(id=approval.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    before = _snapshot(run)

    error = _refused(ApprovalExpired, approval, approver)

    assert error.code == "approval_expired"
    assert _snapshot(run) == before


@pytest.mark.django_db
def test_people_outside_the_approver_group_cannot_decide(
    sandbox, system_actor, viewer, operator, django_user_model
):
    run = _large_refund(system_actor)
    approval = Approval.objects.get(run=run)
    admin = django_user_model.objects.create_user(username="adam", password="pw")
    admin.groups.add(Group.objects.get(name="admin"))  # may decide, but not this group's
    before = _snapshot(run)

    for user in (viewer, operator, admin):
        _refused(PermissionDenied, approval, user)

    assert _snapshot(run) == before


@pytest.mark.django_db
def test_principal_cannot_approve_their_own_run(sandbox, system_actor, approver):
    run = _large_refund(system_actor, principal=approver)
    approval = Approval.objects.get(run=run)
    before = _snapshot(run)

    error = _refused(PermissionDenied, approval, approver)

    assert "principal" in str(error)
    assert _snapshot(run) == before


@pytest.mark.django_db
def test_whoever_started_the_run_cannot_approve_its_calls(sandbox, approver, second_approver):
    """Separation of duties (DESIGN §9): the approver who started the run (as themselves or
    through a service account's token they created) does not approve it; someone else may."""
    approver.groups.add(Group.objects.get(name="operator"))  # on call: starts runs too
    run = drive(
        run_create(
            agent_name="refund",
            input=LARGE_REFUND,
            actor=Actor.for_user(approver, "web"),
            principal=second_approver,  # acting for someone else: still the one who started it
        ).id
    )
    approval = Approval.objects.get(run=run)
    before = _snapshot(run)

    error = _refused(PermissionDenied, approval, approver)

    assert "drove this run (run.created)" in str(error)
    assert _snapshot(run) == before
    assert "approval.decided" not in [e.type for e in RunEvent.objects.filter(run=run)]


@pytest.mark.django_db
def test_starting_a_run_through_a_token_one_created_counts_as_driving_it(
    sandbox, approver, django_user_model
):
    from runs.models import ApiToken

    service = django_user_model.objects.create_user("svc-refunds")
    service.groups.add(Group.objects.get(name="operator"))
    # an admin may have created it for them: what counts is whose label it carries
    token = ApiToken.objects.create(
        name="refund-bot",
        prefix="ao_x",
        token_hash="0" * 64,
        principal=service,
        created_by=f"user:{approver.get_username()}",
    )
    actor = Actor(label=f"token:{token.name}", channel="api", user=service)
    run = drive(run_create(agent_name="refund", input=LARGE_REFUND, actor=actor).id)
    approval = Approval.objects.get(run=run)

    error = _refused(PermissionDenied, approval, approver)

    assert "separation of duties" in str(error)


@pytest.fixture
def two_person_tool(register):
    body = CountingTool()

    def decide(ctx):
        if not ctx.steps:
            return CallTool("wire_transfer", {"amount_cents": 1_000_000})
        return Finish({"status": ctx.last_step.status})

    register(
        make_tool(
            "wire_transfer",
            body,
            effect=Effect.IDEMPOTENT,
            approval=ApprovalPolicy(when="always", required=2),
        ),
        ScriptedAgent("treasurer", decide, tools=("wire_transfer",)),
    )
    return body


@pytest.mark.django_db
def test_two_person_rule_needs_two_different_approvers(
    two_person_tool, system_actor, approver, second_approver
):
    run = drive(run_create(agent_name="treasurer", actor=system_actor).id)
    approval = Approval.objects.get(run=run)
    assert approval.required_count == 2

    _decide(approval, approver)
    run.refresh_from_db()
    approval.refresh_from_db()
    assert (run.status, approval.status) == (Run.Status.WAITING_APPROVAL, "pending")
    _refused(AlreadyDecided, approval, approver)  # the same person twice is not two
    assert engine.advance(run.id, worker="w1") == "not_claimed"
    assert two_person_tool.calls == []

    _decide(approval, second_approver)
    run = drive(run.id)

    approval.refresh_from_db()
    assert approval.status == Approval.Status.APPROVED
    assert approval.decisions.count() == 2
    assert run.status == Run.Status.SUCCEEDED
    assert len(two_person_tool.calls) == 1
    settled = [e.payload["settled"] for e in events(run.id, "approval.decided")]
    assert settled == [False, True]


@pytest.mark.django_db
def test_any_rejection_settles_a_two_person_approval(
    two_person_tool, system_actor, approver, second_approver
):
    run = drive(run_create(agent_name="treasurer", actor=system_actor).id)
    approval = Approval.objects.get(run=run)

    _decide(approval, approver)
    _decide(approval, second_approver, "reject")
    run = drive(run.id)

    approval.refresh_from_db()
    assert approval.status == Approval.Status.REJECTED
    assert run.result == {"status": "failed"}
    assert two_person_tool.calls == []
    assert RunEvent.objects.filter(run=run, type="approval.consumed").count() == 0


@pytest.mark.django_db
def test_approved_call_resent_after_an_absent_lookup_uses_the_same_approval(
    sandbox, system_actor, approver
):
    set_faults(sandbox, error_next=1)  # the approved refund's first POST is not applied
    run = _large_refund(system_actor)
    _decide(Approval.objects.get(run=run), approver)

    run = drive(run.id)  # 503 -> unknown -> absent: waits out the window
    assert run.status == Run.Status.QUEUED
    rewind(run.id)
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert [p["applied"] for p in refund_posts(sandbox)] == [False, True]
    assert len(refunds(sandbox)) == 1
    assert Approval.objects.filter(run=run).count() == 1
    assert len(events(run.id, "approval.consumed")) == 1


@pytest.mark.django_db
def test_runs_asks_the_gate_what_became_of_a_calls_approval(sandbox, system_actor, approver):
    """``runs`` never reads approvals' tables: the gate says, per call, each approval's id
    and state — pending, approved (not yet used), then consumed by the dispatch."""
    run = _large_refund(system_actor)
    approval = Approval.objects.get(run=run)
    call = approval.tool_call
    gate = get_gate()
    assert gate.approvals_of([call.id]) == {call.id: [gate_view(approval.id, "pending")]}
    _decide(approval, approver)
    assert [v.state for v in gate.approvals_of([call.id])[call.id]] == ["approved"]
    assert gate.approvals_of([call.id])[call.id][0].live
    drive(run.id)
    (view,) = gate.approvals_of([call.id])[call.id]
    assert (view.id, view.state, view.live) == (approval.id, "consumed", False)
    assert gate.approvals_of([]) == {}
